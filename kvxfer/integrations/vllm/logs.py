"""kvxfer's log lines in a vLLM engine's log.

vLLM configures its own `vllm` logger (its handler, format and `VLLM_LOGGING_LEVEL`) and leaves
the root logger alone, so another package's INFO and DEBUG lines go nowhere in a real engine
and its warnings come out bare. The connectors give kvxfer's logger a handler like vLLM's (its
stream, its format) at `KVXFER_LOGGING_LEVEL` (default: vLLM's level):
`KVXFER_LOGGING_LEVEL=DEBUG` adds kvxfer's debug lines (a request's timeline among them)
without vLLM's own. A `kvxfer` logger the user configured (it has handlers) is left as it is.
"""

from __future__ import annotations

import logging
import os

LEVEL_ENV = "KVXFER_LOGGING_LEVEL"


def log_through_vllm() -> None:
    """Send the `kvxfer` logger's lines where vLLM's go, as vLLM formats them (once per process).

    Raises:
        ValueError: `KVXFER_LOGGING_LEVEL` is not a logging level name.
    """
    kvxfer, vllm = logging.getLogger("kvxfer"), logging.getLogger("vllm")
    if kvxfer.handlers or not vllm.handlers:
        return
    level = os.environ.get(LEVEL_ENV, "").strip().upper()
    if level and not isinstance(logging.getLevelName(level), int):
        raise ValueError(
            f"{LEVEL_ENV}={os.environ[LEVEL_ENV]!r} is not a logging level; use DEBUG, INFO, "
            "WARNING or ERROR"
        )
    # vLLM's handler filters at vLLM's level: kvxfer's own, to its stream, in its format.
    template = vllm.handlers[0]
    stream = getattr(template, "stream", None)
    handler = logging.StreamHandler(stream) if stream is not None else logging.StreamHandler()
    handler.setFormatter(template.formatter)
    kvxfer.addHandler(handler)
    kvxfer.setLevel(level or vllm.getEffectiveLevel())
    kvxfer.propagate = False
