"""kvxfer's lines in a vLLM engine's log (`kvxfer.integrations.vllm.logs`): with vLLM's logging
configured as an engine process has it, kvxfer's INFO lines come out in vLLM's format, its
DEBUG lines only at `KVXFER_LOGGING_LEVEL=DEBUG` (vLLM's own stay at vLLM's level), and a bad
level is refused by name. Each case runs in a fresh interpreter: logging is process state."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

SCRIPT = """
import logging
import vllm.logger
try:  # vLLM 0.33 configures logging as each engine process starts (0.32: at this import)
    from vllm.config.logging import LoggingConfig
    vllm.logger.configure_logging(LoggingConfig())
except ImportError:
    pass
from kvxfer.integrations.vllm.logs import log_through_vllm

log_through_vllm()
logging.getLogger("kvxfer.integrations.vllm.timelines").debug("a timeline line")
logging.getLogger("kvxfer.integrations.vllm.worker").info("a worker line")
logging.getLogger("vllm.some.module").debug("a vllm debug line")
"""


def run(level: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("KVXFER_LOGGING_LEVEL",)}
    env.pop("VLLM_LOGGING_LEVEL", None)
    if level is not None:
        env["KVXFER_LOGGING_LEVEL"] = level
    return subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300
    )


@pytest.mark.parametrize("level", [None, "debug"])
def test_kvxfer_lines_come_out_in_vllms_format_at_their_own_level(level):
    done = run(level)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    worker = [line for line in lines if "a worker line" in line]
    assert len(worker) == 1, done.stdout[-2000:]
    assert re.search(r"INFO \d\d-\d\d \d\d:\d\d:\d\d \[", worker[0]), worker  # vLLM's format
    assert any("a timeline line" in line for line in lines) == (level == "debug")
    assert not any("a vllm debug line" in line for line in lines)


def test_a_bad_level_is_refused_by_name():
    done = run("LOUD")
    assert done.returncode != 0
    assert "KVXFER_LOGGING_LEVEL='LOUD' is not a logging level" in done.stderr
