"""`KVConsumer`: a decode rank that fetches requests' KV from the prefill ranks.

`connect` shakes hands with every producer rank of the prefill engine and plans every rank
pair once (strategy, chunk size). `fetch` then asks each producer rank that holds some of this
rank's heads for the request in chunks, as many in flight as the staging pool has slots,
unpacks chunks that arrive in staging, and reports a `TransferResult`: everything written, or
exactly the destination blocks that were not.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
import zmq

from kvxfer.connector.messages import (
    ChunkDone,
    ChunkFailed,
    ErrorReply,
    Handshake,
    HandshakeReply,
    Message,
    ProtocolError,
    RegionInfo,
    RequestDone,
    TransferRequest,
    decode,
    encode,
)
from kvxfer.connector.registration import CacheRegistration
from kvxfer.connector.staging import StagingPool
from kvxfer.connector.stats import TransferRecord, TransferStats
from kvxfer.execute import resolve_backend, run_cell_copy, warm_up
from kvxfer.plan import CostModel, PairPlan, check_side, plan_pairs
from kvxfer.plan.layout import blocks_of_tokens
from kvxfer.plan.program import max_chunk_tokens, unpack_copy
from kvxfer.spec import KVCacheSpec
from kvxfer.transport.base import Transport
from kvxfer.validation import check_block_ids, check_caches, check_token_range

log = logging.getLogger(__name__)

_POLL_MS = 10
# Direct transfers use no staging; this many chunks of them are in flight per producer.
_DIRECT_WINDOW = 4


@dataclass(frozen=True)
class TransferResult:
    """The outcome of one fetch on one decode rank.

    Attributes:
        ok: every byte of tokens `[start_token, num_tokens)` is in place.
        failed_block_ids: destination blocks not (fully) written; recompute them.
        bytes: bytes written into this rank.
        num_ops: transport operations (segments) used.
        strategy: the strategies used, comma-separated when pairs differ.
        seconds: wall time of the fetch.
        errors: what went wrong, for logs.
    """

    ok: bool
    failed_block_ids: list[int]
    bytes: int
    num_ops: int
    strategy: str
    seconds: float
    errors: list[str] = field(default_factory=list)


@dataclass
class _Producer:
    address: str
    rank: int
    spec: KVCacheSpec
    session: str
    slot_bytes: int
    pool: StagingPool


@dataclass
class _Pair:
    plan: PairPlan
    producer: _Producer
    chunk_tokens: int | None  # None: the whole range at once


@dataclass
class _Chunk:
    pair: _Pair
    chunk_id: int
    start: int
    end: int
    slot: int | None = None


class FetchHandle:
    """A fetch in progress."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.future: Future[TransferResult] = Future()
        self.cancelled = threading.Event()
        self.chunks_done = 0
        self.chunks_total = 0

    def done(self) -> bool:
        """Whether the fetch has finished."""
        return self.future.done()

    def wait(self, timeout: float | None = None) -> TransferResult:
        """The result; if `timeout` passes first, the fetch is abandoned and reports every
        block it had not completed as failed."""
        try:
            return self.future.result(timeout)
        except TimeoutError:
            self.cancelled.set()
            return self.future.result()


class KVConsumer:
    """Fetches KV into one decode rank's cache from the ranks of a prefill engine.

    Args:
        spec: this rank's geometry.
        caches: this rank's layer tensors.
        engine_id: the decode engine's id.
        host: address of this rank's transport (127.0.0.1 by default).
        secret: the producers' shared secret.
        transport: a transport to share (default: an own `MooncakeTransport` on `host`,
            `protocol`, closed with this object; a shared one is left open).
        protocol: "tcp" or "rdma" for the default transport.
        staging_bytes: staging pool per producer rank, in bytes.
        staging_slots: slots per pool: chunks in flight per producer rank.
        cost_model: constants for choosing strategies at `connect`.
        strategy: force one strategy for every pair.
        backend: unpack backend ("auto", "torch", "triton").
        timeout_s: default timeout of a fetch, in seconds.
        late_write_grace_s: how long a staging slot of an abandoned chunk stays out of use
            (the producer may still be writing into it).
        max_fetches: fetches running at once.
    """

    def __init__(
        self,
        spec: KVCacheSpec,
        caches: Sequence[torch.Tensor],
        engine_id: str,
        host: str = "127.0.0.1",
        *,
        secret: str | None = None,
        transport: Transport | None = None,
        protocol: str = "tcp",
        staging_bytes: int = 32 << 20,
        staging_slots: int = 4,
        cost_model: CostModel | None = None,
        strategy: str | None = None,
        backend: str = "auto",
        timeout_s: float = 30.0,
        late_write_grace_s: float = 30.0,
        max_fetches: int = 8,
    ) -> None:
        check_caches(spec, caches, "consumer")
        self.spec = spec
        self.caches = list(caches)
        self.engine_id = engine_id
        self._secret = secret or ""
        self._staging_bytes, self._staging_slots = staging_bytes, staging_slots
        self._cost_model, self._strategy = cost_model, strategy
        self._backend = resolve_backend(backend, caches[0].device)
        self._timeout_s = timeout_s
        self._grace_s = late_write_grace_s
        self._registration = CacheRegistration(self.caches, transport, host, protocol)
        self.transport = self._registration.transport
        self._cache_regions = self._registration.regions
        self._ctx = zmq.Context()
        self._producers: list[_Producer] = []
        self._pairs: list[_Pair] = []
        self._fetches = ThreadPoolExecutor(max_fetches, thread_name_prefix="kvxfer-fetch")
        self.stats = TransferStats()
        self._closed = False

    # ---- handshake ----------------------------------------------------------------------

    def connect(self, producer_addresses: Sequence[str], timeout: float = 10.0) -> list[PairPlan]:
        """Shake hands with every producer rank of one prefill engine; plan every pair.

        Returns:
            The plans of the pairs that feed this rank.

        Raises:
            ConnectionError: a producer did not answer in time, or refused the handshake.
            ValueError: the producers do not form one engine, or cannot pair with this rank.
        """
        if self._producers:
            raise ValueError("connect: already connected; use a new KVConsumer per engine")
        producers: list[_Producer] = []
        try:
            for address in producer_addresses:
                producers.append(self._handshake(address, timeout))
            check_side([p.spec for p in producers], "producers")
            pairs = self._plan_pairs(producers, self._cost_model, self._strategy)
        except Exception:
            for producer in producers:
                producer.pool.close()
            raise
        self._producers, self._pairs = producers, pairs
        return [pair.plan for pair in pairs]

    def replan(
        self, strategy: str | None = None, cost_model: CostModel | None = None
    ) -> list[PairPlan]:
        """Choose the pairs' strategies again (forced, or by a cost model) without a new
        handshake: for experiments. Fetches started afterwards use the new plans.

        Raises:
            ValueError: not connected, or a strategy whose chunks cannot fit the staging slots.
        """
        if not self._producers:
            raise ValueError("replan: connect() to the prefill engine first")
        self._pairs = self._plan_pairs(self._producers, cost_model or self._cost_model, strategy)
        return [pair.plan for pair in self._pairs]

    def _plan_pairs(
        self, producers: list[_Producer], cost_model: CostModel | None, strategy: str | None
    ) -> list[_Pair]:
        src = check_side([p.spec for p in producers], "producers")
        dst = self.spec.engine_ranks()
        plans = plan_pairs(src, dst, cost_model=cost_model, strategy=strategy)
        by_rank = {p.rank: p for p in producers}
        pairs = []
        for plan in plans:
            if plan.dst_rank != self.spec.tp_rank:
                continue
            producer = by_rank[plan.src_rank]
            chunk = max_chunk_tokens(
                plan.strategy,
                plan.route,
                producer.spec,
                self.spec,
                producer.slot_bytes,
                producer.pool.slot_bytes,
            )
            if chunk is not None and chunk < 1:
                raise ValueError(
                    f"staging_bytes: a slot cannot hold one token of pair {plan.src_rank}->"
                    f"{plan.dst_rank} ({plan.strategy}); raise staging_bytes on both sides"
                )
            pairs.append(_Pair(plan, producer, chunk))
            unpack = unpack_copy(
                plan.strategy, plan.route, producer.spec, self.spec, np.zeros(1, np.int64), 0, 1
            )
            if unpack is not None:  # compile now, not on the first request
                warm_up(unpack, self.caches[0].dtype, self.caches[0].device, self._backend)
        return pairs

    def _handshake(self, address: str, timeout: float) -> _Producer:
        pool = StagingPool(
            self.transport, self._staging_bytes, self._staging_slots, self.caches[0].device
        )
        hello = Handshake(
            engine_id=self.engine_id,
            rank=self.spec.tp_rank,
            spec=self.spec,
            endpoint=self.transport.endpoint,
            cache_regions=[
                RegionInfo(r.region_id, r.address, r.nbytes) for r in self._cache_regions
            ],
            staging_region=RegionInfo(
                pool.region.region_id, pool.region.address, pool.region.nbytes
            ),
            staging_slot_bytes=pool.slot_bytes,
            secret=self._secret,
        )
        sock = self._socket(address)
        try:
            sock.send(encode(hello))
            reply = _receive(sock, timeout)
        finally:
            sock.close(linger=0)
        if reply is None:
            pool.close()
            raise ConnectionError(f"producer {address} did not answer the handshake in {timeout} s")
        if not isinstance(reply, HandshakeReply):
            pool.close()
            reason = reply.reason if isinstance(reply, ErrorReply) else type(reply).__name__
            raise ConnectionError(f"producer {address} refused the handshake: {reason}")
        return _Producer(
            address, reply.rank, reply.spec, reply.session, reply.staging_slot_bytes, pool
        )

    def _socket(self, address: str) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 2000)  # let RequestDone out before a socket closes
        sock.connect(address)
        return sock

    # ---- fetch --------------------------------------------------------------------------

    def fetch(
        self,
        request_id: str,
        block_ids: Sequence[int] | np.ndarray,
        num_tokens: int,
        start_token: int = 0,
        timeout: float | None = None,
    ) -> FetchHandle:
        """Start fetching tokens `[start_token, num_tokens)` of a request into `block_ids`.

        Waits for the producers to publish the request, up to `timeout` (default `timeout_s`)
        for the whole fetch. Earlier tokens' slots are never written.

        Raises:
            ValueError: bad token range or block ids (nothing is started).
        """
        if not self._pairs:
            raise ValueError("fetch: connect() to the prefill engine first")
        check_token_range(num_tokens, start_token)
        ids = check_block_ids(self.spec, block_ids, num_tokens, f"fetch({request_id!r})")
        handle = FetchHandle(request_id)
        budget = self._timeout_s if timeout is None else timeout
        self._fetches.submit(self._run_fetch, handle, ids, num_tokens, start_token, budget)
        return handle

    def _run_fetch(
        self,
        handle: FetchHandle,
        block_ids: np.ndarray,
        num_tokens: int,
        start_token: int,
        budget: float,
    ) -> None:
        began = time.monotonic()
        try:
            result = _Fetch(self, handle, block_ids, num_tokens, start_token, began + budget).run()
        except Exception as exc:  # a bug must still complete the handle, with every block
            log.exception("fetch %s crashed", handle.request_id)
            failed = blocks_of_tokens(block_ids, self.spec.block_size, start_token, num_tokens)
            result = TransferResult(False, failed, 0, 0, "", time.monotonic() - began, [repr(exc)])
        if not result.ok:
            log.warning(
                "fetch %s failed, %d blocks to recompute: %s",
                handle.request_id,
                len(result.failed_block_ids),
                "; ".join(result.errors),
            )
        self.stats.record(
            TransferRecord(
                handle.request_id,
                result.seconds,
                result.bytes,
                result.num_ops,
                result.strategy,
                result.ok,
            )
        )
        handle.future.set_result(result)

    def staging_free_slots(self) -> dict[int, int]:
        """Free slots of each producer rank's staging pool (all free when idle)."""
        return {p.rank: p.pool.free_slots for p in self._producers}

    def close(self) -> None:
        """Wait for running fetches, close sockets, unregister memory."""
        if self._closed:
            return
        self._closed = True
        self._fetches.shutdown(wait=True)
        self._ctx.term()
        for producer in self._producers:
            producer.pool.close()
        self._registration.close()

    def __enter__(self) -> KVConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Fetch:
    """One fetch: chunks out, answers in, unpack, done reports."""

    def __init__(
        self,
        consumer: KVConsumer,
        handle: FetchHandle,
        block_ids: np.ndarray,
        num_tokens: int,
        start_token: int,
        deadline: float,
    ) -> None:
        self.c, self.handle = consumer, handle
        self.pairs = list(consumer._pairs)  # the plans when the fetch started
        self.block_ids, self.num_tokens, self.start = block_ids, num_tokens, start_token
        self.deadline = deadline
        # by producer rank (one pair per producer rank feeds this rank), and (rank, chunk id)
        self.queues: dict[int, list[_Chunk]] = {}
        self.in_flight: dict[tuple[int, int], _Chunk] = {}
        self.failed: list[_Chunk] = []
        self.errors: list[str] = []
        self.nbytes = self.num_ops = 0

    def run(self) -> TransferResult:
        began = time.monotonic()
        sockets = {p.rank: self.c._socket(p.address) for p in self.c._producers}
        try:
            self._plan_chunks()
            self.handle.chunks_total = sum(len(q) for q in self.queues.values())
            while self.queues or self.in_flight:
                if self.handle.cancelled.is_set() or time.monotonic() >= self.deadline:
                    why = "cancelled" if self.handle.cancelled.is_set() else "timed out"
                    self._abandon(why)
                    break
                self._send_ready(sockets)
                self._receive_answers(sockets)
            ok = not self.failed
            for producer in self.c._producers:
                done = RequestDone(
                    session=producer.session, request_id=self.handle.request_id, ok=ok
                )
                sockets[producer.rank].send(encode(done))
        finally:
            for sock in sockets.values():
                sock.close()
        failed_ids = sorted(
            {
                int(block)
                for chunk in self.failed
                for block in blocks_of_tokens(
                    self.block_ids, self.c.spec.block_size, chunk.start, chunk.end
                )
            }
        )
        strategies = sorted({pair.plan.strategy for pair in self.pairs})
        return TransferResult(
            ok=not self.failed,
            failed_block_ids=failed_ids,
            bytes=self.nbytes,
            num_ops=self.num_ops,
            strategy=",".join(strategies),
            seconds=time.monotonic() - began,
            errors=self.errors,
        )

    def _plan_chunks(self) -> None:
        if self.start == self.num_tokens:
            return
        for pair in self.pairs:
            step = pair.chunk_tokens or (self.num_tokens - self.start)
            bounds = range(self.start, self.num_tokens, step)
            self.queues[pair.producer.rank] = [
                _Chunk(pair, i, s, min(s + step, self.num_tokens)) for i, s in enumerate(bounds)
            ]

    def _needs_staging(self, pair: _Pair) -> bool:
        return pair.plan.strategy in ("unpack", "pack+unpack")

    def _send_ready(self, sockets: dict[int, zmq.Socket]) -> None:
        for rank in list(self.queues):
            queue = self.queues[rank]
            pair = queue[0].pair
            pool = pair.producer.pool
            window = pool.num_slots if self._needs_staging(pair) else _DIRECT_WINDOW
            while queue and sum(1 for k in self.in_flight if k[0] == rank) < window:
                chunk = queue[0]
                if self._needs_staging(pair):
                    chunk.slot = pool.try_acquire()
                    if chunk.slot is None:
                        break  # pool full (other fetches): wait, do not fail
                queue.pop(0)
                self.in_flight[(rank, chunk.chunk_id)] = chunk
                sockets[rank].send(encode(self._ask(chunk)))
            if not queue:
                del self.queues[rank]

    def _ask(self, chunk: _Chunk) -> TransferRequest:
        pool = chunk.pair.producer.pool
        return TransferRequest(
            session=chunk.pair.producer.session,
            request_id=self.handle.request_id,
            chunk_id=chunk.chunk_id,
            dst_block_ids=self.block_ids.tolist(),
            num_tokens=self.num_tokens,
            token_start=chunk.start,
            token_end=chunk.end,
            strategy=chunk.pair.plan.strategy,
            staging_offset=-1 if chunk.slot is None else pool.offset(chunk.slot),
            wait_seconds=max(0.0, self.deadline - time.monotonic()),
        )

    def _receive_answers(self, sockets: dict[int, zmq.Socket]) -> None:
        poller = zmq.Poller()
        for sock in sockets.values():
            poller.register(sock, zmq.POLLIN)
        wait_ms = max(0, min(_POLL_MS, int((self.deadline - time.monotonic()) * 1000)))
        for sock, _ in poller.poll(wait_ms):
            rank = next(r for r, s in sockets.items() if s is sock)
            while True:
                try:
                    frame = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    self._on_answer(rank, decode(frame))
                except ProtocolError as exc:
                    self.errors.append(f"producer rank {rank}: {exc}")

    def _on_answer(self, rank: int, answer: Message) -> None:
        if isinstance(answer, ErrorReply):
            # The producer refused a request without saying which: fail its chunks in flight.
            self.errors.append(f"producer rank {rank}: {answer.reason}")
            for key, chunk in list(self.in_flight.items()):
                if chunk.pair.producer.rank == rank:
                    self._fail(key, chunk, release_now=True)
            return
        if (
            not isinstance(answer, ChunkDone | ChunkFailed)
            or answer.request_id != self.handle.request_id
        ):
            return
        key = (rank, answer.chunk_id)
        if key not in self.in_flight:
            return
        chunk = self.in_flight[key]
        if isinstance(answer, ChunkFailed):
            self.errors.append(
                f"producer rank {rank}, tokens [{chunk.start}, {chunk.end}): {answer.reason}"
            )
            self._fail(key, chunk, release_now=True)
            self._drop_queue(key[0])
            return
        try:
            self._unpack(chunk)
        except Exception as exc:
            self.errors.append(f"unpack of tokens [{chunk.start}, {chunk.end}): {exc}")
            self._fail(key, chunk, release_now=True)
            return
        del self.in_flight[key]
        if chunk.slot is not None:
            chunk.pair.producer.pool.release(chunk.slot)
        self.nbytes += answer.nbytes
        self.num_ops += answer.num_ops
        self.handle.chunks_done += 1

    def _unpack(self, chunk: _Chunk) -> None:
        pair = chunk.pair
        copy = unpack_copy(
            pair.plan.strategy,
            pair.plan.route,
            pair.producer.spec,
            self.c.spec,
            self.block_ids,
            chunk.start,
            chunk.end,
        )
        if copy is None:
            return
        assert chunk.slot is not None
        elements = len(self.c.caches) * copy.src.geometry.layer_elements
        staging = pair.producer.pool.slot_tensor(chunk.slot, self.c.caches[0].dtype)[:elements]
        run_cell_copy(copy, [staging], self.c.caches, self.c._backend)

    def _fail(self, key: tuple[int, int], chunk: _Chunk, release_now: bool) -> None:
        del self.in_flight[key]
        self.failed.append(chunk)
        if chunk.slot is not None:
            pool = chunk.pair.producer.pool
            if release_now:
                pool.release(chunk.slot)
            else:
                pool.release_later(chunk.slot, self.c._grace_s)

    def _drop_queue(self, rank: int) -> None:
        self.failed.extend(self.queues.pop(rank, []))

    def _abandon(self, why: str) -> None:
        self.errors.append(f"fetch {why} with {len(self.in_flight)} chunks in flight")
        for key, chunk in list(self.in_flight.items()):
            self._fail(key, chunk, release_now=False)  # the producer may still write there
        for rank in list(self.queues):
            self._drop_queue(rank)


def _receive(sock: zmq.Socket, timeout: float) -> Message | None:
    if not sock.poll(int(timeout * 1000)):
        return None
    try:
        return decode(sock.recv())
    except ProtocolError as exc:
        return ErrorReply(reason=f"unreadable answer: {exc}")
