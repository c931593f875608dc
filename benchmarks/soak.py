"""Soak run: prefill and decode ranks in their own processes, random faults, every byte checked.

    .venv/bin/python benchmarks/soak.py --minutes 10 --json [--seed 1] [--record]

A prefill engine of TP 2 (16-token NHD blocks) feeds a decode engine of TP 3 (32-token HND
blocks; one rank forced to pack+unpack, one to direct, one left to the cost model), every rank
in its own process, over Mooncake TCP on 127.0.0.1 (the fault suite's harness,
`kvxfer.testing.rig`). Rounds of 1-3 concurrent requests run back to back, some with a
prefix already on the decode side; about half of the rounds get one fault:

- freeze-consumer, freeze-producer: SIGSTOP a rank during the transfer, for 0.3-2.5 s or (a third
  of the time) about as long as the fetch timeout, then SIGCONT;
- kill-producer: SIGKILL a prefill rank during the transfer, then start it again, on the same
  port or on a new one (then every decode rank calls connect() with the new addresses);
- late-publish: one request is published after its fetches timed out;
- garbage: hostile frames on a prefill rank's side channel during the transfer.

After each round, every decode rank's whole cache is compared with a model built from
kvxfer.reference: the blocks of ok fetches exact, failed blocks still holding the pattern the
consumer wrote into them the moment the result came (as an engine recomputing them would), every
other byte unchanged. Failed blocks go back to the free list at once (the contract says they are
safe to reuse), behind the others, so a late byte is seen either there or in the request that
reuses them. A decode rank whose fetch failed aborts the request, as an engine does.

At the end, staging slots still held (`leaked_slots`) are counted once quarantines had time to
settle, every prefill rank is closed (close() releases what is pending) and the release callback
must have run exactly once per published request (`release_mismatches`; for a killed rank, at
most once). The run stops by itself after `--minutes` (fractions allowed) and prints one JSON
object with `--json`.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

import kvxfer.testing as kt
from kvxfer.testing.results import Benchmark

BENCHMARK = Benchmark(
    name="soak",
    title="soak under random faults",
    command="MC_LOG_LEVEL=ERROR .venv/bin/python benchmarks/soak.py",
    results_dir=Path(__file__).resolve().parent / "results",
)

PREFILL = kt.Geometry(tp=2, heads=6, head_dim=32, block_size=16, num_blocks=1024)
DECODE = kt.Geometry(tp=3, heads=6, head_dim=32, block_size=32, layout="HND", num_blocks=512)
STAGING = kt.ROOMY_STAGING
DECODE_STRATEGIES = ("pack+unpack", "direct", None)  # per decode rank; None: the cost model
FETCH_TIMEOUT_S = 6.0
PUBLISH_DEADLINE_S = 30.0  # a request no decode rank finishes is released then
LATE_DEADLINE_S = 3.0
MAX_TOKENS = 2048
FAULTS = ("freeze-consumer", "freeze-producer", "kill-producer", "late-publish", "garbage")
ROUND_BUDGET_S = 8.0  # a long round (fetch timeout, freeze, restart)
TEARDOWN_S = 8.0  # settling and closing at the end
EXAMPLES = 10


@dataclass
class Tally:
    """What the run counts; `summary` is the JSON object."""

    seed: int
    requests: int = 0
    rounds: int = 0
    faults: Counter = field(default_factory=Counter)
    restarts: Counter = field(default_factory=Counter)
    fetch_errors: Counter = field(default_factory=Counter)
    failed_unfaulted_requests: int = 0
    ok_requests: int = 0
    failed_requests: int = 0
    rank_fetches: int = 0
    rank_failures: int = 0
    corrupted_bytes: int = 0
    corrupted_blocks: int = 0
    stuck_fetches: int = 0
    leaked_slots: int = 0
    pending_at_end: int = 0
    release_mismatches: int = 0
    slowest_unfaulted_fetch_s: float = 0.0
    skipped_rounds: int = 0
    examples: list = field(default_factory=list)
    leaks: dict = field(default_factory=dict)
    errors: Counter = field(default_factory=Counter)

    def error(self, where: str, exc: BaseException | str) -> None:
        """Count an error by its place and last line (a child's traceback ends with it)."""
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        last = lines[-1] if lines else repr(exc)
        self.errors[f"{where}: {last}"[:300]] += 1

    def summary(self, began: float, aborted: str | None = None) -> dict[str, Any]:
        out = {
            "requests": self.requests,
            "faults_injected": sum(self.faults.values()),
            "ok_requests": self.ok_requests,
            "failed_requests": self.failed_requests,
            "corrupted_bytes": self.corrupted_bytes,
            "leaked_slots": self.leaked_slots,
            "release_mismatches": self.release_mismatches,
            "stuck_fetches": self.stuck_fetches,
            "pending_at_end": self.pending_at_end,
            "corrupted_blocks": self.corrupted_blocks,
            "faults": dict(sorted(self.faults.items())),
            "restarts": dict(self.restarts),
            "rounds": self.rounds,
            "skipped_rounds": self.skipped_rounds,
            "failed_unfaulted_requests": self.failed_unfaulted_requests,
            "rank_fetches": self.rank_fetches,
            "rank_failures": self.rank_failures,
            "slowest_unfaulted_fetch_s": round(self.slowest_unfaulted_fetch_s, 3),
            "seconds": round(time.monotonic() - began, 1),
            "seed": self.seed,
            "topology": "prefill TP2 (bs16 NHD) -> decode TP3 (bs32 HND), a process per rank",
            "examples": self.examples,
            "leaks": self.leaks,
            "fetch_errors": dict(self.fetch_errors.most_common(10)),
            "errors": dict(self.errors.most_common(20)),
        }
        if aborted:
            out["aborted"] = aborted
        return out


@dataclass
class ProducerSlot:
    """A prefill rank: its current process, blocks held per published request, and every
    process it ever had (for the release accounting)."""

    rank: int
    proc: kt.Producer
    pool: kt.BlockPool
    held: dict[str, np.ndarray] = field(default_factory=dict)
    published: set[str] = field(default_factory=set)
    history: list[tuple[kt.Producer, set[str]]] = field(default_factory=list)


class Soak:
    """The processes, block pools and models of one run."""

    def __init__(self, seconds: float, seed: int) -> None:
        self.began = time.monotonic()
        self.deadline = self.began + seconds
        self.rng = random.Random(seed)
        self.tally = Tally(seed)
        self.rig = kt.Rig()
        self.producers = [
            ProducerSlot(r, self._start_producer(r, 0), kt.BlockPool(PREFILL.num_blocks, seed + r))
            for r in range(PREFILL.tp)
        ]
        self.consumers = [
            self.rig.consumer(
                DECODE,
                r,
                engine_id="decode",
                options={"strategy": DECODE_STRATEGIES[r], **STAGING},
            )
            for r in range(DECODE.tp)
        ]
        self.dst_pools = [kt.BlockPool(DECODE.num_blocks, seed + 10 + r) for r in range(DECODE.tp)]
        self.excluded: list[set[int]] = [set() for _ in range(DECODE.tp)]
        self.last_use: list[dict[int, str]] = [{} for _ in range(DECODE.tp)]
        self.rig.ready(120)
        for c in self.consumers:
            c.connect(self.addresses)

    # ---- processes ------------------------------------------------------------------------

    def _start_producer(self, rank: int, port: int) -> kt.Producer:
        return self.rig.producer(
            PREFILL,
            rank,
            engine_id="prefill",
            port=port,
            options={"request_timeout_s": PUBLISH_DEADLINE_S, **STAGING},
            name=f"prefill-{rank}-{time.monotonic():.0f}",
        )

    @property
    def addresses(self) -> list[str]:
        return [slot.proc.address for slot in self.producers]

    def _restart(self, slot: ProducerSlot) -> None:
        """A new process for a killed prefill rank, on the same port half of the time."""
        old = slot.proc
        same_port = self.rng.random() < 0.5
        proc = self._start_producer(slot.rank, old.port if same_port else 0)
        try:
            proc.wait_ready(60)
        except kt.ChildError as exc:
            if not same_port:
                raise
            self.tally.error(f"restart on port {old.port} (then a new port)", exc)
            proc = self._start_producer(slot.rank, 0)
        for rid in old.take_events("release"):  # sent before it died
            old.releases[rid] += 1
        slot.published.update(rid for rid, _ in old.take_events("published"))
        slot.history.append((old, slot.published))
        self.tally.restarts["same port" if proc.port == old.port else "new port"] += 1
        slot.proc, slot.held, slot.published = proc, {}, set()
        slot.pool = kt.BlockPool(PREFILL.num_blocks, self.rng.randrange(1 << 30))
        if proc.address != old.address:
            for c in self.consumers:
                try:
                    c.connect(self.addresses)
                except (kt.ChildError, TimeoutError) as exc:
                    self.tally.error(f"{c.name}: connect after a restart", exc)

    def _pump_releases(self) -> None:
        """Give back the prefill blocks of released requests; note delayed publishes."""
        for slot in self.producers:
            proc = slot.proc
            if proc.gone or proc.stopped:
                continue
            try:
                proc.pump()
            except kt.ChildError as exc:
                self.tally.error(proc.name, exc)
                continue
            for rid, _ in proc.take_events("published"):
                slot.published.add(rid)
            for _, why in proc.take_events("publish_error"):
                self.tally.error(f"{proc.name}: publish", why)
            for rid in proc.take_events("release"):
                proc.releases[rid] += 1
                ids = slot.held.pop(rid, None)
                if ids is not None:
                    slot.pool.give(ids)

    # ---- rounds ---------------------------------------------------------------------------

    def _requests(self, n: int) -> list[kt.Request]:
        out = []
        for i in range(self.rng.choice((1, 1, 2, 3))):
            tokens = self.rng.randint(1, MAX_TOKENS)
            start = self.rng.randrange(tokens) if self.rng.random() < 0.2 else 0
            out.append(kt.Request(f"r{n}-{i}", tokens, self.rng.randrange(1 << 30), start))
        return out

    def run_round(self, n: int) -> None:
        self._pump_releases()
        requests = self._requests(n)
        need = sum(PREFILL.blocks_for(r.num_tokens) for r in requests)
        if any(slot.pool.free < need for slot in self.producers):
            self.tally.skipped_rounds += 1
            time.sleep(0.5)  # releases come at the latest at the deadline
            return
        fault = self.rng.choice(FAULTS) if self.rng.random() < 0.5 else None
        late = self.rng.choice(requests) if fault == "late-publish" else None
        self.tally.rounds += 1
        self.tally.requests += len(requests)
        if fault:
            self.tally.faults[fault] += 1

        for slot in self.producers:
            for request in requests:
                ids = slot.pool.take(PREFILL.blocks_for(request.num_tokens))
                slot.held[request.request_id] = ids
                if request is late:
                    slot.proc.publish(
                        request, ids, delay=FETCH_TIMEOUT_S + 0.5, deadline_s=LATE_DEADLINE_S
                    )
                else:
                    slot.proc.publish(request, ids, deadline_s=PUBLISH_DEADLINE_S)
                    slot.published.add(request.request_id)
        dst: list[dict[str, np.ndarray]] = []
        for c, pool in zip(self.consumers, self.dst_pools, strict=True):
            mine = {}
            for request in requests:
                mine[request.request_id] = pool.take(DECODE.blocks_for(request.num_tokens))
                c.fetch(request, mine[request.request_id], timeout=FETCH_TIMEOUT_S)
            dst.append(mine)

        killed = self._inject(fault)
        self._collect(requests, dst, fault)
        if killed is not None:
            self._restart(killed)
        self._pump_releases()

    def _inject(self, fault: str | None) -> ProducerSlot | None:
        if fault in (None, "late-publish"):
            return None
        time.sleep(self.rng.uniform(0.0, 0.3))
        if fault == "freeze-consumer":
            victim: kt.Proc = self.rng.choice(self.consumers)
        elif fault in ("freeze-producer", "kill-producer", "garbage"):
            slot = self.rng.choice(self.producers)
            victim = slot.proc
            if fault == "kill-producer":
                victim.kill()
                return slot
            if fault == "garbage":
                for _, frames in self.rng.sample(kt.garbage_frames(self.rng), 3):
                    kt.send_raw(slot.proc.address, frames, wait=0.05)
                return None
        victim.freeze()
        if self.rng.random() < 0.3:  # past the fetch timeout: the fetch fails first
            time.sleep(self.rng.uniform(FETCH_TIMEOUT_S - 1.5, FETCH_TIMEOUT_S + 1.5))
        else:  # within the dead-peer bound, or just past it
            time.sleep(self.rng.uniform(0.3, 2.5))
        victim.thaw()
        return None

    def _collect(
        self, requests: list[kt.Request], dst: list[dict[str, np.ndarray]], fault: str | None
    ) -> None:
        outcome: dict[str, bool] = {r.request_id: True for r in requests}
        for rank, (c, mine) in enumerate(zip(self.consumers, dst, strict=True)):
            for request in requests:
                rid, ids = request.request_id, mine[request.request_id]
                self.tally.rank_fetches += 1
                try:
                    result = c.result(rid, timeout=FETCH_TIMEOUT_S + 15)
                except (TimeoutError, kt.ChildError) as exc:
                    self.tally.stuck_fetches += 1
                    self.tally.error(f"{c.name}: result", exc)
                    self.excluded[rank].update(int(b) for b in ids)  # never reused
                    outcome[rid] = False
                    continue
                failed = result["failed_block_ids"]
                if result["ok"] and fault is None:
                    seconds = result["finished"] - result["started"]
                    self.tally.slowest_unfaulted_fetch_s = max(
                        self.tally.slowest_unfaulted_fetch_s, seconds
                    )
                if not result["ok"] or failed:
                    outcome[rid] = False
                    self.tally.rank_failures += 1
                    why = result["errors"][-1] if result["errors"] else "no error given"
                    why = re.sub(r"\d+", "N", re.sub(r"^tokens \[\d+, \d+\): ", "", why))
                    self.tally.fetch_errors[f"{fault or 'no fault'}: {why}"[:200]] += 1
                    if not set(failed) <= set(ids.tolist()):
                        self.tally.error(c.name, "failed blocks outside the request")
                c.model.settle(ids, request, failed)
                for b in ids.tolist():
                    self.last_use[rank][b] = f"{rid} {'failed' if b in failed else 'ok'}"
                if not result["ok"]:
                    try:
                        c.call("abort", rid)
                    except (kt.ChildError, TimeoutError) as exc:
                        self.tally.error(f"{c.name}: abort", exc)
                self.dst_pools[rank].give(b for b in ids.tolist() if b not in self.excluded[rank])
        for ok in outcome.values():
            if ok:
                self.tally.ok_requests += 1
            else:
                self.tally.failed_requests += 1
                self.tally.failed_unfaulted_requests += fault is None
        self._check_caches()

    def _check_caches(self) -> None:
        """Every byte of every decode rank against its model; differences are counted once
        (the model then takes the cache's bytes)."""
        for rank, c in enumerate(self.consumers):
            bad = {b: n for b, n in c.model.mismatches().items() if b not in self.excluded[rank]}
            if not bad:
                continue
            self.tally.corrupted_bytes += sum(bad.values())
            self.tally.corrupted_blocks += len(bad)
            for block, nbytes in list(bad.items())[: EXAMPLES - len(self.tally.examples)]:
                last = self.last_use[rank].get(block, "never used")
                self.tally.examples.append(
                    {
                        "round": self.tally.rounds,
                        "rank": rank,
                        "block": block,
                        "bytes": nbytes,
                        "last_use": last,
                    }
                )
            c.model.adopt(bad)

    # ---- the end --------------------------------------------------------------------------

    def finish(self) -> None:
        """Settle, count leaked slots and pending requests, close, account for releases."""
        for p in self.rig.procs:
            if p.stopped:
                p.thaw()
        live_producers = [s.proc for s in self.producers if not s.proc.gone]

        def held() -> dict[str, Any]:
            found: dict[str, Any] = {}
            procs: list[kt.Producer | kt.Consumer] = [*live_producers, *self.consumers]
            for p in procs:
                report = p.report()
                pools = {str(k): f for k, f in report["free_slots"].items()}
                taken = {k: STAGING["staging_slots"] - f for k, f in pools.items()}
                if any(taken.values()):
                    found[f"{p.name} slots held"] = taken
                if report.get("pending"):
                    found[f"{p.name} pending"] = report["pending"]
            return found

        found = kt.poll(held, lambda v: not v, timeout=10.0, every=0.25)
        self.tally.leaked_slots = sum(
            sum(v.values()) for k, v in found.items() if k.endswith("slots held")
        )
        self.tally.pending_at_end = sum(len(v) for k, v in found.items() if k.endswith("pending"))
        self.tally.leaks = {k: v if isinstance(v, dict) else v[:5] for k, v in found.items()}
        self._check_caches()

        for slot in self.producers:
            report = slot.proc.call("close", timeout=60)
            self._account(Counter(report["releases"]), set(report["published"]), dead=False)
            for old, published in slot.history:
                self._account(old.releases, published, dead=True)

    def _account(self, releases: Counter, published: set[str], dead: bool) -> None:
        for rid in set(releases) | published:
            n = releases.get(rid, 0)
            if rid not in published or n > 1 or (n == 0 and not dead):
                self.tally.release_mismatches += 1
                self.tally.error("release", f"called {n} times for a request ({rid})")

    def close(self) -> None:
        self.rig.close()


def figure(summary: dict[str, Any]) -> tuple[str, str]:
    """The page's figure and targets: what the run did and what it found wrong."""
    checks = {k: summary[k] for k in ("corrupted_bytes", "leaked_slots", "release_mismatches")}
    text = (
        f"{summary['requests']} requests in {summary['seconds'] / 60:.0f} min, "
        f"{summary['faults_injected']} faults, {summary['failed_requests']} requests failed "
        f"({summary['failed_unfaulted_requests']} outside a fault's round); "
        + ", ".join(f"`{k}` {v}" for k, v in checks.items())
        + (f"; aborted: {summary['aborted']}" if "aborted" in summary else "")
    )
    met = not any(checks.values()) and "aborted" not in summary
    return text, f"every check at 0 ({'met' if met else 'not met'})"


def main(argv: list[str] | None = None) -> int:
    """Run the soak; print its summary; 1 when a check failed or the run aborted."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=1.0, help="how long to run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    BENCHMARK.add_record_flag(parser)
    args = parser.parse_args(argv)
    seconds = args.minutes * 60

    began = time.monotonic()
    soak: Soak | None = None
    printed = threading.Event()
    # Progress on a terminal only: stderr, never with --json or when either stream is redirected.
    show = not args.json and sys.stdout.isatty() and sys.stderr.isatty()
    bar = (
        tqdm(
            total=round(seconds),
            desc="soak: starting the ranks",
            unit="s",
            file=sys.stderr,
            leave=False,
            dynamic_ncols=True,
            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total} s{postfix}",
        )
        if show
        else None
    )

    def progress(what: str) -> None:
        if bar is None:
            return
        bar.n = min(bar.total, round(time.monotonic() - began))
        if soak is not None:
            t = soak.tally
            bar.set_postfix_str(
                f"{t.rounds} rounds, {t.requests} requests, {sum(t.faults.values())} faults, "
                f"{t.failed_requests} failed, {t.corrupted_bytes} corrupted bytes",
                refresh=False,
            )
        bar.set_description_str(what, refresh=False)
        bar.refresh()

    def report(summary: dict) -> None:
        if printed.is_set():
            return
        printed.set()
        if bar is not None:
            bar.close()
        if args.json:
            print(json.dumps(summary), flush=True)
        else:
            for key, value in summary.items():
                print(f"{key}: {value}")
            sys.stdout.flush()

    def watchdog() -> None:  # a hang anywhere still ends the run, with what was counted
        tally = soak.tally if soak is not None else Tally(args.seed)
        report(tally.summary(began, aborted="watchdog: the run did not end in time"))
        if soak is not None:
            for p in soak.rig.procs:
                p.kill()
        import os

        os._exit(2)

    timer = threading.Timer(seconds + 120, watchdog)
    timer.daemon = True
    timer.start()
    try:
        progress("soak: starting the ranks")
        soak = Soak(seconds, args.seed)
        n = 0
        while time.monotonic() + ROUND_BUDGET_S + TEARDOWN_S < soak.deadline or n == 0:
            progress("soak")
            soak.run_round(n)
            n += 1
        progress("soak: settling and closing")
        soak.finish()
        summary = soak.tally.summary(began)
    except Exception as exc:
        import traceback

        tally = soak.tally if soak is not None else Tally(args.seed)
        tally.error("soak", traceback.format_exc())
        summary = tally.summary(began, aborted=f"{type(exc).__name__}: {exc}")
    finally:
        if soak is not None:
            soak.close()
    timer.cancel()
    report(summary)
    BENCHMARK.record(args.record, argv, summary, figure)
    bad = summary["corrupted_bytes"] or summary["leaked_slots"] or summary["release_mismatches"]
    return 1 if bad or "aborted" in summary else 0


if __name__ == "__main__":
    sys.exit(main())
