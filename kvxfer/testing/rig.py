"""Fault harness: prefill and decode ranks in their own processes, driven over command pipes.

Every rank runs in a spawned process (real Mooncake TCP on 127.0.0.1, real side channel), so
the parent can SIGSTOP, SIGCONT or SIGKILL any of them at a chosen point. Commands go down a
pipe and get a reply; what happens on its own (a fetch's result, a release, a delayed publish)
comes back as an event (the child's side: `kvxfer.testing.ranks`).

Consumer caches live in torch shared memory allocated by the parent: the parent reads every
byte of them while the consumer runs, while it is stopped and after it died. They start
poisoned (`POISON`); the parent keeps a `CacheModel` of what each byte must hold, built from
`kvxfer.reference` (never from the code under test). When a fetch fails, the consumer process
re-poisons the failed blocks with `REPOISON` the moment `wait()` returns, as an engine that
recomputes them into the same blocks would; a late byte then shows as a block that no longer
holds `REPOISON`.

Used by tests/faults and by benchmarks/soak.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any, TypeVar

import numpy as np

from kvxfer.spec import allocate_kv_caches
from kvxfer.testing.geometry import Geometry, Request
from kvxfer.testing.memory import POISON, BlockIds, BlockPool, CacheModel, poison
from kvxfer.testing.processes import START_TIMEOUT_S, context
from kvxfer.testing.ranks import child_main
from kvxfer.testing.signals import freeze

# Mooncake is chatty at INFO; spawned children inherit the parent's environment.
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

T = TypeVar("T")

# A prefill engine and a decode engine of the same model with different block sizes and
# layouts: 1 KiB of KV per token (2 layers, 4 heads of 32, bf16), 16 MiB caches per rank.
PREFILL = Geometry(head_dim=32, block_size=16, num_blocks=1024)
DECODE = Geometry(head_dim=32, block_size=32, layout="HND", num_blocks=512)
# Staging that cuts a request into many small chunks (a few MiB take most of a second), so a
# fault can be injected mid-transfer; and staging roomy enough for every strategy (unpack
# mirrors whole source blocks).
SLOW_STAGING = {"staging_bytes": 16 << 10, "staging_slots": 2}
ROOMY_STAGING = {"staging_bytes": 128 << 10, "staging_slots": 4}


class ChildError(AssertionError):
    """A command failed in a child process (the child's traceback is the message)."""


class Proc:
    """A child process and its pipe. Replies are matched by sequence number; events queue."""

    def __init__(self, ctx: Any, role: str, name: str, init: dict[str, Any]) -> None:
        self.name = name
        self.role = role
        parent, child = ctx.Pipe()
        self.process = ctx.Process(
            target=child_main, args=(role, init, child), name=name, daemon=True
        )
        self.process.start()
        child.close()
        self.conn = parent
        self._seq = 0
        self._replies: dict[int, tuple[str, Any]] = {}
        self.events: list[tuple[str, Any]] = []
        self.info: dict[str, Any] | None = None
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

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> dict[str, Any]:
        """The child's ready info (its address, pid); waits for it, or for its exit (reported
        at once: its end of the pipe closes)."""
        deadline = time.monotonic() + timeout
        while self.info is None:
            if self.gone:
                self.process.join(10)
                raise ChildError(
                    f"{self.name} exited (code {self.process.exitcode}) before it started"
                )
            left = deadline - time.monotonic()
            if left <= 0:
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

        def queued() -> int | None:
            return next(
                (i for i, (k, payload) in enumerate(self.events) if k == kind and match(payload)),
                None,
            )

        i = self._pump_until(queued, timeout, f"a {kind} event")
        return self.events.pop(i)[1]

    def _pump_until(self, found: Callable[[], T | None], timeout: float, what: str) -> T:
        """Pump the child's messages until `found()` is not None: that value.

        Raises:
            TimeoutError: not within `timeout` seconds.
            ChildError: the child exited before.
        """
        deadline = time.monotonic() + timeout
        while (value := found()) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.name}: waited {timeout} s for {what}")
            if self.gone:
                raise ChildError(f"{self.name} exited before {what}")
            self.pump(min(left, 0.05))
        return value

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
        self._pump_until(lambda: seq if seq in self._replies else None, timeout, "a reply")
        kind, value = self._replies.pop(seq)
        if kind == "error":
            raise ChildError(f"{self.name}:\n{value}")
        return value

    def call(self, name: str, *args: Any, timeout: float = 30.0, **kwargs: Any) -> Any:
        """Run a command in the child and return its value."""
        return self.reply(self.send(name, *args, **kwargs), timeout)

    # signals

    def freeze(self) -> None:
        """SIGSTOP the process, and wait until every thread of it has stopped."""
        freeze(self.pid)
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
        self,
        request: Request,
        block_ids: BlockIds,
        delay: float = 0.0,
        deadline_s: float | None = None,
    ) -> float:
        """Publish now (returns when published) or after `delay` seconds (returns at once)."""
        return self.call("publish", request, np.asarray(block_ids).tolist(), delay, deadline_s)

    def publish_computing(
        self, request: Request, block_ids: BlockIds, timeline: dict[str, float] | None = None
    ) -> float:
        """Publish before the prefill computed anything (`ready_tokens=0`), with the engine's
        `timeline` events; see `compute`."""
        ids = np.asarray(block_ids).tolist()
        return self.call("publish_computing", request, ids, timeline)

    def compute(
        self, request: Request, block_ids: BlockIds, tokens: int, layers: tuple[int, int]
    ) -> float:
        """Write tokens `[0, tokens)` of local layers `layers` (first, stop) and mark them
        ready, as a prefill step's attention layers do. Returns when marked."""
        ids = np.asarray(block_ids).tolist()
        return self.call("compute", request, ids, tokens, layers)

    def compute_paced(
        self, request: Request, block_ids: BlockIds, seconds_per_layer: float
    ) -> float:
        """A background prefill: one layer of every token per `seconds_per_layer`, each
        marked ready ("layer_ready" events). Returns when it started."""
        return self.call(
            "compute_paced", request, np.asarray(block_ids).tolist(), seconds_per_layer
        )

    def count_releases(self) -> Counter[str]:
        """Release callbacks seen so far, per request id."""
        for rid in self.take_events("release"):
            self.releases[rid] += 1
        return self.releases

    def report(self) -> dict[str, Any]:
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
        options: dict[str, Any] | None = None,
        name: str | None = None,
    ):
        self.geometry = geometry
        self.rank = rank
        self.engine_id = engine_id
        self.spec = geometry.spec(rank)
        self.caches = allocate_kv_caches(self.spec)
        for t in self.caches:
            t.share_memory_()
        poison(self.caches, POISON)
        self.model = CacheModel(self.spec, self.caches)
        self.results: dict[str, dict[str, Any]] = {}
        self.options: dict[str, Any] | None = None if options is None else dict(options)
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
        poison(self.caches, POISON)
        self.model = CacheModel(self.spec, self.caches)
        self.results.clear()

    def connect(self, addresses: Sequence[str], timeout: float = 10.0) -> list[str]:
        """Handshake; returns the strategies of this rank's pairs."""
        return self.call("connect", list(addresses), timeout, timeout=timeout + 30)

    def fetch(
        self,
        request: Request,
        block_ids: BlockIds,
        timeout: float | None = None,
        wait_timeout: float | None = None,
        streamed: bool = False,
    ) -> float:
        """Start a fetch (`timeout`: the fetch's own; `wait_timeout`: the `wait()` call's;
        `streamed`: asked for while the prefill computes); returns its start time
        (`time.monotonic()`, comparable across processes)."""
        ids = np.asarray(block_ids).tolist()
        return self.call("fetch", request, ids, timeout, wait_timeout, streamed=streamed)

    def result(self, request_id: str, timeout: float = 30.0) -> dict[str, Any]:
        """The fetch's result event (the TransferResult's fields, `started`, `finished`)."""
        if request_id not in self.results:
            got = self.wait_event("result", lambda r: r["request_id"] == request_id, timeout)
            self.results[request_id] = got
        result = self.results[request_id]
        if "crash" in result:
            raise ChildError(f"{self.name}: wait() raised {result['crash']}")
        return result

    def report(self) -> dict[str, Any]:
        """Staging pools and stats of the consumer."""
        return self.call("report")


class Rig:
    """The processes of one test or soak run; `close` ends every one of them."""

    def __init__(self) -> None:
        self.ctx = context()
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
        options: dict[str, Any] | None = None,
        name: str | None = None,
    ) -> Consumer:
        """Start a decode rank process; with `options`, it opens a KVConsumer at once."""
        c = Consumer(self.ctx, geometry, rank, engine_id, options, name)
        self.procs.append(c)
        return c

    def published_pair(
        self,
        request: Request,
        producer_options: dict[str, Any],
        consumer_options: dict[str, Any],
        connect_timeout: float = 10.0,
    ) -> tuple[Producer, Consumer, np.ndarray]:
        """A `PREFILL` rank and a `DECODE` rank connected to it, the prefill having published
        `request` on blocks of a shuffled pool (seed 1): the two, and the decode's blocks for
        it (a pool of seed 2) to fetch into."""
        producer = self.producer(PREFILL, options=producer_options)
        consumer = self.consumer(DECODE, options=consumer_options)
        consumer.connect([producer.address], timeout=connect_timeout)
        tokens = request.num_tokens
        producer.publish(request, BlockPool(PREFILL.num_blocks, 1).take(PREFILL.blocks_for(tokens)))
        return producer, consumer, BlockPool(DECODE.num_blocks, 2).take(DECODE.blocks_for(tokens))

    def ready(self, timeout: float = START_TIMEOUT_S) -> None:
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
