"""`KVConsumer`: a decode rank that fetches requests' KV from the prefill ranks.

`connect` opens an authenticated session with every producer rank of the prefill engine and
plans every rank pair once (strategy, chunk size). `fetch` then asks each producer rank that
holds some of this rank's layers and heads for the request in chunks (with pipeline
parallelism on either side, only the producers of the stages holding this rank's layers, for
those layers only). For every chunk:

    ask -> producer answers ChunkReady -> read into own staging -> ChunkRead -> ChunkValid
        -> copy staging into the cache (locally) -> done

The cache is written only by that last local copy, after the read has fully landed and the
producer confirmed the source was held throughout. A read that a fetch gives up on lands, if
ever, in a staging slot that stays out of use until Mooncake says the read has settled. Hence
the no-late-byte contract: once `wait` returned, or a block was reported failed, nothing of the
fetch lands in the cache (README, "No late bytes").

One thread runs every session and every fetch as state machines (no thread per fetch, so
abandoned fetches cannot exhaust anything); reads complete on the transport's completion thread;
local copies run on a small pool. Up to `staging_slots` chunks per producer rank are in flight
at once, each in its own slot, so the producer packs chunk i+1 while chunk i is read and chunk
i-1 is copied into the cache. On CUDA the copies run on the consumer's side stream
(`kvxfer.connector.streams`) after the fetch's fence, and a chunk is done (its slot free, its
blocks reported) once its copy's own event completed.

A producer silent for `peer_timeout_s` is declared dead: its chunks fail at once with their
blocks, and the next fetch shakes hands with it again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
import zmq

from kvxfer.connector import auth
from kvxfer.connector.messages import (
    Abort,
    Challenge,
    ChunkFailed,
    ChunkRead,
    ChunkReady,
    ChunkValid,
    ErrorReply,
    Handshake,
    HandshakeReply,
    Hello,
    Message,
    Ping,
    Pong,
    ProtocolError,
    RequestDone,
    TransferRequest,
    decode,
    encode,
)
from kvxfer.connector.registration import CacheRegistration
from kvxfer.connector.staging import StagingPool
from kvxfer.connector.stats import TransferRecord, TransferStats
from kvxfer.connector.streams import Fence, copy_stream_for
from kvxfer.execute import resolve_backend, run_cell_copy, warm_up
from kvxfer.plan import DEFAULT_STAGING_SLOTS, CostModel, PairPlan, check_side, plan_pairs_into
from kvxfer.plan.cost import Chunking, choose_chunking
from kvxfer.plan.layout import STAGING_REGION, blocks_of_tokens
from kvxfer.plan.program import (
    CellCopy,
    TransferProgram,
    chunk_alignment,
    chunk_block_count,
    chunk_blocks,
    chunk_bounds,
    chunk_program,
    max_chunk_tokens,
    unpack_copy,
)
from kvxfer.spec import KVCacheSpec, encode_spec
from kvxfer.transport.base import Peer, Region, Transport
from kvxfer.validation import (
    check_block_ids,
    check_caches,
    check_request_id,
    check_side_channel_address,
    check_token_range,
    check_transport_endpoint,
)

log = logging.getLogger(__name__)

_TICK_S = 0.01  # the loop's longest sleep: deadlines and heartbeats are checked this often
# A producer is dead when silent for `peer_timeout_s` AND this many pings went unanswered: a
# stall of this whole process (a long call holding the GIL) then never passes for a dead peer.
_MISSED_PINGS = 3
_MAX_NOTICES = 4096  # done/abort notices kept per producer rank while it is unreachable


@dataclass(frozen=True)
class TransferResult:
    """The outcome of one fetch on one decode rank.

    Attributes:
        ok: every byte of tokens `[start_token, num_tokens)` is in place.
        failed_block_ids: destination blocks not (fully) written; recompute them. Nothing of
            this fetch lands in them any more: they are safe to reuse at once.
        bytes: bytes read into this rank.
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


class FetchHandle:
    """A fetch in progress."""

    def __init__(self, request_id: str, wake: Callable[[], None]) -> None:
        self.request_id = request_id
        self.future: Future[TransferResult] = Future()
        self.cancelled = threading.Event()
        self.chunks_done = 0
        self.chunks_total = 0
        self._wake = wake

    def done(self) -> bool:
        """Whether the fetch has finished."""
        return self.future.done()

    def wait(self, timeout: float | None = None) -> TransferResult:
        """The result; if `timeout` passes first, the fetch is abandoned and reports every
        block it had not completed as failed (nothing of it lands afterwards)."""
        try:
            return self.future.result(timeout)
        except FutureTimeout:
            self.cancel()
            return self.future.result()

    def cancel(self) -> None:
        """Abandon the fetch: it completes soon, with its unfinished blocks failed."""
        self.cancelled.set()
        self._wake()


# ---- sessions -------------------------------------------------------------------------------

SessionState = Literal["connecting", "live", "dead"]


@dataclass(eq=False)  # identity: compared and hashed as objects
class _Session:
    """This rank's session with one producer rank (one socket, one handshake)."""

    address: str
    sock: zmq.Socket
    state: SessionState = "connecting"
    client_nonce: str = ""
    server_nonce: str = ""
    deadline: float = 0.0  # of the handshake
    session: str = ""
    key: bytes = b""
    spec: KVCacheSpec | None = None
    peer: Peer | None = None  # the producer's cache regions, by layer
    # Where the plan's source region keys lie in `peer` (its layers, then a staging slot at
    # key `num_layers`): built once at the handshake, used by every read.
    src_places: dict[int, tuple[int, int]] = field(default_factory=dict)
    slot_bytes: int = 0
    last_heard: float = 0.0
    last_ping: float = 0.0
    unanswered: int = 0  # pings sent since the producer was last heard
    error: str = ""
    died_at: float = float("inf")
    lost: bool = False  # the producer forgot it (a restart): its unread chunks may ask anew
    expect: KVCacheSpec | None = None  # a reconnect must find the same producer geometry

    @property
    def rank(self) -> int:
        """The producer's engine rank (its TP rank without pipeline parallelism)."""
        assert self.spec is not None
        return self.spec.engine_rank


@dataclass
class _Pair:
    """A pair's plan for every fetch (made at `connect`, reused as is): route, strategy,
    tokens per chunk and chunks in flight."""

    plan: PairPlan
    chunk_tokens: int
    depth: int  # chunks in flight per fetch (at most `staging_slots`)

    @property
    def src_rank(self) -> int:
        return self.plan.src_rank


ChunkState = Literal[
    "queued", "asked", "ready", "reading", "confirming", "copying", "done", "failed"
]
# queued: not asked yet; asked: waiting for the producer (publish, pack); ready: readable, waiting
# for a staging slot (slots are taken only now, so requests that are never published hold none);
# reading: a read in flight into the slot; confirming: read, asking whether the source held;
# copying: staging -> cache, locally.
_ACTIVE = ("asked", "ready", "reading", "confirming", "copying")


@dataclass(eq=False)  # identity: compared and hashed as objects
class _Chunk:
    fetch: _Fetch
    pair: _Pair
    chunk_id: int
    start: int
    end: int
    state: ChunkState = "queued"
    session: _Session | None = None  # the session it was asked on
    slot: int | None = None
    read_pending: bool = False  # a read into `slot` has not settled
    ready: ChunkReady | None = None
    unpack: CellCopy | None = None
    nbytes: int = 0
    num_ops: int = 0


@dataclass(eq=False)  # identity: compared and hashed as objects
class _Fetch:
    handle: FetchHandle
    block_ids: np.ndarray
    num_tokens: int
    start: int
    deadline: float
    began: float
    pairs: list[_Pair]
    fence: Fence = None  # CUDA: the engine's stream when the fetch began (see `fetch`)
    chunks: list[_Chunk] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    # Bookkeeping that keeps every step O(1) per chunk, whatever the request's length (kept
    # by `KVConsumer._set_state`): chunks not asked yet by producer rank, in token order;
    # active chunks by producer rank; ready chunks waiting for a staging slot; chunks neither
    # done nor failed.
    queued: dict[int, deque[_Chunk]] = field(default_factory=dict)
    active: dict[int, int] = field(default_factory=dict)
    waiting: list[_Chunk] = field(default_factory=list)
    unsettled: int = 0

    @property
    def request_id(self) -> str:
        return self.handle.request_id


class KVConsumer:
    """Fetches KV into one decode rank's cache from the ranks of a prefill engine.

    Args:
        spec: this rank's geometry.
        caches: this rank's layer tensors.
        engine_id: the decode engine's id.
        host: address of this rank's transport (127.0.0.1 by default).
        secret: the producers' shared secret (proved, never sent).
        transport: a transport to share (default: an own `MooncakeTransport` on `host`,
            `protocol`, closed with this object; a shared one is left open).
        protocol: "tcp" or "rdma" for the default transport.
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
        heartbeat_s: how often each producer is pinged.
        peer_timeout_s: a producer silent this long is dead: its chunks fail at once.
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
        transport: Transport | None = None,
        protocol: str = "tcp",
        staging_bytes: int = 32 << 20,
        staging_slots: int = DEFAULT_STAGING_SLOTS,
        cost_model: CostModel | None = None,
        strategy: str | None = None,
        chunk_tokens: int | None = None,
        backend: str = "auto",
        timeout_s: float = 30.0,
        heartbeat_s: float = 0.5,
        peer_timeout_s: float = 2.0,
        copy_workers: int = 2,
    ) -> None:
        check_caches(spec, caches, "consumer")
        StagingPool.slot_size(staging_bytes, staging_slots)  # refuse a bad pool now
        if chunk_tokens is not None and (
            isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1
        ):
            raise ValueError(f"chunk_tokens: must be an integer >= 1 or None, got {chunk_tokens!r}")
        self._chunk_tokens = chunk_tokens
        self.spec = spec
        self.caches = list(caches)
        self.engine_id = engine_id
        self._secret = secret or ""
        self._staging_bytes, self._staging_slots = staging_bytes, staging_slots
        self._cost_model, self._strategy = cost_model, strategy
        self._backend = resolve_backend(backend, caches[0].device)
        self._timeout_s = timeout_s
        self._heartbeat_s, self._peer_timeout_s = heartbeat_s, peer_timeout_s
        # Nothing but this rank's staging pools is registered: reads land only there (the
        # caches are written by local copies), so no peer can address the cache at all.
        self._registration = CacheRegistration([], transport, host, protocol)
        self.transport = self._registration.transport
        self.stats = TransferStats()
        self._ctx = zmq.Context()
        self._sessions: dict[int, _Session] = {}  # by producer rank once known
        self._open: dict[zmq.Socket, _Session] = {}  # every session not dead, by socket
        self._connects: list[tuple[list[_Session], Future[list[PairPlan]]]] = []
        self._quarantine: set[_Chunk] = set()  # failed chunks whose reads have not settled
        self._notices: dict[int, list[Callable[[str], Message]]] = {}  # for dead sessions
        self._chunk_ids = itertools.count()
        self._chunks: dict[int, _Chunk] = {}  # chunks not done or failed, by chunk id
        self._pairs: list[_Pair] = []
        self._pools: dict[int, StagingPool] = {}  # by producer rank, kept across sessions
        self._fetches: list[_Fetch] = []
        self._events: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._copies = ThreadPoolExecutor(copy_workers, thread_name_prefix="kvxfer-copy")
        self._copy_stream = copy_stream_for(caches[0].device)
        self._closed = False
        self._polled_at = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvxfer-consumer", daemon=True)
        self._thread.start()

    # ---- public API (any thread) ---------------------------------------------------------

    def connect(self, producer_addresses: Sequence[str], timeout: float = 10.0) -> list[PairPlan]:
        """Shake hands with every producer rank of one prefill engine; plan every pair.

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
        self._post(lambda: self._start_connect(addresses, timeout, done))
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

        self._post(replan)
        return done.result()

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
        handle = FetchHandle(request_id, self._wake)
        budget = self._timeout_s if timeout is None else timeout
        now = time.monotonic()
        fetch = _Fetch(handle, ids, num_tokens, start_token, now + budget, now, [])
        fetch.fence = self._copy_stream.fence()
        self._post(lambda: self._start_fetch(fetch))
        return handle

    def abort(self, request_id: str) -> None:
        """Tell every producer that this engine will never load the request (they free its
        blocks at once), and abandon a fetch of it running here."""
        self._check_open("abort")
        request_id = check_request_id(request_id, "abort")
        self._post(lambda: self._abort(request_id))

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
        sessions = list(self._sessions.values())
        return {
            "sessions": sum(s.state == "live" for s in sessions),
            "dead_sessions": sum(s.state == "dead" for s in sessions),
            "fetches": len(self._fetches),
            "quarantined_slots": len(self._quarantine),
            "transport": getattr(self.transport, "protocol", type(self.transport).__name__),
            "threads": 2 + len(getattr(self._copies, "_threads", ())),
        }

    def close(self) -> None:
        """Fail every running fetch (its unfinished blocks listed), close the sessions and
        unregister memory. Returns without waiting for peers."""
        if self._closed:
            return
        self._closed = True
        self._post(self._shutdown)
        self._thread.join()
        self._copies.shutdown(wait=True)
        self._registration.close()  # ends the engine when it is ours: no read is left
        for pool in self._pools.values():
            pool.close()
        self._ctx.term()
        wake_r, wake_w = self._wake_r, self._wake_w
        self._wake_w = -1  # callbacks that still come must not write to a reused descriptor
        os.close(wake_r)
        os.close(wake_w)

    def __enter__(self) -> KVConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"{what}: the consumer is closed; create a new KVConsumer")

    def _post(self, event: Callable[[], None]) -> None:
        self._events.put(event)
        self._wake()

    def _wake(self) -> None:
        fd = self._wake_w
        if fd < 0:
            return  # closed
        with contextlib.suppress(BlockingIOError):  # a full pipe wakes the loop anyway
            os.write(fd, b"x")

    # ---- the loop (one thread owns every socket and every state machine) -------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        registered: set[zmq.Socket] = set()
        while not self._stop.is_set():
            sockets = set(self._open)
            for sock in registered - sockets:
                poller.unregister(sock)
            for sock in sockets - registered:
                poller.register(sock, zmq.POLLIN)
            registered = sockets
            for sock_or_fd, _ in poller.poll(int(_TICK_S * 1000)):
                if sock_or_fd == self._wake_r:
                    os.read(self._wake_r, 4096)
                else:
                    self._drain(sock_or_fd)
            # Whatever a peer sent before now has been read: silence is measured from here, so
            # a loop that was busy (a plan, a compile) does not take live peers for dead.
            self._polled_at = time.monotonic()
            self._guarded(self._handle_events)
            self._guarded(self._tick)

    def _guarded(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:  # a bug must not stop every other fetch: log it, go on
            log.exception("consumer %s: internal error", self.engine_id)

    def _handle_events(self) -> None:
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return
            event()

    def _drain(self, sock: zmq.Socket) -> None:
        session = self._open.get(sock)
        while session is not None and session.state != "dead":
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._on_frames(session, frames)
            except ProtocolError as exc:
                self._session_failed(session, f"unreadable answer: {exc}")
                return

    def _tick(self) -> None:
        now = time.monotonic()
        for pending, done in list(self._connects):
            self._await_sessions(pending, done)
        for session in list(self._open.values()):
            if session.state == "connecting" and now > session.deadline:
                self._session_failed(session, "did not answer the handshake in time")
            elif session.state == "live":
                silent = self._polled_at - session.last_heard
                if silent > self._peer_timeout_s and session.unanswered >= _MISSED_PINGS:
                    self._session_failed(session, f"silent for {silent:.1f} s: presumed dead")
                elif now - session.last_ping >= self._heartbeat_s:
                    session.last_ping = now
                    session.unanswered += 1
                    self._send(session, Ping(session=session.session))
        for fetch in list(self._fetches):
            if fetch.handle.cancelled.is_set() or now >= fetch.deadline:
                why = "cancelled" if fetch.handle.cancelled.is_set() else "timed out"
                self._abandon(fetch, f"fetch {why}")
            else:
                self._send_ready(fetch)
            self._finish_if_done(fetch)

    # ---- handshakes ---------------------------------------------------------------------

    def _start_connect(self, addresses: list[str], timeout: float, done: Future) -> None:
        for session in list(self._sessions.values()):
            self._session_failed(session, "was replaced by connect()")
        self._sessions, self._pairs = {}, []
        pending = [self._open_session(address, timeout) for address in addresses]
        self._connects.append((pending, done))

    def _open_session(
        self, address: str, timeout: float, expect: KVCacheSpec | None = None
    ) -> _Session:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        session = _Session(address, sock, deadline=time.monotonic() + timeout, expect=expect)
        session.client_nonce = auth.new_nonce()
        sock.send(encode(Hello(engine_id=self.engine_id, nonce=session.client_nonce)))
        self._open[sock] = session
        return session

    def _await_sessions(self, pending: list[_Session], done: Future) -> None:
        """Finish `connect` once every session is live, or one failed (then none stays)."""
        if any(s.state == "connecting" for s in pending) and not any(
            s.state == "dead" for s in pending
        ):
            return
        self._connects = [c for c in self._connects if c[1] is not done]
        try:
            failed = next((s for s in pending if s.state == "dead"), None)
            if failed is not None:
                raise ConnectionError(f"producer {failed.address} {failed.error}")
            self._sessions = {s.rank: s for s in pending}
            if len(self._sessions) != len(pending):
                raise ValueError("connect: two addresses lead to the same producer rank")
            self._pairs = self._plan(self._cost_model, self._strategy)
        except Exception as exc:
            for session in pending:
                self._session_failed(session, "connect failed")
            self._sessions, self._pairs = {}, []
            done.set_exception(exc)
            return
        done.set_result([p.plan for p in self._pairs])

    def _on_frames(self, session: _Session, frames: list[bytes]) -> None:
        if not 1 <= len(frames) <= 2:
            raise ProtocolError(f"expected a frame and its MAC, got {len(frames)} frames")
        message = decode(frames[0])
        session.last_heard, session.unanswered = time.monotonic(), 0
        if isinstance(message, Challenge) and session.state == "connecting":
            self._on_challenge(session, message)
        elif isinstance(message, HandshakeReply) and session.state == "connecting":
            self._on_handshake_reply(session, message)
        elif isinstance(message, ErrorReply):
            if message.session_lost and session.state == "live":
                self._requeue_unread(session)
            self._session_failed(session, f"refused: {message.reason}")
        elif session.state == "live":
            if len(frames) != 2 or not auth.verify(session.key, frames[0], frames[1]):
                raise ProtocolError("an answer without a valid MAC was refused")
            self._on_session_message(session, message)

    def _on_challenge(self, session: _Session, challenge: Challenge) -> None:
        session.server_nonce = challenge.nonce
        proof = auth.proof(
            self._secret,
            "consumer",
            session.client_nonce,
            session.server_nonce,
            self.engine_id,
            encode_spec(self.spec),
        )
        hello = Handshake(
            engine_id=self.engine_id,
            spec=self.spec,
            client_nonce=session.client_nonce,
            server_nonce=session.server_nonce,
            proof=proof,
        )
        session.sock.send(encode(hello))

    def _on_handshake_reply(self, session: _Session, reply: HandshakeReply) -> None:
        expected = auth.proof(
            self._secret, "producer", session.client_nonce, session.server_nonce, reply.session
        )
        if not auth.proof_matches(expected, reply.proof):
            self._session_failed(
                session, "could not prove the shared secret: set the same secret on both sides"
            )
            return
        try:
            endpoint = check_transport_endpoint(reply.endpoint)
            if len(reply.cache_regions) != reply.spec.num_layers or any(
                r.nbytes < reply.spec.layer_extent_bytes for r in reply.cache_regions
            ):
                raise ValueError("its advertised regions do not cover its cache")
        except ValueError as exc:
            self._session_failed(session, f"sent a bad handshake: {exc}")
            return
        session.session, session.spec = reply.session, reply.spec
        session.key = auth.session_key(
            self._secret, session.client_nonce, session.server_nonce, reply.session
        )
        regions = {
            layer: Region(layer, r.address, r.nbytes) for layer, r in enumerate(reply.cache_regions)
        }
        session.peer = Peer(endpoint, regions)
        staging_key = reply.spec.num_layers  # after the producer's layer regions
        session.src_places = {layer: (layer, 0) for layer in range(staging_key)}
        session.src_places[STAGING_REGION] = (staging_key, 0)
        session.slot_bytes = reply.staging_slot_bytes
        if session.expect is not None and session.expect != reply.spec:
            self._session_failed(
                session,
                "came back with another geometry; call connect() again to plan the new engine",
            )
            return
        session.state, session.last_ping = "live", time.monotonic()
        for notice in self._notices.pop(session.rank, []):
            self._send(session, notice(session.session))

    def _session_failed(self, session: _Session, why: str) -> None:
        """The session is over: fail every chunk that relied on it."""
        if session.state == "dead":
            return
        session.state, session.error, session.died_at = "dead", why, time.monotonic()
        self._open.pop(session.sock, None)
        log.warning("consumer %s: producer %s %s", self.engine_id, session.address, why)
        for fetch in list(self._fetches):
            for chunk in fetch.chunks:
                if chunk.session is session:
                    self._fail_chunk(chunk, f"producer {session.address} {why}")
        session.sock.close(linger=0)

    def _requeue_unread(self, session: _Session) -> None:
        """The producer forgot the session (it restarted faster than a heartbeat notices):
        chunks it had not served yet ask again on a new session; nothing of them was read."""
        session.lost = True
        for fetch in self._fetches:
            for chunk in fetch.chunks:
                if chunk.session is session and chunk.state in ("asked", "ready"):
                    chunk.session, chunk.ready = None, None
                    self._set_state(chunk, "queued")

    def _session_for(self, rank: int, fetch: _Fetch) -> _Session | str | None:
        """The live session with producer `rank`; None while one is being opened; or why the
        chunk cannot be served (the producer died, or a new handshake failed, during this
        fetch). A session that died before the fetch began is opened again."""
        session = self._sessions.get(rank)
        if session is None:
            return "is not connected"
        if session.state == "dead":
            if session.died_at >= fetch.began and not session.lost:
                return f"producer {session.address} {session.error}"
            self._reconnect(rank)  # shake hands again, as briefly as a peer may stay silent
            return None
        return session if session.state == "live" else None

    # ---- planning -----------------------------------------------------------------------

    def _plan(self, cost_model: CostModel | None, strategy: str | None) -> list[_Pair]:
        specs = check_side([s.spec for s in self._sessions.values() if s.spec], "producers")
        # This rank's pairs only: it knows its own layers, not the other decode stages'.
        plans = plan_pairs_into(
            specs, self.spec, cost_model=cost_model, strategy=strategy, landing=True
        )
        model = cost_model or CostModel()
        pairs = []
        for plan in plans:
            producer = specs[plan.src_rank]
            plan, chunking = self._fitting(plan, producer, strategy is not None, model)
            pairs.append(_Pair(plan, chunking.tokens, chunking.depth))
            unpack = unpack_copy(
                plan.strategy,
                plan.route,
                producer,
                self.spec,
                np.zeros(1, np.int64),
                0,
                1,
                landing=True,
            )
            if unpack is not None:  # compile now, not on the first request
                dtype, device = self.caches[0].dtype, self.caches[0].device
                compile_unpack = functools.partial(warm_up, unpack, dtype, device, self._backend)
                self._copy_stream.launch(compile_unpack).wait()  # on the side stream's device
        return pairs

    def _fitting(
        self, plan: PairPlan, producer: KVCacheSpec, forced: bool, model: CostModel
    ) -> tuple[PairPlan, Chunking]:
        """The plan (the cheapest strategy whose chunks fit both sides' slots, and the forced
        `chunk_tokens` if any, unless a strategy is forced) and its chunking: the forced
        tokens per chunk, or the cost model's choice within a slot.

        Raises:
            ValueError: no strategy, or not the forced one, fits one token (or the forced
                `chunk_tokens`) in a slot.
        """
        slot_bytes = (
            self._sessions[plan.src_rank].slot_bytes,
            self._pool(plan.src_rank).slot_bytes,
        )
        order = [plan.chosen] if forced else sorted(plan.estimates, key=lambda e: e.seconds)
        want = self._chunk_tokens
        refusals = []
        for estimate in order:
            cap = max_chunk_tokens(
                estimate.strategy, plan.route, producer, self.spec, *slot_bytes, landing=True
            )
            if cap is None or cap < 1:
                refusals.append(f"{estimate.strategy}: a slot cannot hold one token")
                continue
            if want is not None:
                unit = chunk_alignment(estimate.strategy, producer, self.spec, landing=True)
                if want > cap or want % unit:
                    refusals.append(
                        f"{estimate.strategy}: chunks of at most {cap} tokens, in multiples "
                        f"of {unit}"
                    )
                    continue
            chosen = dataclasses.replace(plan, strategy=estimate.strategy)
            chunking = choose_chunking(
                chosen.strategy,
                plan.route,
                producer,
                self.spec,
                model,
                cap,
                self._staging_slots,
                tokens=want,
            )
            return chosen, chunking
        which = "strategy " + plan.strategy if forced else "any strategy"
        if want is None:
            raise ValueError(
                f"staging_bytes: a slot cannot hold one token of pair {plan.src_rank}->"
                f"{plan.dst_rank} ({which}); raise staging_bytes on both sides"
            )
        raise ValueError(
            f"chunk_tokens: {want} tokens fit no staging slot of pair {plan.src_rank}->"
            f"{plan.dst_rank} with {which} ({'; '.join(refusals)}); choose a fitting size, "
            "raise staging_bytes on both sides, or leave chunk_tokens to the cost model"
        )

    def _pool(self, rank: int) -> StagingPool:
        if rank not in self._pools:
            self._pools[rank] = StagingPool(
                self.transport, self._staging_bytes, self._staging_slots, self.caches[0].device
            )
        return self._pools[rank]

    # ---- fetches ------------------------------------------------------------------------

    def _start_fetch(self, fetch: _Fetch) -> None:
        fetch.pairs = list(self._pairs)
        for pair in fetch.pairs:
            # Chunk ids are unique in this consumer's life, so a late answer meant for an
            # earlier fetch of the same request can never pass for one of this fetch.
            chunks = [
                _Chunk(fetch, pair, next(self._chunk_ids), lo, hi)
                for lo, hi in chunk_bounds(fetch.start, fetch.num_tokens, pair.chunk_tokens)
            ]
            fetch.chunks.extend(chunks)
            fetch.queued[pair.src_rank] = deque(chunks)
            fetch.active[pair.src_rank] = 0
            self._chunks.update((c.chunk_id, c) for c in chunks)
        fetch.unsettled = len(fetch.chunks)
        fetch.handle.chunks_total = len(fetch.chunks)
        self._fetches.append(fetch)
        self._send_ready(fetch)
        self._finish_if_done(fetch)

    def _set_state(self, chunk: _Chunk, state: ChunkState) -> None:
        """Move a chunk to `state`, keeping its fetch's counts and queues (O(1))."""
        was, fetch, rank = chunk.state, chunk.fetch, chunk.pair.src_rank
        if was == state:
            return
        chunk.state = state
        fetch.active[rank] += (state in _ACTIVE) - (was in _ACTIVE)
        if state in ("done", "failed"):
            fetch.unsettled -= 1
            self._chunks.pop(chunk.chunk_id, None)
        elif state == "queued":  # asked again (rare: the producer forgot the session)
            queue = fetch.queued[rank]
            queue.append(chunk)
            if len(queue) > 1 and queue[-2].chunk_id > chunk.chunk_id:
                fetch.queued[rank] = deque(sorted(queue, key=lambda c: c.chunk_id))

    def _send_ready(self, fetch: _Fetch) -> None:
        """Ask for queued chunks, at most the pair's depth (`staging_slots` at most) at a time
        per producer rank, and start the reads of ready chunks once a slot is free. O(chunks
        it moves on), never O(the fetch's chunks)."""
        if fetch.waiting:
            waiting, fetch.waiting = fetch.waiting, []
            for chunk in waiting:
                if chunk.state == "ready" and chunk.slot is None:
                    self._start_read(chunk)
        for pair in fetch.pairs:
            rank = pair.src_rank
            queue = fetch.queued[rank]
            while queue and fetch.active[rank] < pair.depth:
                chunk = queue[0]
                if chunk.state != "queued":  # failed while it waited
                    queue.popleft()
                    continue
                session = self._session_for(rank, fetch)
                if isinstance(session, str):
                    queue.popleft()
                    self._fail_chunk(chunk, session)
                    continue
                if session is None:
                    break  # shaking hands again
                queue.popleft()
                chunk.session = session
                self._set_state(chunk, "asked")
                self._send(
                    session,
                    TransferRequest(
                        session=session.session,
                        request_id=fetch.request_id,
                        chunk_id=chunk.chunk_id,
                        num_tokens=fetch.num_tokens,
                        token_start=chunk.start,
                        token_end=chunk.end,
                        strategy=pair.plan.strategy,
                        wait_seconds=max(0.0, fetch.deadline - time.monotonic()),
                    ),
                )

    def _send(self, session: _Session, message: Message) -> None:
        frame = encode(message)
        try:
            session.sock.send_multipart([frame, auth.sign(session.key, frame)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self._session_failed(session, f"cannot be sent to: {exc}")

    def _on_session_message(self, session: _Session, message: Message) -> None:
        if isinstance(message, Pong):
            return
        if not isinstance(message, ChunkReady | ChunkValid | ChunkFailed):
            return
        chunk = self._chunk(session, message.request_id, message.chunk_id)
        if chunk is None:
            return  # a chunk given up on: its answer is too late
        if isinstance(message, ChunkFailed):
            self._fail_chunk(chunk, f"producer rank {session.rank}: {message.reason}")
        elif isinstance(message, ChunkReady) and chunk.state == "asked":
            chunk.ready = message
            self._set_state(chunk, "ready")
            self._start_read(chunk)
        elif isinstance(message, ChunkValid) and chunk.state == "confirming":
            if message.ok:
                self._start_copy(chunk)
            else:
                self._fail_chunk(chunk, f"producer rank {session.rank}: {message.reason}")

    def _chunk(self, session: _Session, request_id: str, chunk_id: int) -> _Chunk | None:
        """The live chunk an answer is for: asked on this session, of this request."""
        chunk = self._chunks.get(chunk_id)
        if chunk is None or chunk.session is not session or chunk.fetch.request_id != request_id:
            return None
        return chunk

    def _read_program(
        self, chunk: _Chunk, session: _Session, ready: ChunkReady
    ) -> tuple[TransferProgram, Peer]:
        """The chunk's program from the chunk's blocks alone (O(its tokens)), and the producer
        memory its read may touch: its staging slot for strategies that pack, else its cache
        blocks, checked to be the chunk's and inside its cache.

        Raises:
            ValueError: the producer's answer does not fit the chunk or its strategy.
        """
        spec, plan, peer = session.spec, chunk.pair.plan, session.peer
        assert spec is not None and peer is not None
        lo, hi = chunk.start, chunk.end
        staged = plan.strategy in ("pack", "pack+unpack")
        if staged != (ready.staging is not None):
            where = "its staging" if ready.staging is not None else "its cache"
            raise ValueError(f"it offered {where} for a chunk of strategy {plan.strategy}")
        if ready.staging is not None:
            # The source is the producer's slot: its block ids play no part in the read.
            src_ids = np.zeros(chunk_block_count(spec.block_size, lo, hi), np.int64)
            key = spec.num_layers
            regions: Mapping[int, Region] = {
                key: Region(key, ready.staging.address, ready.staging.nbytes)
            }
        else:
            src_ids = _chunk_source_blocks(spec, ready.src_block_ids, lo, hi)
            regions = peer.regions
        dst_ids = chunk_blocks(chunk.fetch.block_ids, self.spec.block_size, lo, hi)
        program = chunk_program(
            plan.route, plan.strategy, spec, self.spec, src_ids, dst_ids, lo, hi, landing=True
        )
        return program, Peer(peer.endpoint, regions)

    def _start_read(self, chunk: _Chunk) -> None:
        """Read a ready chunk into a staging slot, if one is free (else it waits, ready)."""
        pair, session, ready = chunk.pair, chunk.session, chunk.ready
        assert session is not None and session.spec is not None and session.peer is not None
        assert ready is not None
        pool = self._pools[pair.src_rank]
        chunk.slot = pool.try_acquire()
        if chunk.slot is None:
            chunk.fetch.waiting.append(chunk)
            return  # every slot is busy reading or copying: soon one is free
        try:
            program, peer = self._read_program(chunk, session, ready)
            dst_places = {STAGING_REGION: (pool.region.region_id, pool.offset(chunk.slot))}
            segments = program.segments.with_regions(session.src_places, dst_places)
            future = self.transport.read(segments, peer)
        except Exception as exc:
            self._fail_chunk(chunk, f"cannot read from producer rank {session.rank}: {exc}")
            return
        chunk.unpack = program.unpack
        chunk.nbytes, chunk.num_ops = segments.nbytes, len(segments)
        chunk.read_pending = True
        self._set_state(chunk, "reading")

        # The callback keeps the pool alive while the read may still land in it.
        def settled(done: Future[None], pool: StagingPool = pool) -> None:
            self._post(lambda: self._on_read_settled(chunk, done, pool))

        future.add_done_callback(settled)

    def _on_read_settled(self, chunk: _Chunk, future: Future[None], pool: StagingPool) -> None:
        chunk.read_pending = False
        error = future.exception()
        if chunk.state != "reading":  # given up on while reading: the quarantine ends now
            self._quarantine.discard(chunk)
            self._release_slot(chunk)
            return
        if error is not None:
            self._fail_chunk(chunk, f"read failed: {error}")
            return
        session = chunk.session
        if session is None or session.state != "live":
            self._fail_chunk(chunk, "the producer's session ended before the read was confirmed")
            return
        assert chunk.ready is not None
        self._set_state(chunk, "confirming")
        self._send(
            session,
            ChunkRead(
                session=session.session,
                request_id=chunk.fetch.request_id,
                chunk_id=chunk.chunk_id,
                generation=chunk.ready.generation,
                staged=chunk.ready.staging is not None,
            ),
        )

    def _start_copy(self, chunk: _Chunk) -> None:
        self._set_state(chunk, "copying")
        copy, slot, pool = chunk.unpack, chunk.slot, self._pools[chunk.pair.src_rank]
        assert copy is not None and slot is not None
        layers = copy.num_layers or len(self.caches)  # the route's layers
        elements = layers * copy.src.geometry.layer_elements
        staging = pool.slot_tensor(slot, self.caches[0].dtype)[:elements]
        run = functools.partial(run_cell_copy, copy, [staging], self.caches, self._backend)
        future = self._copies.submit(self._copy_into_cache, run, chunk.fetch.fence)
        future.add_done_callback(lambda f: self._post(lambda: self._on_copied(chunk, f)))

    def _copy_into_cache(self, run: Callable[[], None], fence: Fence) -> None:
        """(a copy thread) Run one chunk's copy from staging into the cache and return once it
        has finished: only then is its slot read into again and its blocks reported."""
        self._copy_stream.launch(run, fence).wait()  # this copy's own event, on CUDA

    def _on_copied(self, chunk: _Chunk, future: Future[None]) -> None:
        error = future.exception()
        if error is not None:
            self._set_state(chunk, "confirming")  # the copy is over: failing it is allowed
            self._fail_chunk(chunk, f"copy into the cache failed: {error}")
            return
        self._set_state(chunk, "done")
        self._release_slot(chunk)
        chunk.fetch.handle.chunks_done += 1
        self._finish_if_done(chunk.fetch)

    def _fail_chunk(self, chunk: _Chunk, why: str) -> None:
        if chunk.state in ("done", "failed"):
            return
        if chunk.state == "copying":  # a local copy finishes by itself, soon
            return
        self._set_state(chunk, "failed")
        chunk.fetch.errors.append(f"tokens [{chunk.start}, {chunk.end}): {why}")
        if chunk.read_pending:  # the slot stays out of use until the read settles
            self._quarantine.add(chunk)
        else:
            self._release_slot(chunk)
        self._finish_if_done(chunk.fetch)

    def _release_slot(self, chunk: _Chunk) -> None:
        if chunk.slot is not None:
            self._pools[chunk.pair.src_rank].release(chunk.slot)
            chunk.slot = None

    def _abandon(self, fetch: _Fetch, why: str) -> None:
        for chunk in fetch.chunks:
            self._fail_chunk(chunk, why)

    def _abort(self, request_id: str) -> None:
        for fetch in self._fetches:
            if fetch.request_id == request_id:
                self._abandon(fetch, "aborted")
        for rank in list(self._sessions):
            self._notify(rank, lambda sid: Abort(session=sid, request_id=request_id))

    def _notify(self, rank: int, message: Callable[[str], Message]) -> None:
        """Send a notice (done, abort) to producer `rank` now, or once a session with it is
        live again: a producer that was silent for a while still frees its blocks early."""
        session = self._sessions.get(rank)
        if session is not None and session.state == "live":
            self._send(session, message(session.session))
            return
        queue = self._notices.setdefault(rank, [])
        queue.append(message)
        del queue[:-_MAX_NOTICES]
        self._reconnect(rank)

    def _reconnect(self, rank: int) -> None:
        """Shake hands again with producer `rank` if its session died (at most once a
        `peer_timeout_s`: a producer that stays away is not flooded)."""
        session = self._sessions.get(rank)
        if session is None or session.state != "dead":
            return
        if time.monotonic() - session.died_at < self._peer_timeout_s and session.session == "":
            return  # the last attempt failed a moment ago
        fresh = self._open_session(session.address, self._peer_timeout_s, session.spec)
        fresh.spec = session.spec
        self._sessions[rank] = fresh

    def _finish_if_done(self, fetch: _Fetch) -> None:
        if fetch.handle.done() or fetch.unsettled:
            return
        self._fetches.remove(fetch)
        failed = [c for c in fetch.chunks if c.state == "failed"]
        for rank in list(self._sessions):
            self._notify(rank, functools.partial(_done_notice, fetch.request_id, not failed))
        failed_ids = sorted(
            {
                block
                for chunk in failed
                for block in blocks_of_tokens(
                    fetch.block_ids, self.spec.block_size, chunk.start, chunk.end
                )
            }
        )
        result = TransferResult(
            ok=not failed,
            failed_block_ids=failed_ids,
            bytes=sum(c.nbytes for c in fetch.chunks if c.state == "done"),
            num_ops=sum(c.num_ops for c in fetch.chunks if c.state == "done"),
            strategy=",".join(sorted({p.plan.strategy for p in fetch.pairs})),
            seconds=time.monotonic() - fetch.began,
            errors=fetch.errors,
        )
        if not result.ok:
            log.warning(
                "fetch %s failed, %d blocks to recompute: %s",
                fetch.request_id,
                len(failed_ids),
                "; ".join(fetch.errors[:3]),
            )
        self.stats.record(
            TransferRecord(
                fetch.request_id,
                result.seconds,
                result.bytes,
                result.num_ops,
                result.strategy,
                result.ok,
            )
        )
        fetch.handle.future.set_result(result)

    def _shutdown(self) -> None:
        for fetch in list(self._fetches):
            self._abandon(fetch, "the consumer closed")
        # Local copies in flight finish by themselves; wait for them so that close() returns
        # only when nothing more will touch the cache.
        while any(c.state == "copying" for f in self._fetches for c in f.chunks):
            self._handle_events()
            time.sleep(0.001)
        for session in list(self._open.values()):
            session.state = "dead"
            session.sock.close(linger=0)
        self._open.clear()
        for _, done in self._connects:
            done.set_exception(ConnectionError("connect: the consumer closed"))
        self._stop.set()


def _done_notice(request_id: str, ok: bool, session: str) -> Message:
    return RequestDone(session=session, request_id=request_id, ok=ok)


def _chunk_source_blocks(
    spec: KVCacheSpec, block_ids: Sequence[int], token_start: int, token_end: int
) -> np.ndarray:
    """A producer's block ids for the tokens of one chunk, checked (O(the chunk)): one per
    block the chunk touches, each inside its cache, none twice.

    Raises:
        ValueError: another count, an id out of range or repeated.
    """
    expected = chunk_block_count(spec.block_size, token_start, token_end)
    if len(block_ids) != expected:
        raise ValueError(
            f"it sent {len(block_ids)} block ids for tokens [{token_start}, {token_end}); "
            f"blocks of {spec.block_size} tokens need {expected}"
        )
    ids = np.asarray(block_ids, dtype=np.int64)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= spec.num_blocks):
        raise ValueError(f"it sent a block id outside its {spec.num_blocks} blocks")
    if np.unique(ids).size != ids.size:
        raise ValueError("it sent a block id twice for one chunk")
    return ids
