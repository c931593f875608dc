"""The driver of kvxfer's end-to-end checks with real `vllm serve` engines: prompts, HTTP
calls, comparison, report, and the processes it starts.

Two front ends share it: `scripts/gpu_vllm_e2e.sh` (+ `gpu_vllm_e2e.py`, its command line) on
an NVIDIA GPU, and `tests/e2e/` (`make test-e2e`) with vLLM's CPU build. Standard library only
(it runs in the vLLM environment, and its tests run on machines without vLLM, against a fake
OpenAI-compatible server).

`collect` sends the requests one at a time by default, so each engine runs every prompt alone
in its batch: a greedy output then depends on the prompt and the KV cache only, not on which
other requests shared a step; `concurrency` > 1 sends that many at once (threads).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

# The decode engine's Prometheus counter of prompt tokens whose KV a connector loaded (vLLM
# 0.33, `vllm:prompt_tokens_by_source`): the proof that decode used the transferred KV instead
# of quietly computing the prompt itself (the outputs would match either way).
TRANSFER_METRIC = "vllm:prompt_tokens_by_source"
TRANSFER_SOURCE = 'source="external_kv_transfer"'
# A prompt: text, or token ids (vLLM's /v1/completions takes either).
Prompt = str | list[int]
T = TypeVar("T")
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
PROMPTS: tuple[Prompt, ...] = (
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
    load_failure_policy: str = "fail",
) -> dict[str, Any]:
    """vLLM's `--kv-transfer-config` for kvxfer's connector in `role` ("kv_producer",
    "kv_consumer" or "kv_both"), both engines on this host over Mooncake TCP. By default a
    decode engine fails a request whose KV does not arrive (`kv_load_failure_policy` "fail")
    instead of recomputing it, so a broken transfer cannot pass for a working one; "recompute"
    makes it compute the missing blocks itself. `extra` adds or replaces `kv_connector_extra_config`
    keys (docs/vllm.md, "Extra-config keys")."""
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
        # By name: kvxfer's vLLM plugin registers it (kvxfer/integrations/vllm_plugin.py).
        "kv_connector": "KvxferConnector",
        "kv_role": role,
        "engine_id": engine_id,
        "kv_connector_extra_config": connector,
    }
    if role in ("kv_consumer", "kv_both"):
        config["kv_load_failure_policy"] = load_failure_policy
    return config


# --- HTTP ----------------------------------------------------------------------------------


def completion_request(
    prompt: Prompt,
    model: str,
    max_tokens: int,
    seed: int,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The body of one greedy, non-streamed `POST /v1/completions`. vLLM returns the output's
    token ids too (`return_token_ids`), so outputs are compared token by token, not only as
    text, and the two most likely tokens at each step (`logprobs`), so a mismatch can say
    whether it fell on a near-tie. `extra` adds fields (vLLM's `ignore_eos`, for instance)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "seed": seed,
        "stream": False,
        "return_token_ids": True,
        "logprobs": 2,
    }
    body.update(extra or {})
    return body


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


def metrics_text(metrics_url: str, timeout: float = 10.0) -> str:
    """An engine's Prometheus exposition (`GET /metrics`)."""
    try:
        with _OPENER.open(metrics_url, timeout=timeout) as response:
            return str(response.read().decode(errors="replace"))
    except (urllib.error.URLError, OSError) as exc:
        raise E2EError(f"GET {metrics_url}: {exc}") from None


def metric_total(text: str, name: str, label: str | None = None) -> float | None:
    """The sum of the samples of metric `name` (a counter's `_total` sample too) whose labels
    contain `label` (e.g. `source="external_kv_transfer"`), over every engine; None when no
    sample matches."""
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        sample = line.split("{", 1)[0].split(" ", 1)[0]
        if sample in (name, name + "_total") and (label is None or label in line):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    return total if found else None


def external_kv_tokens(metrics_url: str, timeout: float = 10.0) -> float | None:
    """The decode engine's count of prompt tokens loaded through a KV connector, summed over its
    engines; None when the metric is absent (another vLLM version, or stats turned off)."""
    return metric_total(metrics_text(metrics_url, timeout), TRANSFER_METRIC, TRANSFER_SOURCE)


def wait_until(
    condition: Callable[[], T | None], *, timeout: float, what: str, interval: float = 0.2
) -> T:
    """Poll `condition` until it returns something other than None or False; that value.

    Raises:
        E2EError: naming `what`, when `timeout` seconds passed first.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value is not None and value is not False:
            return value
        if time.monotonic() > deadline:
            raise E2EError(f"{what}: not within {timeout:g} s")
        time.sleep(interval)


def collect(
    url: str,
    model: str,
    *,
    prompts: Sequence[Prompt] = PROMPTS,
    max_tokens: int = 32,
    seed: int = 0,
    timeout: float = 300.0,
    metrics_url: str | None = None,
    concurrency: int = 1,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Greedy completions of `prompts` from the engine (or proxy) at `url`, `concurrency`
    requests in flight at a time (1: one after the other); with `metrics_url`, also how many
    prompt tokens' KV that engine loaded meanwhile. `extra`: more request fields."""
    endpoint = url.rstrip("/") + "/v1/completions"
    before = external_kv_tokens(metrics_url) if metrics_url else None

    def complete(index: int) -> dict[str, Any]:
        body = completion_request(prompts[index], model, max_tokens, seed, extra)
        try:
            answer = post_json(endpoint, body, timeout)
        except E2EError as exc:
            raise E2EError(f"prompt {index}: {exc}") from None
        return parse_completion(answer, endpoint)

    if concurrency <= 1:
        outputs = [complete(index) for index in range(len(prompts))]
    else:
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            outputs = list(pool.map(complete, range(len(prompts))))
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
        "concurrency": max(1, concurrency),
    }


# --- comparison ----------------------------------------------------------------------------


@dataclasses.dataclass
class Comparison:
    """The verdict of `compare`: ok, a one-line summary, each problem, the JSON report."""

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
        margins: tuple[float | None, float | None] = (None, None)
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


@dataclasses.dataclass
class Launched:
    """A process `launch` started: the leader of its own process group, its log file."""

    name: str
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def pgid(self) -> int:
        """Its process group (the leader's pid: `launch` starts a new session)."""
        return self.process.pid

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM its process group, SIGKILL what outlives `timeout`; reap the leader."""
        stop_groups([self.pgid], timeout)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10.0)

    def kill(self) -> None:
        """SIGKILL its whole process group at once (a crash, not a shutdown)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, signal.SIGKILL)


def launch(
    name: str, argv: Sequence[str], log_dir: Path, env: Mapping[str, str] | None = None
) -> Launched:
    """Start `argv` in a new session (its own process group, so `Launched.stop` ends every
    process it starts), stdout and stderr to `log_dir/NAME.log`; `env` adds variables."""
    log = log_dir / f"{name}.log"
    with log.open("ab") as out:
        process = subprocess.Popen(
            list(argv),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
    return Launched(name, process, log)


def log_tail(log: Path, lines: int = 40) -> str:
    """The last `lines` lines of a log, headed by its path ("" when there is no such file)."""
    try:
        text = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return f"---- last {lines} lines of {log} ----\n" + "\n".join(text[-lines:])
