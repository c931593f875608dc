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

Requests go one at a time, so each engine runs every prompt alone in its batch: a greedy output
then depends on the prompt and the KV cache only, not on which other requests shared a step.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.metadata
import importlib.util
import json
import os
import signal
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# The decode engine's Prometheus counter of prompt tokens whose KV a connector loaded (vLLM
# 0.33, `vllm:prompt_tokens_by_source`): the proof that decode used the transferred KV instead
# of quietly computing the prompt itself (the outputs would match either way).
TRANSFER_METRIC = "vllm:prompt_tokens_by_source"
TRANSFER_SOURCE = 'source="external_kv_transfer"'
# The engines are on this host: never through an HTTP proxy from the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
# A first choice less than this many nats ahead of the second is reported as a near-tie.
NEAR_TIE = 0.05

_ANIMALS = ("whale", "falcon", "otter", "lynx", "heron", "bison", "gecko", "moose", "tapir")
_COLORS = ("blue", "red", "green", "grey", "amber", "white", "black", "violet")


def _long_prompt() -> str:
    """Over 1,000 tokens of numbered facts and a question: many blocks of 16 and of 32."""
    lines = [
        f"{i}. The {_COLORS[i % len(_COLORS)]} {_ANIMALS[(3 * i) % len(_ANIMALS)]} of pen {i} "
        f"weighs {(37 * i) % 91 + 4} kilograms and eats {(11 * i) % 7 + 1} meals a day."
        for i in range(1, 81)
    ]
    return "Zoo inventory:\n" + "\n".join(lines) + "\nQuestion: which pens hold a blue whale?\n"


# Fixed prompt set: short and long, prose, code and lists; lengths not aligned to any block
# size, so every request ends in a partly filled block on both sides.
PROMPTS: tuple[str, ...] = (
    "The capital of France is",
    "Hello",
    "List three prime numbers greater than 100:",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Translate to German: The weather is nice today, so we are going for a walk in the park.",
    (
        "A large language model keeps, for every token it has read, a key and a value vector "
        "in each attention layer. Serving systems store these vectors in fixed-size blocks of "
        "GPU memory, and a disaggregated deployment computes them on a prefill engine before "
        "a decode engine, which may split the attention heads and the blocks differently, "
        "continues the text. In summary,"
    ),
    _long_prompt(),
    "Q: What is 17 times 23?\nA:",
)


class E2EError(Exception):
    """A check failed; the message says which and what to do."""


# --- prerequisites -----------------------------------------------------------------------


def check_prerequisites() -> list[str]:
    """What is missing for real engines on this Python, each with its fix ([] when nothing)."""
    problems = []
    if importlib.util.find_spec("vllm") is None:
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


def check_ports_free(ports: Sequence[int], host: str = "127.0.0.1") -> None:
    """Raises E2EError naming each port something already listens on (an engine left running
    would otherwise answer the health check in place of the one this run starts)."""
    bad = [port for port in ports if not 0 < port < 65536]
    if bad:
        raise E2EError(f"not TCP ports: {bad}")
    taken = []
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.settimeout(1.0)
            if probe.connect_ex((host, port)) == 0:
                taken.append(port)
    if taken:
        raise E2EError(
            f"something already listens on {host}:{taken}: stop it, or choose other ports "
            "(BASELINE_PORT, PREFILL_PORT, DECODE_PORT, PROXY_PORT)"
        )


def kv_transfer_config(
    role: str,
    engine_id: str,
    *,
    side_channel_port: int,
    secret: str,
    host: str = "127.0.0.1",
    strategy: str | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """vLLM's `--kv-transfer-config` for kvxfer's connector in `role` ("kv_producer" or
    "kv_consumer"), both engines on this host over Mooncake TCP. A decode engine fails a request
    whose KV does not arrive (`kv_load_failure_policy` "fail") instead of recomputing it, so a
    broken transfer cannot pass for a working one. `extra` adds or replaces
    `kv_connector_extra_config` keys (README, vLLM integration)."""
    connector = {
        "side_channel_host": host,
        "side_channel_port": side_channel_port,
        "protocol": "tcp",
        "cost_model": "tcp_loopback",
        "secret": secret,
    }
    if strategy:
        connector["strategy"] = strategy
    connector.update(extra or {})
    config: dict[str, Any] = {
        "kv_connector": "KvxferConnector",
        "kv_connector_module_path": "kvxfer.integrations.vllm",
        "kv_role": role,
        "engine_id": engine_id,
        "kv_connector_extra_config": connector,
    }
    if role == "kv_consumer":
        config["kv_load_failure_policy"] = "fail"
    return config


# --- HTTP ----------------------------------------------------------------------------------


def completion_request(prompt: str, model: str, max_tokens: int, seed: int) -> dict[str, Any]:
    """The body of one greedy, non-streamed `POST /v1/completions`. vLLM returns the output's
    token ids too (`return_token_ids`), so outputs are compared token by token, not only as
    text, and the two most likely tokens at each step (`logprobs`), so a mismatch can say
    whether it fell on a near-tie."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "seed": seed,
        "stream": False,
        "return_token_ids": True,
        "logprobs": 2,
    }


def post_json(url: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    """POST `body` as JSON and parse the answer; an HTTP error raises E2EError with the
    server's own message (the proxy's says whether prefill or decode failed)."""
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    try:
        with _OPENER.open(request, timeout=timeout) as response:
            answer: dict[str, Any] = json.loads(response.read())
            return answer
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:2000]
        raise E2EError(f"POST {url}: HTTP {exc.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise E2EError(f"POST {url}: {exc}") from None
    except ValueError as exc:
        raise E2EError(f"POST {url}: the answer is not JSON: {exc}") from None


def parse_completion(answer: dict[str, Any], url: str) -> dict[str, Any]:
    """The parts of a completion that are compared and reported."""
    try:
        choice = answer["choices"][0]
        text = choice["text"]
    except (KeyError, IndexError, TypeError):
        raise E2EError(f"{url}: not a completion: {json.dumps(answer)[:500]}") from None
    usage = answer.get("usage") or {}
    logprobs = choice.get("logprobs") or {}
    return {
        "text": text,
        "token_ids": choice.get("token_ids"),
        "finish_reason": choice.get("finish_reason"),
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
        "top_logprobs": logprobs.get("top_logprobs"),
    }


def external_kv_tokens(metrics_url: str, timeout: float = 10.0) -> float | None:
    """The decode engine's count of prompt tokens loaded through a KV connector, summed over its
    engines; None when the metric is absent (another vLLM version, or stats turned off)."""
    try:
        with _OPENER.open(metrics_url, timeout=timeout) as response:
            text = response.read().decode(errors="replace")
    except (urllib.error.URLError, OSError) as exc:
        raise E2EError(f"GET {metrics_url}: {exc}") from None
    total, found = 0.0, False
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in (TRANSFER_METRIC, TRANSFER_METRIC + "_total") and TRANSFER_SOURCE in line:
            total += float(line.rsplit(" ", 1)[1])
            found = True
    return total if found else None


def collect(
    url: str,
    model: str,
    *,
    prompts: Sequence[str] = PROMPTS,
    max_tokens: int = 32,
    seed: int = 0,
    timeout: float = 300.0,
    metrics_url: str | None = None,
) -> dict[str, Any]:
    """Greedy completions of `prompts` from the engine (or proxy) at `url`, one request at a
    time; with `metrics_url`, also how many prompt tokens' KV that engine loaded meanwhile."""
    endpoint = url.rstrip("/") + "/v1/completions"
    before = external_kv_tokens(metrics_url) if metrics_url else None
    outputs = []
    for index, prompt in enumerate(prompts):
        body = completion_request(prompt, model, max_tokens, seed)
        try:
            answer = post_json(endpoint, body, timeout)
        except E2EError as exc:
            raise E2EError(f"prompt {index}: {exc}") from None
        outputs.append(parse_completion(answer, endpoint))
    loaded = None
    if metrics_url:
        after = external_kv_tokens(metrics_url)
        # The counter is updated from the scheduler's stats, which may trail the last answer.
        deadline = time.monotonic() + 5.0
        while after is not None and before is not None and after <= before:
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
            after = external_kv_tokens(metrics_url)
        if after is not None:
            loaded = after - (before or 0.0)
    return {
        "url": url,
        "model": model,
        "max_tokens": max_tokens,
        "seed": seed,
        "prompts": list(prompts),
        "outputs": outputs,
        "metrics_url": metrics_url,
        "external_kv_transfer_tokens": loaded,
    }


# --- comparison ----------------------------------------------------------------------------


@dataclasses.dataclass
class Comparison:
    ok: bool
    summary: str
    problems: list[str]
    report: dict[str, Any]


def _first_difference(a: Sequence[Any], b: Sequence[Any]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def top_two_margin(output: dict[str, Any], step: int) -> float | None:
    """How much more likely the first choice was than the second at generation `step` (a
    difference of logprobs), or None when the engine did not return two."""
    steps = output.get("top_logprobs") or []
    if step >= len(steps) or not isinstance(steps[step], dict):
        return None
    best = sorted(steps[step].values(), reverse=True)
    return float(best[0] - best[1]) if len(best) >= 2 else None


def _excerpt(text: str, at: int, width: int = 40) -> str:
    start = max(0, at - 10)
    return repr(("…" if start else "") + text[start : at + width])


def compare(
    baseline: dict[str, Any], disaggregated: dict[str, Any], *, require_transfer: bool = True
) -> Comparison:
    """Every prompt's greedy output through prefill → decode equals the single engine's, token
    for token (text too); and, with `require_transfer`, the decode engine loaded KV."""
    problems = []
    for key in ("model", "max_tokens", "seed", "prompts"):
        if baseline.get(key) != disaggregated.get(key):
            problems.append(f"the two runs differ in {key}: not comparable")
    base_out, disagg_out = baseline["outputs"], disaggregated["outputs"]
    if len(base_out) != len(disagg_out):
        problems.append(f"{len(base_out)} baseline outputs but {len(disagg_out)} disaggregated")
    mismatches = []
    for index, (b, d) in enumerate(zip(base_out, disagg_out, strict=False)):
        tokens_known = b.get("token_ids") is not None and d.get("token_ids") is not None
        if b["text"] == d["text"] and (not tokens_known or b["token_ids"] == d["token_ids"]):
            continue
        char = _first_difference(b["text"], d["text"])
        token = _first_difference(b["token_ids"], d["token_ids"]) if tokens_known else None
        where = f"token {token}" if token is not None else f"character {char}"
        margins = (None, None)
        if token is not None:
            margins = (top_two_margin(b, token), top_two_margin(d, token))
        tie = ""
        if margins[0] is not None and margins[1] is not None:
            tie = (
                f" (top-two logprob margin there: baseline {margins[0]:.4f}, disaggregated "
                f"{margins[1]:.4f})"
            )
            if min(margins[0], margins[1]) < NEAR_TIE:
                tie += (
                    "; a near-tie, which rounding differences between one prefill and a "
                    "recompute over transferred KV can flip: compare the KV itself next"
                )
        problems.append(
            f"prompt {index}: the outputs differ from {where}: "
            f"baseline {_excerpt(b['text'], char)} vs disaggregated {_excerpt(d['text'], char)}"
            + tie
        )
        mismatches.append(
            {
                "prompt_index": index,
                "first_different_token": token,
                "first_different_character": char,
                "top_two_margins": list(margins),
                "baseline": b,
                "disaggregated": d,
            }
        )
    loaded = disaggregated.get("external_kv_transfer_tokens")
    prompt_tokens = sum(o.get("prompt_tokens") or 0 for o in disagg_out)
    if require_transfer:
        if loaded is None:
            problems.append(
                f"the decode engine's metrics ({disaggregated.get('metrics_url')}) have no "
                f"{TRANSFER_METRIC}{{{TRANSFER_SOURCE}}}: nothing shows that its KV came from "
                "the prefill engine (start vLLM without --disable-log-stats)"
            )
        elif loaded <= 0:
            problems.append(
                "the decode engine loaded no KV through the connector "
                f"({TRANSFER_METRIC}{{{TRANSFER_SOURCE}}} did not grow): it computed the "
                "prompts itself, so equal outputs prove nothing; see the decode engine's log "
                "for kvxfer warnings"
            )
    same = len(base_out) - len(mismatches) if len(base_out) == len(disagg_out) else 0
    ok = not problems
    transfer = (
        f"; the decode engine loaded the KV of {loaded:.0f} of {prompt_tokens} prompt tokens "
        "through kvxfer"
        if loaded is not None
        else ""
    )
    summary = (
        f"{'OK' if ok else 'FAILED'}: {same}/{len(base_out)} prompts give the same greedy "
        f"output ({baseline.get('max_tokens')} tokens at most) through prefill → decode as "
        f"one engine alone{transfer}"
    )
    report = {
        "ok": ok,
        "summary": summary,
        "problems": problems,
        "prompts": len(base_out),
        "same": same,
        "mismatches": mismatches,
        "external_kv_transfer_tokens": loaded,
        "prompt_tokens": prompt_tokens,
        "baseline_url": baseline.get("url"),
        "disaggregated_url": disaggregated.get("url"),
        "model": baseline.get("model"),
    }
    return Comparison(ok, summary, problems, report)


# --- processes -----------------------------------------------------------------------------


def _live_pids(pid: int | None = None, pgid: int | Sequence[int] | None = None) -> list[int]:
    """Processes (not zombies) with this pid or in these process groups, from /proc."""
    pgids = {pgid} if isinstance(pgid, int) else set(pgid or ())
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # state, ppid, pgrp, ...
        if fields[0] == "Z":
            continue
        if (pid is not None and int(entry.name) == pid) or int(fields[2]) in pgids:
            found.append(int(entry.name))
    return found


def wait_ready(
    url: str, *, timeout: float, pid: int | None = None, any_status: bool = False
) -> float:
    """Poll `url` until it answers 200 (any HTTP status with `any_status`); seconds waited.

    Raises:
        E2EError: `pid` exited first, or `timeout` passed.
    """
    start, delay = time.monotonic(), 0.05
    while True:
        try:
            with _OPENER.open(url, timeout=5.0) as response:
                if response.status == 200:
                    return time.monotonic() - start
        except urllib.error.HTTPError:
            if any_status:
                return time.monotonic() - start
        except (urllib.error.URLError, OSError):
            pass
        if pid is not None and not _live_pids(pid=pid):
            raise E2EError(f"the process {pid} exited before {url} answered; see its log")
        if time.monotonic() - start > timeout:
            raise E2EError(f"{url} did not answer within {timeout:g} s")
        time.sleep(delay)
        delay = min(1.0, 2 * delay)


def stop_groups(pgids: Sequence[int], timeout: float) -> None:
    """SIGTERM process groups `pgids` (engines and the processes they started), then SIGKILL
    whatever is still alive after `timeout` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pgid in pgids:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, sig)
        deadline = time.monotonic() + (timeout if sig == signal.SIGTERM else 10.0)
        while _live_pids(pgid=pgids):
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        else:
            return


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
