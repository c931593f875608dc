"""`KVProducer`: a prefill rank that serves its requests' KV to decode ranks.

Push, on request: a consumer rank asks for a chunk of a request (its block ids, a token range,
the strategy and, for strategies that unpack, a slot of its staging pool); the producer packs
when the strategy says so and writes the bytes into the consumer's registered memory, then
answers on the side channel. The consumer knows where the bytes go, the producer knows when
they exist; writes are the fast path of RDMA NICs.

Threads: one side-channel thread owns the ZeroMQ sockets; chunks run on a worker pool and hand
their answers back through an inproc socket.
"""

from __future__ import annotations

import hmac
import itertools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
import zmq

from kvxfer.connector.messages import (
    ChunkDone,
    ChunkFailed,
    Handshake,
    HandshakeReply,
    Message,
    ProtocolError,
    RequestDone,
    TransferRequest,
    answer_frames,
    encode,
)
from kvxfer.connector.registration import CacheRegistration
from kvxfer.connector.staging import StagingPool
from kvxfer.execute import resolve_backend, run_cell_copy, warm_up
from kvxfer.plan import HeadRoute, build_program, check_pairable, route_heads
from kvxfer.plan.layout import STAGING_REGION, blocks_of_tokens
from kvxfer.plan.program import check_strategy, program_shape
from kvxfer.spec import KVCacheSpec
from kvxfer.transport.base import Peer, Region, Transport
from kvxfer.validation import check_block_ids, check_caches

log = logging.getLogger(__name__)

HARD_FRAME_LIMIT = 64 << 20  # ZeroMQ drops peers that send more; smaller frames get a reply
_POLL_MS = 10
_instances = itertools.count()


@dataclass
class _Consumer:
    """A consumer rank that completed the handshake."""

    session: str
    engine_id: str
    rank: int
    spec: KVCacheSpec
    peer: Peer
    staging_region: int | None
    route: HeadRoute | None  # the heads this producer sends to that rank, if any
    pool: StagingPool | None = None


@dataclass
class _Request:
    """A published request, until released."""

    block_ids: np.ndarray
    num_tokens: int
    deadline: float
    reported: set[tuple[str, int]] = field(default_factory=set)  # (engine, rank) that are done


@dataclass
class _WaitingChunk:
    identity: bytes
    consumer: _Consumer
    message: TransferRequest
    deadline: float


class KVProducer:
    """Serves one prefill rank's KV cache to decode ranks.

    Args:
        spec: this rank's geometry.
        caches: this rank's layer tensors (the layout contract's shapes).
        engine_id: the prefill engine's id.
        host: address to bind the side channel and the transport to (127.0.0.1 by default).
        port: side-channel port (0: any free port; see `address`).
        release: called with a request id once every decode rank is done with it, or at its
            deadline; exactly once per published request.
        secret: a shared secret consumers must present at handshake.
        transport: a transport to share (default: an own `MooncakeTransport` on `host`,
            `protocol`, closed with this object; a shared one is left open).
        protocol: "tcp" or "rdma" for the default transport.
        staging_bytes: staging pool per consumer rank, in bytes.
        staging_slots: slots in each pool (chunks in flight per consumer rank).
        request_timeout_s: default deadline of a published request.
        write_timeout_s: how long one chunk's write may take before it counts as failed.
        backend: pack backend ("auto", "torch", "triton").
        workers: chunks processed at once.
    """

    def __init__(
        self,
        spec: KVCacheSpec,
        caches: Sequence[torch.Tensor],
        engine_id: str,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        release: Callable[[str], None] | None = None,
        secret: str | None = None,
        transport: Transport | None = None,
        protocol: str = "tcp",
        staging_bytes: int = 32 << 20,
        staging_slots: int = 4,
        request_timeout_s: float = 300.0,
        write_timeout_s: float = 60.0,
        backend: str = "auto",
        workers: int = 4,
    ) -> None:
        check_caches(spec, caches, "producer")
        self.spec = spec
        self.caches = list(caches)
        self.engine_id = engine_id
        self._release_cb = release
        self._secret = secret or ""
        self._staging_bytes, self._staging_slots = staging_bytes, staging_slots
        self._slot_bytes = StagingPool.slot_size(staging_bytes, staging_slots)
        self._request_timeout_s = request_timeout_s
        self._write_timeout_s = write_timeout_s
        self._backend = resolve_backend(backend, caches[0].device)
        self._registration = CacheRegistration(self.caches, transport, host, protocol)
        self.transport = self._registration.transport
        self._cache_regions = self._registration.regions
        self._cache_places = {i: (r.region_id, 0) for i, r in enumerate(self._cache_regions)}

        self._lock = threading.Lock()
        self._requests: dict[str, _Request] = {}
        self._released: set[str] = set()
        self._consumers: dict[str, _Consumer] = {}
        self._waiting: list[_WaitingChunk] = []

        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.MAXMSGSIZE, HARD_FRAME_LIMIT)
        self._router.setsockopt(zmq.LINGER, 0)
        if port == 0:
            port = self._router.bind_to_random_port(f"tcp://{host}")
        else:
            self._router.bind(f"tcp://{host}:{port}")
        self.address = f"tcp://{host}:{port}"
        self._answers_address = f"inproc://kvxfer-producer-{next(_instances)}"
        self._answers = self._ctx.socket(zmq.PULL)
        self._answers.bind(self._answers_address)
        self._local = threading.local()
        self._worker_sockets: list[zmq.Socket] = []

        self._workers = ThreadPoolExecutor(workers, thread_name_prefix="kvxfer-producer")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvxfer-producer", daemon=True)
        self._thread.start()

    # ---- public API ---------------------------------------------------------------------

    def publish(
        self,
        request_id: str,
        block_ids: Sequence[int] | np.ndarray,
        num_tokens: int,
        deadline_s: float | None = None,
    ) -> None:
        """Offer a request's KV (tokens `[0, num_tokens)` in `block_ids`) to decode ranks.

        Its blocks stay untouched by kvxfer and are handed back through `release` once every
        decode rank reported done, or `deadline_s` (default `request_timeout_s`) after now.
        """
        ids = check_block_ids(self.spec, block_ids, num_tokens, f"publish({request_id!r})")
        timeout = self._request_timeout_s if deadline_s is None else deadline_s
        with self._lock:
            if request_id in self._requests or request_id in self._released:
                raise ValueError(f"request_id: {request_id!r} was already published")
            self._requests[request_id] = _Request(ids, num_tokens, time.monotonic() + timeout)

    @property
    def pending_requests(self) -> list[str]:
        """Published requests not released yet."""
        with self._lock:
            return sorted(self._requests)

    def staging_free_slots(self) -> dict[tuple[str, int], int]:
        """Free slots of each consumer rank's staging pool (all free when idle)."""
        with self._lock:
            return {
                (c.engine_id, c.rank): c.pool.free_slots
                for c in self._consumers.values()
                if c.pool is not None
            }

    def close(self) -> None:
        """Stop serving, wait for running chunks, unregister memory."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        self._workers.shutdown(wait=True)
        for sock in self._worker_sockets:
            sock.close(linger=0)
        self._router.close(linger=0)
        self._answers.close(linger=0)
        self._ctx.term()
        for consumer in self._consumers.values():
            if consumer.pool is not None:
                consumer.pool.close()
        self._registration.close()

    def __enter__(self) -> KVProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- side channel -------------------------------------------------------------------

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._answers, zmq.POLLIN)
        while not self._stop.is_set():
            events = dict(poller.poll(_POLL_MS))
            if self._router in events:
                self._drain(self._router, self._on_frames)
            if self._answers in events:
                self._drain(self._answers, self._router.send_multipart)
            self._dispatch_waiting()
            self._expire()

    @staticmethod
    def _drain(sock: zmq.Socket, handle: Callable[[list[bytes]], object]) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            handle(frames)

    def _on_frames(self, frames: list[bytes]) -> None:
        identity, reply = answer_frames(frames, self._on_message, "side channel")
        if reply is not None:
            self._reply(identity, reply)

    def _on_message(self, identity: bytes, message: Message) -> None:
        # Answers go out from the handlers (a chunk's answer comes later, from a worker).
        if isinstance(message, Handshake):
            self._on_handshake(identity, message)
        elif isinstance(message, TransferRequest | RequestDone):
            consumer = self._consumers.get(message.session)
            if consumer is None:
                raise ProtocolError("unknown session; handshake first")
            if isinstance(message, TransferRequest):
                self._on_transfer(identity, consumer, message)
            else:
                self._on_request_done(consumer, message)
        else:
            raise ProtocolError(f"a producer does not accept {type(message).__name__} messages")

    def _reply(self, identity: bytes, message: Message) -> None:
        self._router.send_multipart([identity, encode(message)])

    def _on_handshake(self, identity: bytes, hello: Handshake) -> None:
        if not hmac.compare_digest(hello.secret.encode(), self._secret.encode()):
            raise ProtocolError("handshake refused: wrong or missing shared secret")
        try:
            check_pairable(self.spec, hello.spec)
            peer = _advertised_peer(hello)
        except ValueError as exc:
            raise ProtocolError(f"handshake refused: {exc}") from exc
        routes = route_heads(self.spec.num_kv_heads, self.spec.tp_size, hello.spec.tp_size)
        route = next(
            (r for r in routes if r.src_rank == self.spec.tp_rank and r.dst_rank == hello.rank),
            None,
        )
        if route is not None:
            self._warm_up(route, hello.spec)
        session = secrets.token_hex(16)
        staging = _staging_key(hello.spec) if hello.staging_region else None
        consumer = _Consumer(session, hello.engine_id, hello.rank, hello.spec, peer, staging, route)
        with self._lock:
            self._consumers[session] = consumer
        self._reply(
            identity,
            HandshakeReply(
                engine_id=self.engine_id,
                rank=self.spec.tp_rank,
                spec=self.spec,
                endpoint=self.transport.endpoint,
                session=session,
                staging_slot_bytes=self._slot_bytes,
            ),
        )

    def _warm_up(self, route: HeadRoute, consumer_spec: KVCacheSpec) -> None:
        """Compile the packs this pair may ask for at handshake, not on its first request."""
        one = np.zeros(1, dtype=np.int64)
        for strategy in ("pack", "pack+unpack"):
            shape = program_shape(strategy, route, self.spec, consumer_spec, one, one, 0, 1)
            assert shape.pack is not None
            warm_up(shape.pack, self.caches[0].dtype, self.caches[0].device, self._backend)

    def _on_transfer(self, identity: bytes, consumer: _Consumer, ask: TransferRequest) -> None:
        with self._lock:
            published = ask.request_id in self._requests
            released = ask.request_id in self._released
        if published:
            self._workers.submit(self._run_chunk, identity, consumer, ask)
        elif released:
            self._reply(identity, _failed(ask, consumer, "the request was already released"))
        else:
            deadline = time.monotonic() + ask.wait_seconds
            self._waiting.append(_WaitingChunk(identity, consumer, ask, deadline))

    def _on_request_done(self, consumer: _Consumer, done: RequestDone) -> None:
        with self._lock:
            request = self._requests.get(done.request_id)
            if request is None:
                return
            request.reported.add((consumer.engine_id, consumer.rank))
            ranks = {rank for engine, rank in request.reported if engine == consumer.engine_id}
            finished = len(ranks) >= consumer.spec.tp_size
        if finished:
            self._release(done.request_id, "every decode rank is done")

    def _dispatch_waiting(self) -> None:
        if not self._waiting:
            return
        now, still = time.monotonic(), []
        for chunk in self._waiting:
            with self._lock:
                published = chunk.message.request_id in self._requests
            if published:
                self._workers.submit(self._run_chunk, chunk.identity, chunk.consumer, chunk.message)
            elif now >= chunk.deadline:
                reason = f"not published within {chunk.message.wait_seconds:.1f} s"
                self._reply(chunk.identity, _failed(chunk.message, chunk.consumer, reason))
            else:
                still.append(chunk)
        self._waiting = still

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [rid for rid, r in self._requests.items() if r.deadline <= now]
        for request_id in expired:
            self._release(request_id, "its deadline passed")

    def _release(self, request_id: str, why: str) -> None:
        with self._lock:
            if self._requests.pop(request_id, None) is None:
                return  # released already: the callback runs once
            self._released.add(request_id)
        log.debug("releasing request %s: %s", request_id, why)
        if self._release_cb is not None:
            try:
                self._release_cb(request_id)
            except Exception:
                log.exception("release callback failed for request %s", request_id)

    # ---- chunks (worker threads) --------------------------------------------------------

    def _answer(self, identity: bytes, message: Message) -> None:
        sock = getattr(self._local, "sock", None)
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.connect(self._answers_address)
            self._local.sock = sock
            with self._lock:
                self._worker_sockets.append(sock)
        sock.send_multipart([identity, encode(message)])

    def _run_chunk(self, identity: bytes, consumer: _Consumer, ask: TransferRequest) -> None:
        try:
            self._answer(identity, self._write_chunk(consumer, ask))
        except Exception as exc:
            log.warning("request %s chunk %d failed: %s", ask.request_id, ask.chunk_id, exc)
            self._answer(identity, _failed(ask, consumer, f"{type(exc).__name__}: {exc}"))

    def _write_chunk(self, consumer: _Consumer, ask: TransferRequest) -> ChunkDone:
        if consumer.route is None:
            raise ValueError(
                f"producer rank {self.spec.tp_rank} holds no heads that consumer rank "
                f"{consumer.rank} needs"
            )
        with self._lock:
            request = self._requests.get(ask.request_id)
        if request is None:
            raise ValueError("the request was released before its chunk ran")
        if ask.num_tokens != request.num_tokens or not (
            0 <= ask.token_start < ask.token_end <= request.num_tokens
        ):
            raise ValueError(
                f"tokens [{ask.token_start}, {ask.token_end}) of {ask.num_tokens} do not fit "
                f"the published {request.num_tokens} tokens"
            )
        dst_ids = check_block_ids(consumer.spec, ask.dst_block_ids, ask.num_tokens, "consumer")
        program = build_program(
            consumer.route,
            check_strategy(ask.strategy),
            self.spec,
            consumer.spec,
            request.block_ids,
            dst_ids,
            ask.token_start,
            ask.token_end,
        )
        src_places = dict(self._cache_places)
        dst_places = {i: (i, 0) for i in range(consumer.spec.num_layers)}
        if program.dst_staging is not None:
            if consumer.staging_region is None or ask.staging_offset < 0:
                raise ValueError(f"strategy {ask.strategy} needs a staging slot on the consumer")
            dst_places[STAGING_REGION] = (consumer.staging_region, ask.staging_offset)
        if program.pack is None:
            segments = program.segments.with_regions(src_places, dst_places)
            self.transport.write(segments, consumer.peer, timeout=self._write_timeout_s)
            return _done(ask, segments.nbytes, len(segments))
        assert program.src_staging is not None
        pool = self._pool_for(consumer)
        slot = pool.acquire(timeout=max(ask.wait_seconds, 1.0))
        written = False
        try:
            elements = program.num_layers * program.src_staging.layer_elements
            staging = pool.slot_tensor(slot, self.caches[0].dtype)[:elements]
            run_cell_copy(program.pack, self.caches, [staging], self._backend)
            if self.caches[0].device.type == "cuda":
                torch.cuda.current_stream().synchronize()  # the NIC reads what the kernel wrote
            src_places[STAGING_REGION] = (pool.region.region_id, pool.offset(slot))
            segments = program.segments.with_regions(src_places, dst_places)
            self.transport.write(segments, consumer.peer, timeout=self._write_timeout_s)
            written = True
            return _done(ask, segments.nbytes, len(segments))
        finally:
            if written:
                pool.release(slot)
            else:  # a write that timed out may still be reading the slot
                pool.release_later(slot, self._write_timeout_s)

    def _pool_for(self, consumer: _Consumer) -> StagingPool:
        with self._lock:
            if consumer.pool is None:
                consumer.pool = StagingPool(
                    self.transport,
                    self._staging_bytes,
                    self._staging_slots,
                    self.caches[0].device,
                )
            return consumer.pool


def _done(ask: TransferRequest, nbytes: int, num_ops: int) -> ChunkDone:
    return ChunkDone(
        request_id=ask.request_id, chunk_id=ask.chunk_id, nbytes=nbytes, num_ops=num_ops
    )


def _failed(ask: TransferRequest, consumer: _Consumer, reason: str) -> ChunkFailed:
    """A chunk's failure, naming the consumer's blocks that hold its tokens."""
    blocks = blocks_of_tokens(
        ask.dst_block_ids, consumer.spec.block_size, ask.token_start, ask.token_end
    )
    return ChunkFailed(
        request_id=ask.request_id, chunk_id=ask.chunk_id, reason=reason, dst_block_ids=blocks
    )


def _advertised_peer(hello: Handshake) -> Peer:
    """The consumer's regions as a transport peer, after checking they cover its cache.

    The consumer numbers its cache regions 0..layers-1 in the plan's region keys; the producer
    maps layer `i` to the i-th advertised region.

    Raises:
        ValueError: a layer region missing or smaller than the spec's layer size.
    """
    spec = hello.spec
    if len(hello.cache_regions) != spec.num_layers:
        raise ValueError(
            f"the consumer advertises {len(hello.cache_regions)} cache regions for "
            f"{spec.num_layers} layers"
        )
    regions: dict[int, Region] = {}
    for layer, info in enumerate(hello.cache_regions):
        if info.nbytes < spec.layer_bytes:
            raise ValueError(
                f"the consumer's region for layer {layer} has {info.nbytes} bytes, but its "
                f"spec needs {spec.layer_bytes}: the region does not cover the cache"
            )
        regions[layer] = Region(layer, info.address, info.nbytes)
    if hello.staging_region is not None:
        info = hello.staging_region
        if info.nbytes < hello.staging_slot_bytes:
            raise ValueError("the consumer's staging region is smaller than one slot")
        key = _staging_key(spec)
        regions[key] = Region(key, info.address, info.nbytes)
    return Peer(hello.endpoint, regions)


def _staging_key(spec: KVCacheSpec) -> int:
    """The consumer's staging region among its advertised regions: after the layers."""
    return spec.num_layers
