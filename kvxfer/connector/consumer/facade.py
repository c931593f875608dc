"""`KVConsumer`: a decode rank that fetches requests' KV from the prefill ranks.

`connect` opens an authenticated session with every producer rank of the prefill engine and
plans every rank pair once (strategy, chunk size: `kvxfer.plan.fitting`). `fetch` then asks each
producer rank that holds some of this rank's layers and heads for the request in chunks (with
pipeline parallelism on either side, only the producers of the stages holding this rank's
layers, for those layers only).

This class is the public face only: it checks the caller's arguments and hands the work to the
loop thread (`loop.EventLoop`), which runs the sessions (`sessions.ProducerSessions`) and the
fetches' chunks (`machine.FetchMachine`, the states in `states`); reads complete on the
transport's completion thread, copies into the cache on a small pool (`copies.CacheCopier`).

A producer is dead when its address refuses a connection (its process ended) or cannot be
reached again (its host lost): its chunks fail at once with their blocks, and the next fetch
shakes hands with it again. Silence alone is not death: a producer whose libzmq answered no
heartbeat for `peer_timeout_s` has its connection opened again, and if its kernel accepts (the
process exists, frozen or not run by a loaded machine) the chunks it had not answered are asked
again once it runs, within the fetch's timeout (`sessions`). A handshake's and a fetch's timeout
count only while this consumer's loop ran (`kvxfer.connector.turns.TickGaps`): a decode rank
the machine did not run gives up on nobody for its own absence.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future

import numpy as np
import torch
import zmq

from kvxfer.connector.consumer.copies import CacheCopier
from kvxfer.connector.consumer.fetches import Fetch
from kvxfer.connector.consumer.loop import EventLoop
from kvxfer.connector.consumer.machine import FetchMachine
from kvxfer.connector.consumer.results import FetchHandle
from kvxfer.connector.consumer.sessions import ProducerSession, ProducerSessions
from kvxfer.connector.registration import CacheRegistration
from kvxfer.connector.staging import StagingPool
from kvxfer.connector.stats import TransferStats
from kvxfer.connector.timeline import mark
from kvxfer.connector.turns import TickGaps
from kvxfer.execute import resolve_backend
from kvxfer.plan import DEFAULT_STAGING_SLOTS, CostModel, PairPlan, check_side, plan_pairs_into
from kvxfer.plan.cost import Chunking
from kvxfer.plan.fitting import FittedPair, fit_pair
from kvxfer.spec import KVCacheSpec
from kvxfer.transport.base import Transport
from kvxfer.validation import (
    check_block_ids,
    check_caches,
    check_request_id,
    check_side_channel_address,
    check_token_range,
)

_Connect = tuple[list[ProducerSession], Future[list[PairPlan]]]  # a connect() in progress


class KVConsumer:
    """Fetches KV into one decode rank's cache from the ranks of a prefill engine.

    Args:
        spec: this rank's geometry.
        caches: this rank's layer tensors.
        engine_id: the decode engine's id.
        host: address of this rank's transport (127.0.0.1 by default).
        secret: the producers' shared secret (proved, never sent).
        transport: a transport to share (left open), or the kind of one of its own
            (`kvxfer.transport.factory.KINDS`, on `host` and `protocol`, closed with this
            object); default: its own Mooncake transport.
        protocol: "tcp" or "rdma" for a Mooncake transport of its own.
        staging_bytes: staging pool per producer rank, in bytes: every chunk lands there.
        staging_slots: slots per pool: the most chunks in flight per producer rank and fetch
            (asked, read, confirmed or copied into the cache), so the pipeline's deepest: with
            1, each chunk is asked for only once the previous one is in the cache (pack, read,
            copy, next); with more, the producer packs the next chunks while earlier ones are
            read and copied. The cost model keeps fewer in flight when fewer hide a chunk's
            latency (`kvxfer.plan.cost.choose_chunking`).
        cost_model: constants for choosing strategies, chunk sizes and chunks in flight at
            `connect`.
        strategy: force one strategy for every pair.
        chunk_tokens: force the tokens per chunk (a multiple of the block size a strategy's
            staging mirrors, fitting both sides' slots); None: the cost model chooses, the
            smallest chunks whose fixed costs stay a small part of their byte time, within a
            staging slot (`kvxfer.plan.cost.choose_chunking`).
        backend: copy backend ("auto", "torch", "triton").
        timeout_s: default timeout of a fetch, in seconds.
        heartbeat_s: how often each producer is sent a heartbeat (libzmq's) and a ping.
        peer_timeout_s: a producer whose libzmq answers no heartbeat this long has its
            connection opened again: refused, it is dead and its chunks fail at once; accepted,
            its unanswered chunks are asked again once it answers, within their fetch's timeout.
        copy_workers: threads copying landed chunks into the cache (on CUDA they launch the
            copies on a side stream and wait for each one's event).
    """

    def __init__(
        self,
        spec: KVCacheSpec,
        caches: Sequence[torch.Tensor],
        engine_id: str,
        host: str = "127.0.0.1",
        *,
        secret: str | None = None,
        transport: Transport | str | None = None,
        protocol: str = "tcp",
        staging_bytes: int = 32 << 20,
        staging_slots: int = DEFAULT_STAGING_SLOTS,
        cost_model: CostModel | None = None,
        strategy: str | None = None,
        chunk_tokens: int | None = None,
        backend: str = "auto",
        timeout_s: float = 30.0,
        heartbeat_s: float = 0.5,
        peer_timeout_s: float = 10.0,
        copy_workers: int = 2,
    ) -> None:
        check_caches(spec, caches, "consumer")
        StagingPool.slot_size(staging_bytes, staging_slots)  # refuse a bad pool now
        if chunk_tokens is not None and (
            isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1
        ):
            raise ValueError(f"chunk_tokens: must be an integer >= 1 or None, got {chunk_tokens!r}")
        self._chunk_tokens = chunk_tokens
        backend_name = resolve_backend(backend, caches[0].device)
        self.spec = spec
        self.caches = list(caches)
        self.engine_id = engine_id
        self._staging_bytes, self._staging_slots = staging_bytes, staging_slots
        self._cost_model, self._strategy = cost_model, strategy
        self._timeout_s = timeout_s
        # Nothing but this rank's staging pools is registered: reads land only there (the
        # caches are written by local copies), so no peer can address the cache at all.
        # A transport of its own is driven by the loop (no thread: reads complete on the loop).
        self._registration = CacheRegistration([], transport, host, protocol, driven=True)
        self.transport = self._registration.transport
        self.stats = TransferStats()
        self._ctx = zmq.Context()
        self._pairs: list[FittedPair] = []
        self._pools: dict[int, StagingPool] = {}  # by producer rank, kept across sessions
        self._connects: list[_Connect] = []
        # The loop polls the sessions' sockets and ticks; the sessions tell the fetch machine
        # what happened to them (a `SessionListener`); the machine sends on the sessions.
        self._copier = CacheCopier(caches, backend_name, copy_workers)
        drive = self.transport.drive if self.transport.driven else None
        self._loop = EventLoop(
            "kvxfer-consumer", engine_id, self._sockets, self._drain, self._tick, self._busy, drive
        )
        self._machine = FetchMachine(
            spec, self._pools, self.transport, self._copier, self.stats, self._loop.post
        )
        self._sessions = ProducerSessions(
            self._ctx,
            spec,
            engine_id,
            secret or "",
            heartbeat_s,
            peer_timeout_s,
            self._machine,
            self.transport,
        )
        self._machine.sessions = self._sessions
        self._gaps = TickGaps()  # the loop's ticks (its thread only)
        self._closed = False
        self._loop.start()

    # ---- public API (any thread) ---------------------------------------------------------

    def connect(
        self,
        producer_addresses: Sequence[str],
        timeout: float = 10.0,
        *,
        held_timeout: float | None = None,
    ) -> list[PairPlan]:
        """Shake hands with every producer rank of one prefill engine; plan every pair.

        A producer answers within `timeout` seconds, or within `held_timeout` (default
        `timeout`) once its host accepted the connection: its process exists but was not run
        yet (a loaded or frozen host). An address where nothing listens fails at once.

        Give every rank's address, every (pp, tp) rank with pipeline parallelism, in any order:
        the handshake tells which layers and heads each holds. This rank fetches only from the
        producers holding some of its layers and heads, and keeps a session with every other
        one for its done and abort notices (a producer releases a request once every rank of
        the decode engine reported).

        Call it again to follow a restarted prefill engine (new addresses): fetches started
        afterwards use the new sessions; running ones on old sessions fail their chunks.

        Returns:
            The plans of the pairs that feed this rank.

        Raises:
            ValueError: a malformed address, producers that do not form one engine or cannot
                pair with this rank (nothing stays connected).
            ConnectionError: a producer did not answer in time, or refused the handshake.
        """
        self._check_open("connect")
        addresses = [check_side_channel_address(a) for a in producer_addresses]
        if not addresses:
            raise ValueError("connect: give the side-channel address of every prefill rank")
        done: Future[list[PairPlan]] = Future()
        self._loop.post(lambda: self._start_connect(addresses, timeout, held_timeout, done))
        return done.result()

    def replan(
        self, strategy: str | None = None, cost_model: CostModel | None = None
    ) -> list[PairPlan]:
        """Choose the pairs' strategies again (forced, or by a cost model) without a new
        handshake: for experiments. Fetches started afterwards use the new plans.

        Raises:
            ValueError: not connected, or a strategy whose chunks cannot fit the staging slots.
        """
        self._check_open("replan")
        done: Future[list[PairPlan]] = Future()

        def replan() -> None:
            if not self._pairs:
                done.set_exception(ValueError("replan: connect() to the prefill engine first"))
                return
            try:
                self._pairs = self._plan(cost_model or self._cost_model, strategy)
                done.set_result([p.plan for p in self._pairs])
            except Exception as exc:
                done.set_exception(exc)

        self._loop.post(replan)
        return done.result()

    def fetch(
        self,
        request_id: str,
        block_ids: Sequence[int] | np.ndarray,
        num_tokens: int,
        start_token: int = 0,
        timeout: float | None = None,
        streamed: bool = False,
    ) -> FetchHandle:
        """Start fetching tokens `[start_token, num_tokens)` of a request into `block_ids`.

        Waits for the producers to publish the request, up to `timeout` (default `timeout_s`)
        for the whole fetch. Earlier tokens' slots are never written.

        `streamed`: the prefill may still be computing the request (its producers publish it
        with `ready_tokens` and `mark_ready` its tokens and layers as they are computed). The
        fetch is then cut into chunks of fewer layers (`kvxfer.plan.cost.choose_stream_layers`)
        and asks for all of them at once; each is read as soon as its producer marks it
        computed, so the fetch ends about one chunk after the prefill's last layer. Unstreamed,
        chunks hold every layer and are asked for a few at a time (the cheaper cut for a
        request already computed).

        CUDA: call it on the engine's thread: the copies into `block_ids` run on a side stream
        after the kernels enqueued on the caller's current stream before this call (one that
        still reads those blocks for their previous owner), and after nothing enqueued later.
        A chunk counts as done once its copy has finished on the device.

        Raises:
            ValueError: bad id, token range or block ids, or not connected (nothing starts).
            RuntimeError: the consumer is closed.
        """
        self._check_open("fetch")
        request_id = check_request_id(request_id, "fetch")
        num_tokens, start_token = check_token_range(num_tokens, start_token)
        # Blocks before start_token's are never written: only the fetched ones are checked.
        ids = check_block_ids(
            self.spec, block_ids, num_tokens, f"fetch({request_id!r})", start_token
        )
        if not self._pairs:
            raise ValueError("fetch: connect() to the prefill engine first")
        handle = FetchHandle(request_id, self._wake_to_sweep)
        budget = self._timeout_s if timeout is None else timeout
        now = time.monotonic()
        fetch = Fetch(handle, ids, num_tokens, start_token, now + budget, now, streamed=streamed)
        mark(fetch.timeline, "fetch_asked")
        fetch.fence = self._copier.fence()  # on the caller's (the engine's) current stream
        self._loop.post(lambda: self._machine.start(fetch, self._pairs))
        return handle

    def abort(self, request_id: str) -> None:
        """Tell every producer that this engine will never load the request (they free its
        blocks at once), and abandon a fetch of it running here."""
        self._check_open("abort")
        request_id = check_request_id(request_id, "abort")
        self._loop.post(lambda: self._machine.abort(request_id))

    def chunking(self) -> dict[int, Chunking]:
        """How each pair's fetches are cut, by producer engine rank: tokens per chunk and
        chunks in flight (`kvxfer.plan.cost.choose_chunking`, or the forced `chunk_tokens`),
        as planned at the last `connect` or `replan`."""
        return {p.src_rank: Chunking(p.chunk_tokens, p.depth) for p in list(self._pairs)}

    def staging_free_slots(self) -> dict[int, int]:
        """Free slots of each producer rank's staging pool, by engine rank (all free when idle;
        a slot whose read has not settled is not free)."""
        return {rank: pool.free_slots for rank, pool in sorted(self._pools.items())}

    def stats_snapshot(self) -> dict[str, object]:
        """Live state, for monitoring and leak checks."""
        live, dead = self._sessions.counts()
        return {
            "sessions": live,
            "dead_sessions": dead,
            "fetches": len(self._machine.fetches),
            "quarantined_slots": len(self._machine.quarantine),
            "transport": self.transport.protocol,
            "threads": 2 + self._copier.threads,
        }

    def close(self) -> None:
        """Fail every running fetch (its unfinished blocks listed), close the sessions and
        unregister memory. Returns without waiting for peers."""
        if self._closed:
            return
        self._closed = True
        self._loop.post(self._shutdown)
        self._loop.join()
        self._copier.close()
        self._registration.close()  # ends the engine when it is ours: no read is left
        for pool in self._pools.values():
            pool.close()
        self._ctx.term()
        self._loop.close()

    def __enter__(self) -> KVConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"{what}: the consumer is closed; create a new KVConsumer")

    # ---- the loop's turn (the loop thread) ------------------------------------------------

    def _sockets(self) -> list[zmq.Socket]:
        return self._sessions.sockets()

    def _drain(self, sock: zmq.Socket) -> None:
        self._sessions.drain(sock)
        for pending, done in list(self._connects):  # a handshake may have finished now
            self._await_sessions(pending, done)

    def _busy(self) -> bool:
        """Fetches or connects in flight, or finished requests to report: their deadlines
        need the loop's short tick."""
        return bool(self._machine.fetches or self._connects or self._sessions.reporting)

    def _tick(self) -> None:
        now = time.monotonic()
        away = self._gaps.away(now)
        if away > 0:  # the loop was not run: its own absence makes nobody late
            self._sessions.postpone(away)
            self._machine.postpone(away)
        for pending, done in list(self._connects):
            self._await_sessions(pending, done)
        self._sessions.tick(now)
        self._machine.tick(now, sweep=self._loop.sweep_due(now))

    def _wake_to_sweep(self) -> None:
        """(any thread: a fetch's handle was cancelled) Look at every fetch now."""
        self._loop.post(self._machine.ask_sweep)

    def _shutdown(self) -> None:
        self._machine.shutdown()
        # Local copies in flight finish by themselves; wait for them so that close() returns
        # only when nothing more will touch the cache.
        while self._machine.copying():
            self._loop.run_posted()
            time.sleep(0.001)
        self._sessions.close()
        for _, done in self._connects:
            done.set_exception(ConnectionError("connect: the consumer closed"))
        self._loop.stop()

    # ---- connect and plan (the loop thread) ------------------------------------------------

    def _start_connect(
        self,
        addresses: list[str],
        timeout: float,
        held_timeout: float | None,
        done: Future[list[PairPlan]],
    ) -> None:
        self._sessions.drop(self._sessions.by_rank.values(), "was replaced by connect()")
        self._pairs = []
        pending = [
            self._sessions.open(address, timeout, held_timeout=held_timeout)
            for address in addresses
        ]
        self._connects.append((pending, done))

    def _await_sessions(self, pending: list[ProducerSession], done: Future[list[PairPlan]]) -> None:
        """Finish `connect` once every session is live, or one failed (then none stays)."""
        if not ProducerSessions.settled(pending):
            return
        self._connects = [c for c in self._connects if c[1] is not done]
        try:
            self._sessions.adopt(pending)
            self._pairs = self._plan(self._cost_model, self._strategy)
        except Exception as exc:
            self._sessions.drop(pending, "connect failed")
            self._pairs = []
            done.set_exception(exc)
            return
        done.set_result([p.plan for p in self._pairs])

    def _plan(self, cost_model: CostModel | None, strategy: str | None) -> list[FittedPair]:
        """Plan this rank's pairs, fit each to the staging slots and compile its unpack."""
        sessions = self._sessions.by_rank
        specs = check_side([s.spec for s in sessions.values() if s.spec], "producers")
        # This rank's pairs only: it knows its own layers, not the other decode stages'.
        plans = plan_pairs_into(
            specs, self.spec, cost_model=cost_model, strategy=strategy, landing=True
        )
        model = cost_model or CostModel()
        pairs = []
        for plan in plans:
            producer = specs[plan.src_rank]
            slot_bytes = (sessions[plan.src_rank].slot_bytes, self._pool(plan.src_rank).slot_bytes)
            pair = fit_pair(
                plan,
                producer,
                self.spec,
                slot_bytes,
                model=model,
                staging_slots=self._staging_slots,
                forced=strategy is not None,
                chunk_tokens=self._chunk_tokens,
            )
            pairs.append(pair)
            self._copier.warm_up(pair, producer, self.spec)  # compile now, not on a request
        return pairs

    def _pool(self, rank: int) -> StagingPool:
        if rank not in self._pools:
            self._pools[rank] = StagingPool(
                self.transport, self._staging_bytes, self._staging_slots, self.caches[0].device
            )
        return self._pools[rank]
