"""Fault harness: prefill and decode ranks in their own processes, driven over command pipes.

Every rank runs in a spawned process (real Mooncake TCP on 127.0.0.1, real side channel), so
the parent can SIGSTOP, SIGCONT or SIGKILL any of them at a chosen point. Commands go down a
pipe and get a reply; what happens on its own (a fetch's result, a release, a delayed publish)
comes back as an event.

Consumer caches live in torch shared memory allocated by the parent: the parent reads every
byte of them while the consumer runs, while it is stopped and after it died. They start
poisoned (`POISON`); the parent keeps a `CacheModel` of what each byte must hold, built from
`kvxfer.reference` (never from the code under test). When a fetch fails, the consumer process
re-poisons the failed blocks with `REPOISON` the moment `wait()` returns, as an engine that
recomputes them into the same blocks would; a late byte then shows as a block that no longer
holds `REPOISON`.

Used by tests/faults and by benchmarks/soak.py (one copy, imported by path there).
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import os
import queue
import random
import signal
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import msgspec
import numpy as np
import torch
import zmq

from kvxfer import KVCacheSpec, allocate_kv_caches
from kvxfer.layout import BLOCK, layer_axes
from kvxfer.plan import DEFAULT_STAGING_SLOTS
from kvxfer.reference import random_global_kv, write_rank_cells

POISON = 0xA5  # consumer caches before anything lands
REPOISON = 0x5A  # what an engine recomputing a failed block writes there (not the poison)
SOURCE_FILL = 0x3C  # producer caches outside published cells: a wrong read shows

# Mooncake is chatty at INFO; spawned children inherit the parent's environment.
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

T = TypeVar("T")

# Staging that cuts a request into many small chunks (a few MiB take most of a second), so a
# fault can be injected mid-transfer; and staging roomy enough for every strategy (unpack
# mirrors whole source blocks).
SLOW_STAGING = {"staging_bytes": 16 << 10, "staging_slots": 2}
ROOMY_STAGING = {"staging_bytes": 128 << 10, "staging_slots": 4}
STRATEGIES = ("direct", "pack", "unpack", "pack+unpack")


# ---- geometry and requests ----------------------------------------------------------------


@dataclass(frozen=True)
class Geometry:
    """One engine's cache geometry (every rank's spec follows from it)."""

    tp: int = 1
    heads: int = 4
    block_size: int = 16
    layout: str = "NHD"
    placement: str = "kv_first"
    mla: bool = False
    layers: int = 2
    head_dim: int = 32
    dtype: str = "bfloat16"
    num_blocks: int = 64

    def spec(self, rank: int) -> KVCacheSpec:
        """The spec of TP rank `rank`."""
        return KVCacheSpec(
            num_layers=self.layers,
            num_kv_heads=1 if self.mla else self.heads,
            head_dim=self.head_dim,
            dtype=self.dtype,  # type: ignore[arg-type]
            tp_size=self.tp,
            tp_rank=rank,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            layout=self.layout,  # type: ignore[arg-type]
            kv_placement=self.placement,  # type: ignore[arg-type]
            mla=self.mla,
        )

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)


# A prefill engine and a decode engine of the same model with different block sizes and
# layouts: 1 KiB of KV per token (2 layers, 4 heads of 32, bf16), 16 MiB caches per rank.
PREFILL = Geometry(block_size=16, num_blocks=1024)
DECODE = Geometry(block_size=32, layout="HND", num_blocks=512)


@dataclass(frozen=True)
class Request:
    """A request: its id, length and the seed of its (global) KV."""

    request_id: str
    num_tokens: int
    seed: int = 0
    start_token: int = 0


def global_kv(spec: KVCacheSpec, request: Request) -> torch.Tensor:
    """The request's KV for all heads, the same in every process (a function of the seed)."""
    return random_global_kv(spec, request.num_tokens, seed=request.seed)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a contiguous tensor (a view)."""
    return t.view(torch.uint8)


def by_block(spec: KVCacheSpec, layer: torch.Tensor) -> torch.Tensor:
    """A layer tensor (or its bytes) with the block axis first: `by_block(...)[b]` is block b."""
    return layer.movedim(layer_axes(spec.layout, spec.kv_placement, spec.mla).index(BLOCK), 0)


def fill_blocks(spec: KVCacheSpec, caches: Sequence[torch.Tensor], blocks, byte: int) -> None:
    """Overwrite whole blocks of every layer with one byte value."""
    ids = torch.as_tensor(np.asarray(list(blocks), dtype=np.int64))
    if ids.numel() == 0:
        return
    for t in caches:
        by_block(spec, bits(t))[ids] = byte


def block_diff(spec: KVCacheSpec, got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Differing bytes per block of one layer (int64, `num_blocks` long)."""
    diff = by_block(spec, bits(got) != bits(want))
    return diff.reshape(spec.num_blocks, -1).sum(1)


class CacheModel:
    """What one consumer rank's cache must hold, byte for byte (starts all `POISON`)."""

    def __init__(self, spec: KVCacheSpec, caches: Sequence[torch.Tensor]) -> None:
        self.spec = spec
        self.caches = list(caches)
        self.model = [torch.empty_like(t) for t in caches]
        for t in self.model:
            bits(t).fill_(POISON)

    def land(self, block_ids, request: Request) -> None:
        """The request's tokens `[start_token, num_tokens)` are in `block_ids`."""
        kv = global_kv(self.spec, request)
        write_rank_cells(
            self.spec, self.model, block_ids, kv, request.start_token, request.num_tokens
        )

    def fill(self, blocks, byte: int) -> None:
        """Whole blocks hold `byte` (poisoned or re-poisoned)."""
        fill_blocks(self.spec, self.model, blocks, byte)

    def settle(self, block_ids, request: Request, failed: Sequence[int]) -> None:
        """A fetch's result: every block exact except the failed ones, which the consumer
        re-poisoned with `REPOISON` when the result came."""
        self.land(block_ids, request)
        self.fill(failed, REPOISON)

    def adopt(self, blocks) -> None:
        """Take the cache's current bytes of `blocks` as the model's (after reporting them)."""
        ids = torch.as_tensor(np.asarray([int(b) for b in blocks], dtype=np.int64))
        for got, want in zip(self.caches, self.model, strict=True):
            by_block(self.spec, want)[ids] = by_block(self.spec, got)[ids]

    def mismatches(self, blocks=None) -> dict[int, int]:
        """Blocks (of `blocks`, default all) whose bytes differ from the model: block -> bytes."""
        if blocks is None:
            total = torch.zeros(self.spec.num_blocks, dtype=torch.int64)
            for got, want in zip(self.caches, self.model, strict=True):
                total += block_diff(self.spec, got, want)
            return {b: int(n) for b, n in enumerate(total.tolist()) if n}
        found: dict[int, int] = {}
        for block in [int(b) for b in blocks]:
            n = 0
            for got, want in zip(self.caches, self.model, strict=True):
                a, b = by_block(self.spec, got)[block], by_block(self.spec, want)[block]
                n += int((bits(a.contiguous()) != bits(b.contiguous())).sum())
            if n:
                found[block] = n
        return found

    def changed(self, blocks) -> int:
        """Bytes of `blocks` that no longer hold the model's content (progress of a fetch)."""
        return sum(self.mismatches(blocks).values())


class BlockPool:
    """Free block ids of one rank, handed out scattered and reused oldest first."""

    def __init__(self, num_blocks: int, seed: int = 0) -> None:
        order = np.random.default_rng(seed).permutation(num_blocks)
        self._free = [int(b) for b in order]

    def take(self, n: int) -> np.ndarray:
        """`n` free blocks (raises if there are not enough)."""
        if n > len(self._free):
            raise ValueError(f"{n} blocks asked, {len(self._free)} free")
        ids, self._free = self._free[:n], self._free[n:]
        return np.asarray(ids, dtype=np.int64)

    def give(self, ids) -> None:
        """Blocks free again (reused after every block freed before them)."""
        self._free.extend(int(b) for b in ids)

    @property
    def free(self) -> int:
        """Blocks free now."""
        return len(self._free)


# ---- child processes ----------------------------------------------------------------------


def _snapshot(obj: Any) -> dict | None:
    """`stats_snapshot()` if the connector has one (the redesign adds it)."""
    snap = getattr(obj, "stats_snapshot", None)
    return dict(snap()) if callable(snap) else None


def _result_dict(result: Any) -> dict:
    """A TransferResult's fields as a plain dict (it crosses the pipe)."""
    if dataclasses.is_dataclass(result) and not isinstance(result, type):
        return asdict(result)
    return dict(vars(result))


class _ProducerRank:
    """A prefill rank: a `KVProducer` whose cache holds the requests it is told to publish."""

    def __init__(self, init: dict, emit: Callable[[str, Any], None]) -> None:
        from kvxfer.connector import KVProducer

        self.emit = emit
        self.geometry = Geometry(**init["geometry"])
        self.spec = self.geometry.spec(init["rank"])
        self.caches = allocate_kv_caches(self.spec)
        for t in self.caches:
            bits(t).fill_(SOURCE_FILL)
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

    def ready(self) -> dict:
        """What the parent learns once the process is up."""
        return {"address": self.producer.address, "pid": os.getpid()}

    def _on_release(self, request_id: str) -> None:
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
        self, request: Request, block_ids, delay: float = 0.0, deadline_s: float | None = None
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

    def do_publish_many(
        self, prefix: str, count: int, block_ids, num_tokens: int, seed: int
    ) -> None:
        """Publish `prefix0..prefix{count-1}`, all in the same blocks with the same KV."""
        ids = np.asarray(block_ids, dtype=np.int64)
        kv = global_kv(self.spec, Request("", num_tokens, seed))
        write_rank_cells(self.spec, self.caches, ids, kv, 0, num_tokens)
        for i in range(count):
            self.producer.publish(f"{prefix}{i}", ids, num_tokens)
        with self.lock:
            self.published.extend(f"{prefix}{i}" for i in range(count))

    def do_report(self) -> dict:
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

    def do_close(self) -> dict:
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

    def __init__(self, init: dict, emit: Callable[[str, Any], None]) -> None:
        self.emit = emit
        self.geometry = Geometry(**init["geometry"])
        self.spec = self.geometry.spec(init["rank"])
        self.caches: list[torch.Tensor] = init["caches"]
        self.engine_id = init["engine_id"]
        self.consumer: Any = None
        self.open_options: dict = {}
        if init.get("options") is not None:
            self.do_open(init["options"])

    def ready(self) -> dict:
        """What the parent learns once the process is up."""
        return {"pid": os.getpid()}

    def do_open(self, options: dict, engine_id: str | None = None) -> None:
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
        block_ids,
        timeout: float | None = None,
        wait_timeout: float | None = None,
        repoison: bool = True,
    ) -> float:
        """Start a fetch (`timeout`: the fetch's own) and `wait(wait_timeout)` for it; the
        result comes back as a "result" event. When it fails, the failed blocks are re-poisoned
        (`REPOISON`) right after `wait()` returns."""
        ids = np.asarray(block_ids, dtype=np.int64)
        began = time.monotonic()
        handle = self.consumer.fetch(
            request.request_id, ids, request.num_tokens, request.start_token, timeout=timeout
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
        self, prefix: str, count: int, block_ids, num_tokens: int, seed: int, window: int
    ) -> dict:
        """Fetch `prefix0..` (as published by `publish_many`), `window` fetches at a time.
        Returns {"ok": n, "failed": n, "errors": [the first few failures' errors]}."""
        ids = np.asarray(block_ids, dtype=np.int64)
        outcome: dict[str, Any] = {"ok": 0, "failed": 0, "errors": []}
        handles: list[Any] = []
        for i in range(count):
            handles.append(self.consumer.fetch(f"{prefix}{i}", ids, num_tokens, timeout=10.0))
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

    def do_report(self) -> dict:
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

    def do_fill(self, blocks, byte: int) -> None:
        """Overwrite whole blocks with one byte value."""
        fill_blocks(self.spec, self.caches, blocks, byte)

    def do_exit(self) -> None:
        """End the command loop (the process exits)."""
        return None


_ROLES: dict[str, type[_ProducerRank] | type[_ConsumerRank]] = {
    "producer": _ProducerRank,
    "consumer": _ConsumerRank,
}


def _child_main(role: str, init: dict, conn: Any) -> None:
    """A child's loop: commands in, replies and events out (through one sender thread, so a
    parent that is not reading never blocks the connector's threads)."""
    os.environ["MC_LOG_LEVEL"] = "ERROR"
    outbox: queue.Queue = queue.Queue()

    def sender() -> None:
        while (item := outbox.get()) is not None:
            try:
                conn.send(item)
            except (BrokenPipeError, OSError):
                return

    thread = threading.Thread(target=sender, name="faultkit-sender", daemon=True)
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


# ---- the parent's side --------------------------------------------------------------------


class ChildError(AssertionError):
    """A command failed in a child process (the child's traceback is the message)."""


class Proc:
    """A child process and its pipe. Replies are matched by sequence number; events queue."""

    def __init__(self, ctx: Any, role: str, name: str, init: dict) -> None:
        self.name = name
        self.role = role
        parent, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_child_main, args=(role, init, child), name=name, daemon=True
        )
        self.process.start()
        child.close()
        self.conn = parent
        self._seq = 0
        self._replies: dict[int, tuple[str, Any]] = {}
        self.events: list[tuple[str, Any]] = []
        self.info: dict | None = None
        self.stopped = False
        self.gone = False

    @property
    def pid(self) -> int:
        """The process id."""
        assert self.process.pid is not None
        return self.process.pid

    # receiving

    def pump(self, timeout: float = 0.0) -> bool:
        """Receive what the child sent (waiting up to `timeout` for the first message)."""
        got = False
        wait = timeout
        while not self.gone:
            try:
                if not self.conn.poll(wait):
                    return got
                message = self.conn.recv()
            except (EOFError, OSError):
                self.gone = True
                return got
            got, wait = True, 0.0
            if message[0] == "event":
                _, kind, payload = message
                if kind == "ready":
                    self.info = payload
                elif kind == "fatal":
                    self.gone = True
                    raise ChildError(f"{self.name} failed to start:\n{payload}")
                else:
                    self.events.append((kind, payload))
            else:
                self._replies[message[1]] = (message[0], message[2])
        return got

    def wait_ready(self, timeout: float = 60.0) -> dict:
        """The child's ready info (its address, pid); waits for it."""
        deadline = time.monotonic() + timeout
        while self.info is None:
            left = deadline - time.monotonic()
            if self.gone or left <= 0:
                raise ChildError(f"{self.name} did not start within {timeout} s")
            self.pump(min(left, 0.5))
        return self.info

    def take_events(self, kind: str) -> list[Any]:
        """Remove and return the queued events of one kind."""
        self.pump()
        taken = [p for k, p in self.events if k == kind]
        self.events = [(k, p) for k, p in self.events if k != kind]
        return taken

    def wait_event(
        self, kind: str, match: Callable[[Any], bool] = lambda _: True, timeout: float = 30.0
    ) -> Any:
        """The first queued event of `kind` that `match`es (removed from the queue).

        Raises:
            TimeoutError: none came within `timeout` seconds.
        """
        deadline = time.monotonic() + timeout
        while True:
            for i, (k, payload) in enumerate(self.events):
                if k == kind and match(payload):
                    del self.events[i]
                    return payload
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.name}: no {kind} event within {timeout} s")
            if self.gone:
                raise ChildError(f"{self.name} exited before a {kind} event")
            self.pump(min(left, 0.05))

    # commands

    def send(self, name: str, *args: Any, **kwargs: Any) -> int:
        """Send a command; returns its sequence number (see `reply`)."""
        self.wait_ready()
        self._seq += 1
        self.conn.send((self._seq, name, args, kwargs))
        return self._seq

    def reply(self, seq: int, timeout: float = 30.0) -> Any:
        """The reply to command `seq`.

        Raises:
            ChildError: the command raised in the child (its traceback is the message).
            TimeoutError: no reply within `timeout` seconds.
        """
        deadline = time.monotonic() + timeout
        while seq not in self._replies:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.name}: no reply within {timeout} s")
            if self.gone:
                raise ChildError(f"{self.name} exited before replying")
            self.pump(min(left, 0.05))
        kind, value = self._replies.pop(seq)
        if kind == "error":
            raise ChildError(f"{self.name}:\n{value}")
        return value

    def call(self, name: str, *args: Any, timeout: float = 30.0, **kwargs: Any) -> Any:
        """Run a command in the child and return its value."""
        return self.reply(self.send(name, *args, **kwargs), timeout)

    # signals

    def freeze(self) -> None:
        """SIGSTOP the process."""
        os.kill(self.pid, signal.SIGSTOP)
        self.stopped = True

    def thaw(self) -> None:
        """SIGCONT the process."""
        os.kill(self.pid, signal.SIGCONT)
        self.stopped = False

    def kill(self) -> None:
        """SIGKILL the process, reap it, and keep what it had sent before it died."""
        if self.process.is_alive():
            os.kill(self.pid, signal.SIGKILL)
        self.process.join(10)
        self.stopped = False
        with contextlib.suppress(ChildError):
            while self.pump(0.05):
                pass
        self.gone = True

    def alive(self) -> bool:
        """Whether the process still runs."""
        return self.process.is_alive()

    def shutdown(self, timeout: float = 10.0) -> None:
        """End the process: politely if it answers, SIGKILL otherwise."""
        if self.stopped:
            self.thaw()
        if self.process.is_alive() and not self.gone:
            with contextlib.suppress(ChildError, TimeoutError, OSError):
                self.call("exit", timeout=timeout)
            self.process.join(timeout)
        if self.process.is_alive():
            self.kill()
        self.conn.close()


class Producer(Proc):
    """A prefill rank process (`KVProducer`). Releases are counted from its events."""

    def __init__(self, ctx: Any, geometry: Geometry, rank: int, engine_id: str, **kw: Any):
        self.geometry = geometry
        self.rank = rank
        self.engine_id = engine_id
        self.options = dict(kw.pop("options", {}))
        self.releases: Counter[str] = Counter()
        init = {
            "geometry": asdict(geometry),
            "rank": rank,
            "engine_id": engine_id,
            "port": kw.pop("port", 0),
            "options": self.options,
        }
        super().__init__(ctx, "producer", kw.pop("name", f"producer-{engine_id}-{rank}"), init)

    @property
    def address(self) -> str:
        """The side-channel address (waits for the process to start)."""
        return self.wait_ready()["address"]

    @property
    def port(self) -> int:
        """The side-channel port."""
        return int(self.address.rsplit(":", 1)[1])

    def publish(
        self, request: Request, block_ids, delay: float = 0.0, deadline_s: float | None = None
    ) -> float:
        """Publish now (returns when published) or after `delay` seconds (returns at once)."""
        return self.call("publish", request, np.asarray(block_ids).tolist(), delay, deadline_s)

    def count_releases(self) -> Counter[str]:
        """Release callbacks seen so far, per request id."""
        for rid in self.take_events("release"):
            self.releases[rid] += 1
        return self.releases

    def report(self) -> dict:
        """Releases, publishes, pending requests, staging pools and stats of the producer."""
        return self.call("report")


class Consumer(Proc):
    """A decode rank process (`KVConsumer`) over caches the parent shares and models."""

    def __init__(
        self,
        ctx: Any,
        geometry: Geometry,
        rank: int,
        engine_id: str,
        options: dict | None = None,
        name: str | None = None,
    ):
        self.geometry = geometry
        self.rank = rank
        self.engine_id = engine_id
        self.spec = geometry.spec(rank)
        self.caches = allocate_kv_caches(self.spec)
        for t in self.caches:
            t.share_memory_()
            bits(t).fill_(POISON)
        self.model = CacheModel(self.spec, self.caches)
        self.results: dict[str, dict] = {}
        self.options: dict | None = None if options is None else dict(options)
        self.closed = False
        init = {
            "geometry": asdict(geometry),
            "rank": rank,
            "engine_id": engine_id,
            "caches": self.caches,
            "options": options,
        }
        super().__init__(ctx, "consumer", name or f"consumer-{engine_id}-{rank}", init)

    def open(self, engine_id: str | None = None, **options: Any) -> None:
        """A fresh KVConsumer in the process (closing the previous one)."""
        self.call("open", options, engine_id)
        self.options, self.closed = dict(options), False

    def close_consumer(self, timeout: float = 30.0) -> float:
        """`KVConsumer.close()` in the process; returns how long it took there."""
        seconds = self.call("close", timeout=timeout)
        self.closed = True
        return seconds

    def reset(self) -> None:
        """Poison the whole cache again and forget the model (no fetch may be running)."""
        for t in self.caches:
            bits(t).fill_(POISON)
        self.model = CacheModel(self.spec, self.caches)
        self.results.clear()

    def connect(self, addresses: Sequence[str], timeout: float = 10.0) -> list[str]:
        """Handshake; returns the strategies of this rank's pairs."""
        return self.call("connect", list(addresses), timeout, timeout=timeout + 30)

    def fetch(
        self,
        request: Request,
        block_ids,
        timeout: float | None = None,
        wait_timeout: float | None = None,
    ) -> float:
        """Start a fetch (`timeout`: the fetch's own; `wait_timeout`: the `wait()` call's);
        returns its start time (`time.monotonic()`, comparable across processes)."""
        ids = np.asarray(block_ids).tolist()
        return self.call("fetch", request, ids, timeout, wait_timeout)

    def result(self, request_id: str, timeout: float = 30.0) -> dict:
        """The fetch's result event (the TransferResult's fields, `started`, `finished`)."""
        if request_id not in self.results:
            got = self.wait_event("result", lambda r: r["request_id"] == request_id, timeout)
            self.results[request_id] = got
        result = self.results[request_id]
        if "crash" in result:
            raise ChildError(f"{self.name}: wait() raised {result['crash']}")
        return result

    def report(self) -> dict:
        """Staging pools and stats of the consumer."""
        return self.call("report")


class Rig:
    """The processes of one test or soak run; `close` ends every one of them."""

    def __init__(self) -> None:
        self.ctx = mp.get_context("spawn")
        self.procs: list[Proc] = []

    def producer(
        self, geometry: Geometry, rank: int = 0, *, engine_id: str = "prefill", **kw: Any
    ) -> Producer:
        """Start a prefill rank process (returns at once; its `address` waits for it)."""
        p = Producer(self.ctx, geometry, rank, engine_id, **kw)
        self.procs.append(p)
        return p

    def consumer(
        self,
        geometry: Geometry,
        rank: int = 0,
        *,
        engine_id: str = "decode",
        options: dict | None = None,
        name: str | None = None,
    ) -> Consumer:
        """Start a decode rank process; with `options`, it opens a KVConsumer at once."""
        c = Consumer(self.ctx, geometry, rank, engine_id, options, name)
        self.procs.append(c)
        return c

    def ready(self, timeout: float = 60.0) -> None:
        """Wait until every process started."""
        for p in self.procs:
            if not p.gone:
                p.wait_ready(timeout)

    def close(self) -> None:
        """End every process (SIGKILL for those that do not answer)."""
        for p in self.procs:
            try:
                p.shutdown()
            except Exception:
                p.kill()
        self.procs.clear()

    def __enter__(self) -> Rig:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- checks -------------------------------------------------------------------------------


def poll(probe: Callable[[], T], done: Callable[[T], bool], timeout: float, every=0.05) -> T:
    """Call `probe` until `done(value)` or `timeout` seconds passed; returns the last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if done(value) or time.monotonic() >= deadline:
            return value
        time.sleep(every)


def wait_for_progress(consumer: Consumer, block_ids, timeout: float = 20.0) -> None:
    """Wait until bytes of `block_ids` changed in the consumer's cache (a fetch is moving
    bytes). Watches the request's first blocks every 2 ms (chunks go in token order) and all
    of them every 0.1 s. Raises TimeoutError if nothing landed within `timeout` seconds."""
    ids = [int(b) for b in block_ids]
    deadline = time.monotonic() + timeout
    rounds = 0
    while time.monotonic() < deadline:
        if consumer.model.changed(ids if rounds % 50 == 49 else ids[:8]):
            return
        rounds += 1
        time.sleep(0.002)
    raise TimeoutError(f"{consumer.name}: no byte of the request landed within {timeout} s")


def pools_whole(report: dict, slots: int) -> bool:
    """Whether every staging pool in a report is back to `slots` free slots."""
    return all(free == slots for free in report["free_slots"].values())


def leaks(
    producers: Sequence[Producer], consumers: Sequence[Consumer], timeout: float = 10.0
) -> list[str]:
    """What leaked, once given `timeout` seconds to settle (quarantines end, releases come):
    staging slots not free, requests still pending, release callbacks not called exactly once
    per published request. Dead or closed processes are skipped. Empty when nothing leaked."""

    def problems() -> list[str]:
        found = []
        for p in producers:
            if p.gone or not p.alive():
                continue
            report = p.report()
            slots = p.options.get("staging_slots", DEFAULT_STAGING_SLOTS)
            if not pools_whole(report, slots):
                found.append(f"{p.name}: staging free slots {report['free_slots']} of {slots}")
            if report["pending"]:
                found.append(f"{p.name}: still pending {report['pending'][:5]}")
            published = Counter(report["published"])
            released = Counter(report["releases"])
            wrong = {
                rid: released.get(rid, 0)
                for rid in set(published) | set(released)
                if released.get(rid, 0) != published.get(rid, 0)
            }
            if wrong:
                sample = dict(sorted(wrong.items())[:5])
                found.append(f"{p.name}: release calls per request (want 1 each): {sample}")
        for c in consumers:
            if c.gone or c.closed or c.options is None or not c.alive():
                continue
            report = c.report()
            slots = c.options.get("staging_slots", DEFAULT_STAGING_SLOTS)
            if not pools_whole(report, slots):
                found.append(f"{c.name}: staging free slots {report['free_slots']} of {slots}")
        return found

    return poll(problems, lambda found: not found, timeout, every=0.2)


def watch_for_late_bytes(consumers: Sequence[Consumer], seconds: float) -> dict[str, dict]:
    """Compare every consumer's cache with its model for `seconds` (returns at the first
    difference): {consumer name: {block: differing bytes}} of those that differ."""
    deadline = time.monotonic() + seconds
    while True:
        found = {c.name: m for c in consumers if (m := c.model.mismatches())}
        if found or time.monotonic() >= deadline:
            return found
        time.sleep(0.05)


def describe(mismatches: dict[int, int], groups: dict[str, Sequence[int]]) -> str:
    """Differing bytes per named group of blocks (e.g. a request's failed blocks)."""
    parts = []
    rest = dict(mismatches)
    for name, blocks in groups.items():
        hit = {b: rest.pop(b) for b in [int(x) for x in blocks] if b in rest}
        if hit:
            parts.append(f"{sum(hit.values())} bytes in {len(hit)} {name} blocks")
    if rest:
        parts.append(f"{sum(rest.values())} bytes in {len(rest)} other blocks")
    return "; ".join(parts) or "none"


def send_raw(address: str, frames: list[bytes], wait: float = 0.3) -> list[Any]:
    """Send raw frames to a side channel from a fresh DEALER; return what came back (decoded
    msgpack, or the raw bytes) until the first answer or `wait` seconds."""
    sock: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send_multipart(frames)
        if not sock.poll(int(wait * 1000)):
            return []
        replies: list[Any] = []
        while sock.poll(0):
            frame = sock.recv()
            try:
                replies.append(msgspec.msgpack.decode(frame))
            except msgspec.DecodeError:
                replies.append(frame)
        return replies
    finally:
        sock.close()


def garbage_frames(rng: random.Random, oversized: bool = False) -> list[tuple[str, list[bytes]]]:
    """Hostile side-channel messages, named: malformed, unknown, forged sessions, a handshake
    with impossible fields; with `oversized`, frames over the protocol's and ZeroMQ's limits."""
    pack = msgspec.msgpack.encode
    forged_transfer = {
        "type": "transfer",
        "version": 1,
        "session": "forged",
        "request_id": "victim",
        "chunk_id": 0,
        "dst_block_ids": [0, 1],
        "num_tokens": 16,
        "token_start": 0,
        "token_end": 16,
        "strategy": "direct",
        "staging_offset": -1,
        "wait_seconds": 1.0,
    }
    forged_hello = {
        "type": "handshake",
        "version": 1,
        "engine_id": "evil",
        "rank": 99,
        "spec": {"num_layers": -1},
        "endpoint": "256.1.1.1:99999",
        "cache_regions": [{"region_id": 0, "address": 4096, "nbytes": 1 << 40}],
        "staging_region": None,
        "staging_slot_bytes": 0,
    }
    frames = [
        ("not msgpack", [b"\x00\xffnot msgpack"]),
        ("empty frame", [b""]),
        ("two frames", [b"a", b"b"]),
        ("random bytes", [rng.randbytes(rng.randint(1, 2000))]),
        ("unknown version", [pack({"type": "error", "version": 9, "reason": "x"})]),
        ("unknown type", [pack({"type": "teleport", "version": 1})]),
        ("a list", [pack([1, 2, 3])]),
        ("forged session", [pack(forged_transfer)]),
        ("forged done", [pack({"type": "request_done", "version": 1, "session": "forged"})]),
        ("bad handshake", [pack(forged_hello)]),
    ]
    if oversized:
        frames.append(("over the frame limit", [b"x" * ((8 << 20) + 1)]))
        frames.append(("over the socket limit", [b"y" * (65 << 20)]))
    return frames
