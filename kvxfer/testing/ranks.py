"""The child side of `kvxfer.testing.rig`: a prefill or decode rank in its own process, driven
by commands over a pipe.

Commands come as `(seq, name, args, kwargs)` and run `do_<name>`; the reply goes back with the
same `seq`. What happens on its own (a fetch's result, a release, a delayed publish) goes back
as an event. Everything sent passes through one sender thread, so a parent that is not reading
never blocks the connector's threads.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import queue
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvxfer.reference import write_rank_cells
from kvxfer.spec import allocate_kv_caches
from kvxfer.testing.geometry import Geometry, Request
from kvxfer.testing.memory import (
    REPOISON,
    SOURCE_FILL,
    BlockIds,
    fill_blocks,
    global_kv,
    poison,
)

if TYPE_CHECKING:
    from kvxfer.connector import ReleaseReason

Emit = Callable[[str, Any], None]
"""How a rank reports an event to the parent: `emit(kind, payload)`."""


def _snapshot(obj: Any) -> dict[str, Any] | None:
    """`stats_snapshot()` if the connector has one (the redesign adds it)."""
    snap = getattr(obj, "stats_snapshot", None)
    return dict(snap()) if callable(snap) else None


def _result_dict(result: Any) -> dict[str, Any]:
    """A TransferResult's fields as a plain dict (it crosses the pipe)."""
    if dataclasses.is_dataclass(result) and not isinstance(result, type):
        return asdict(result)
    return dict(vars(result))


class _ProducerRank:
    """A prefill rank: a `KVProducer` whose cache holds the requests it is told to publish."""

    def __init__(self, init: dict[str, Any], emit: Emit) -> None:
        from kvxfer.connector import KVProducer

        self.emit = emit
        self.geometry = Geometry(**init["geometry"])
        self.spec = self.geometry.spec(init["rank"])
        self.caches = allocate_kv_caches(self.spec)
        poison(self.caches, SOURCE_FILL)
        self.lock = threading.Lock()
        self.releases: Counter[str] = Counter()
        self.published: list[str] = []
        self.producer = KVProducer(
            self.spec,
            self.caches,
            init["engine_id"],
            port=init.get("port", 0),
            release=self._on_release,
            **init["options"],
        )

    def ready(self) -> dict[str, Any]:
        """What the parent learns once the process is up."""
        return {"address": self.producer.address, "pid": os.getpid()}

    def _on_release(self, request_id: str, _reason: ReleaseReason) -> None:
        with self.lock:
            self.releases[request_id] += 1
        self.emit("release", request_id)

    def _publish(self, request: Request, ids: np.ndarray, deadline_s: float | None) -> None:
        try:
            self.producer.publish(request.request_id, ids, request.num_tokens, deadline_s)
        except Exception as exc:
            self.emit("publish_error", (request.request_id, f"{type(exc).__name__}: {exc}"))
            return
        with self.lock:
            self.published.append(request.request_id)
        self.emit("published", (request.request_id, time.monotonic()))

    def do_publish(
        self,
        request: Request,
        block_ids: BlockIds,
        delay: float = 0.0,
        deadline_s: float | None = None,
    ) -> float:
        """Write the request's KV into `block_ids` now; publish it after `delay` seconds."""
        ids = np.asarray(block_ids, dtype=np.int64)
        kv = global_kv(self.spec, request)
        write_rank_cells(self.spec, self.caches, ids, kv, 0, request.num_tokens)
        if delay <= 0:
            self._publish(request, ids, deadline_s)
        else:
            timer = threading.Timer(delay, self._publish, (request, ids, deadline_s))
            timer.daemon = True
            timer.start()
        return time.monotonic()

    def do_publish_computing(
        self, request: Request, block_ids: BlockIds, timeline: dict[str, float] | None = None
    ) -> float:
        """Publish the request before any of it is computed (`ready_tokens=0`; `timeline`:
        the engine's events), its blocks holding `SOURCE_FILL` until `compute` writes them: a
        byte read before its layer was marked ready shows as a mismatch. Returns when
        published."""
        ids = np.asarray(block_ids, dtype=np.int64)
        fill_blocks(self.spec, self.caches, ids.tolist(), SOURCE_FILL)
        self.producer.publish(
            request.request_id, ids, request.num_tokens, ready_tokens=0, timeline=timeline
        )
        with self.lock:
            self.published.append(request.request_id)
        return time.monotonic()

    def do_compute(
        self, request: Request, block_ids: BlockIds, tokens: int, layers: tuple[int, int]
    ) -> float:
        """What a prefill step does: write tokens `[0, tokens)` of this rank's local layers
        `[first, stop)` (the request's own KV), then mark them ready. Returns when marked."""
        ids = np.asarray(block_ids, dtype=np.int64)
        first, stop = layers
        kv = global_kv(self.spec, request)[first:]  # index i: global layer layer_start+first+i
        write_rank_cells(self.spec, self.caches[first:stop], ids, kv, 0, tokens)
        self.producer.mark_ready(request.request_id, tokens, layers=stop)
        return time.monotonic()

    def do_compute_paced(
        self, request: Request, block_ids: BlockIds, seconds_per_layer: float
    ) -> float:
        """A simulated prefill in the background: every `seconds_per_layer`, the next layer of
        every token is written and marked ready; each marking is a "layer_ready" event
        `(request_id, layer, time.monotonic())`. Returns when it started."""

        def prefill() -> None:
            began = time.monotonic()
            for layer in range(self.spec.num_layers):
                wake = began + (layer + 1) * seconds_per_layer
                time.sleep(max(0.0, wake - time.monotonic()))
                done = self.do_compute(request, block_ids, request.num_tokens, (layer, layer + 1))
                self.emit("layer_ready", (request.request_id, layer, done))

        threading.Thread(target=prefill, name="prefill", daemon=True).start()
        return time.monotonic()

    def do_publish_many(
        self, prefix: str, count: int, block_ids: BlockIds, num_tokens: int, seed: int
    ) -> None:
        """Publish `prefix0..prefix{count-1}`, all in the same blocks with the same KV."""
        ids = np.asarray(block_ids, dtype=np.int64)
        kv = global_kv(self.spec, Request("", num_tokens, seed))
        write_rank_cells(self.spec, self.caches, ids, kv, 0, num_tokens)
        for i in range(count):
            self.producer.publish(f"{prefix}{i}", ids, num_tokens)
        with self.lock:
            self.published.extend(f"{prefix}{i}" for i in range(count))

    def do_report(self) -> dict[str, Any]:
        """Releases and publishes seen, pending requests, staging pools, stats."""
        with self.lock:
            releases = dict(self.releases)
            published = list(self.published)
        return {
            "releases": releases,
            "published": published,
            "pending": list(self.producer.pending_requests),
            "free_slots": dict(self.producer.staging_free_slots()),
            "stats": _snapshot(self.producer),
        }

    def do_hold_gil(self, seconds: int) -> None:
        """Hold this process's GIL for `seconds` in one C call that keeps it, as vLLM's CPU
        workers' TP collectives do while they wait for the other ranks: no Python thread of
        this rank runs meanwhile (its side channel answers nothing), libzmq's threads do."""
        ctypes.PyDLL(None).sleep(int(seconds))

    def do_close(self) -> dict[str, Any]:
        """Close the producer; returns its releases and publishes (and how long close took)."""
        began = time.monotonic()
        self.producer.close()
        with self.lock:
            return {
                "releases": dict(self.releases),
                "published": list(self.published),
                "close_seconds": time.monotonic() - began,
            }

    def do_exit(self) -> None:
        """End the command loop (the process exits)."""
        return None


class _ConsumerRank:
    """A decode rank: `KVConsumer`s (one at a time) over caches shared with the parent."""

    def __init__(self, init: dict[str, Any], emit: Emit) -> None:
        self.emit = emit
        self.geometry = Geometry(**init["geometry"])
        self.spec = self.geometry.spec(init["rank"])
        self.caches: list[torch.Tensor] = init["caches"]
        self.engine_id = init["engine_id"]
        self.consumer: Any = None
        self.open_options: dict[str, Any] = {}
        if init.get("options") is not None:
            self.do_open(init["options"])

    def ready(self) -> dict[str, Any]:
        """What the parent learns once the process is up."""
        return {"pid": os.getpid()}

    def do_open(self, options: dict[str, Any], engine_id: str | None = None) -> None:
        """A new KVConsumer on the same caches (the previous one is closed)."""
        from kvxfer.connector import KVConsumer

        if self.consumer is not None:
            self.consumer.close()
            self.consumer = None
        self.consumer = KVConsumer(self.spec, self.caches, engine_id or self.engine_id, **options)
        self.open_options = dict(options)

    def do_connect(self, addresses: list[str], timeout: float = 10.0) -> list[str]:
        """`connect()`; returns the strategies of this rank's pairs."""
        plans = self.consumer.connect(addresses, timeout=timeout)
        return [p.strategy for p in plans]

    def do_fetch(
        self,
        request: Request,
        block_ids: BlockIds,
        timeout: float | None = None,
        wait_timeout: float | None = None,
        repoison: bool = True,
        streamed: bool = False,
    ) -> float:
        """Start a fetch (`timeout`: the fetch's own; `streamed`: asked for while the prefill
        computes) and `wait(wait_timeout)` for it; the result comes back as a "result" event.
        When it fails, the failed blocks are re-poisoned (`REPOISON`) right after `wait()`
        returns."""
        ids = np.asarray(block_ids, dtype=np.int64)
        began = time.monotonic()
        handle = self.consumer.fetch(
            request.request_id,
            ids,
            request.num_tokens,
            request.start_token,
            timeout=timeout,
            streamed=streamed,
        )

        def waiter() -> None:
            try:
                result = handle.wait(wait_timeout)
            except Exception as exc:  # a bug in wait: report it as the result
                self.emit("result", {"request_id": request.request_id, "crash": repr(exc)})
                return
            finished = time.monotonic()
            if repoison:
                fill_blocks(self.spec, self.caches, result.failed_block_ids, REPOISON)
            out = _result_dict(result)
            out.update(request_id=request.request_id, started=began, finished=finished)
            self.emit("result", out)

        threading.Thread(target=waiter, name=f"wait-{request.request_id}", daemon=True).start()
        return began

    def do_fetch_many(
        self, prefix: str, count: int, block_ids: BlockIds, num_tokens: int, seed: int, window: int
    ) -> dict[str, Any]:
        """Fetch `prefix0..` (as published by `publish_many`), `window` fetches at a time.
        Returns {"ok": n, "failed": n, "errors": [the first few failures' errors]}."""
        ids = np.asarray(block_ids, dtype=np.int64)
        outcome: dict[str, Any] = {"ok": 0, "failed": 0, "errors": []}
        handles: list[Any] = []
        for i in range(count):
            # Generous: a window's last fetches wait for the 49 before them through 4 staging
            # slots, and a loaded machine (the parallel suite) made them pass 10 s.
            handles.append(self.consumer.fetch(f"{prefix}{i}", ids, num_tokens, timeout=30.0))
            if len(handles) >= window or i == count - 1:
                for h in handles:
                    r = h.wait()
                    outcome["ok" if r.ok else "failed"] += 1
                    if not r.ok and len(outcome["errors"]) < 5:
                        outcome["errors"].append(r.errors)
                handles = []
        return outcome

    def do_abort(self, request_id: str) -> None:
        """`abort()`: the engine will never load the request."""
        self.consumer.abort(request_id)

    def do_report(self) -> dict[str, Any]:
        """Staging pools and stats."""
        return {
            "free_slots": dict(self.consumer.staging_free_slots()),
            "stats": _snapshot(self.consumer),
        }

    def do_close(self) -> float:
        """Close the consumer; returns how long `close()` took."""
        began = time.monotonic()
        self.consumer.close()
        return time.monotonic() - began

    def do_fill(self, blocks: BlockIds, byte: int) -> None:
        """Overwrite whole blocks with one byte value."""
        fill_blocks(self.spec, self.caches, blocks, byte)

    def do_exit(self) -> None:
        """End the command loop (the process exits)."""
        return None


_ROLES: dict[str, type[_ProducerRank] | type[_ConsumerRank]] = {
    "producer": _ProducerRank,
    "consumer": _ConsumerRank,
}


def child_main(role: str, init: dict[str, Any], conn: Any) -> None:
    """A child process's loop: commands in, replies and events out (through one sender thread, so a
    parent that is not reading never blocks the connector's threads)."""
    os.environ["MC_LOG_LEVEL"] = "ERROR"
    outbox: queue.Queue = queue.Queue()

    def sender() -> None:
        while (item := outbox.get()) is not None:
            try:
                conn.send(item)
            except (BrokenPipeError, OSError):
                return

    thread = threading.Thread(target=sender, name="rank-sender", daemon=True)
    thread.start()

    def emit(kind: str, payload: Any) -> None:
        outbox.put(("event", kind, payload))

    try:
        rank = _ROLES[role](init, emit)
    except BaseException:
        outbox.put(("event", "fatal", traceback.format_exc()))
        outbox.put(None)
        thread.join(5)
        os._exit(1)
    emit("ready", rank.ready())
    while True:
        try:
            seq, name, args, kwargs = conn.recv()
        except (EOFError, OSError):
            break
        try:
            value = getattr(rank, f"do_{name}")(*args, **kwargs)
            outbox.put(("reply", seq, value))
        except BaseException:
            outbox.put(("error", seq, traceback.format_exc()))
        if name == "exit":
            break
    outbox.put(None)
    thread.join(5)
    os._exit(0)  # no interpreter teardown: connectors' threads may still be in native code
