"""`KVProducer`: a prefill rank that serves its requests' KV to decode ranks.

Pull, on request: a consumer rank asks for a chunk of a request (a token range and a
strategy); once the request is published the producer packs it into its staging if the strategy
packs, and answers where to read it. The consumer reads the bytes into its own staging with
Mooncake, makes sure the source was held all along (a packed chunk's staging range is held for
a time the consumer measures from before its ask; a chunk read from the cache is confirmed by
one more round trip), and only then copies them into its cache.
The producer never writes into a consumer's memory: a peer cannot make it touch memory other
than its own, and no write of it can land late (docs/connectors.md, "No late bytes").

Three parts, each with one job:
- the side-channel server (`SideChannelServer`): sockets and framing, one thread that never
  blocks;
- the request table (`RequestTable`): publish, fetchers, reports, expiry, one release each;
- a session per consumer rank: authentication, its staging pool, its pack leases and its own
  worker thread, so a slow, frozen or hostile peer costs only its own requests.

A session's worker packs one chunk after another into its pool's slots (`staging_slots` of
them), while its consumer reads earlier chunks: the pack of chunk i+1 runs during the read of
chunk i. On CUDA the packs run on the producer's side stream (`kvxfer.connector.streams`),
after the publish's fence, and the worker waits for each pack's own event before answering.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from kvxfer.connector.messages import (
    KV_SERVICE,
    Abort,
    ChunkFailed,
    ChunkRead,
    ChunkReady,
    ChunkValid,
    KVClaim,
    KVTerms,
    Message,
    Ping,
    Pong,
    ProtocolError,
    RegionInfo,
    RequestsDone,
    StagingRead,
    TransferRequest,
    decode,
    decode_terms,
    encode,
)
from kvxfer.connector.registration import CacheRegistration
from kvxfer.connector.requests import PublishedRequest, RequestTable
from kvxfer.connector.sidechannel import SideChannelServer
from kvxfer.connector.staging import StagingPool
from kvxfer.connector.streams import Fence, copies_inline, copy_stream_for
from kvxfer.connector.turns import TickGaps
from kvxfer.execute import resolve_backend, run_cell_copy, warm_up
from kvxfer.plan import DEFAULT_STAGING_SLOTS, HeadRoute, check_pairable, route_pair
from kvxfer.plan.program import (
    CellCopy,
    check_strategy,
    chunk_blocks,
    chunk_pack_copy,
    program_shape,
)
from kvxfer.session.protocol import Claim, Reply, SessionServer, refusal
from kvxfer.spec import KVCacheSpec
from kvxfer.transport.base import Transport
from kvxfer.validation import (
    check_block_ids,
    check_caches,
    check_num_tokens,
    check_published_table,
    check_request_id,
    covered_tokens,
)

log = logging.getLogger(__name__)

_MAX_WAITING_PER_SESSION = 4096  # chunks waiting for their request to be published
# With no published request, held chunk or lease, the side channel's tick checks only
# handshakes and sessions' silence (120 s): ten times a second is enough.
_IDLE_TICK_S = 0.1
_MAX_FINISHED_PER_SESSION = 1024  # recent ids a session said it is done with


@dataclass
class _Lease:
    """A staging range holding a packed chunk until its consumer has read it: untouched until
    `expires` (the hold its `ChunkReady` promised) unless that consumer gives it back first."""

    slot: int
    expires: float


@dataclass
class _Waiting:
    ask: TransferRequest
    received: float  # when the ask arrived: a packed chunk's hold is counted from here
    deadline: float


@dataclass(frozen=True)
class _PackJob:
    """A chunk to pack into staging and offer: its ask, the answer made for it (without its
    staging range yet), the pack, and when the ask arrived (the hold is counted from there)."""

    ask: TransferRequest
    ready: ChunkReady
    pack: CellCopy
    received: float


@dataclass(eq=False)  # identity: compared and hashed as objects
class _Session:
    """What this producer keeps of a consumer rank that completed the handshake (its key,
    address and last frame are the session layer's `ServerSession`, found by `id`)."""

    id: str
    engine_id: str
    spec: KVCacheSpec
    route: HeadRoute | None  # the layers and heads this producer serves that rank, if any
    worker: ThreadPoolExecutor
    pool: StagingPool | None = None
    leases: dict[tuple[str, int], _Lease] = field(default_factory=dict)
    waiting: list[_Waiting] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    ended: bool = False
    finished: OrderedDict[str, None] = field(default_factory=OrderedDict)  # done/aborted ids

    @property
    def rank(self) -> int:
        """The consumer's engine rank (its TP rank without pipeline parallelism)."""
        return self.spec.engine_rank


class KVProducer:
    """Serves one prefill rank's KV cache to decode ranks.

    Args:
        spec: this rank's geometry.
        caches: this rank's layer tensors (the layout contract's shapes).
        engine_id: the prefill engine's id.
        host: address to bind the side channel and the transport to (127.0.0.1 by default).
        port: side-channel port (0: any free port; see `address`).
        release: called with a request id once every decode rank that fetched it is done, when
            its decode engine aborts it, at its deadline, or at `close`: exactly once per
            published request. It runs on the side-channel thread: it must not block.
        secret: a shared secret; consumers must prove they hold it (challenge-response, never
            sent) and every session frame is signed with a key derived from it.
        transport: a transport to share (default: an own `MooncakeTransport` on `host`,
            `protocol`, closed with this object; a shared one is left open).
        protocol: "tcp" or "rdma" for the default transport.
        staging_bytes: staging pool per consumer rank that asks for packed chunks, in bytes.
        staging_slots: slots in each pool: packed chunks awaiting their read per consumer, so
            how far this rank's packs may run ahead of a consumer's reads (1: each chunk is
            packed only once the previous one was read).
        request_timeout_s: default deadline of a published request, counted while this
            producer's side channel was run (a process the machine did not run for a while
            does not drop what a decode engine still fetches the moment it runs again).
        session_timeout_s: a consumer session silent this long, counted while this producer's
            side channel was run, is dropped (its pool is reused once the holds of the chunks
            packed for it end: it may be frozen, not dead); consumers ping every `heartbeat_s`
            (0.5 s by default). Dropping a session only reclaims its pool: the chunks it leased
            are freed at their holds' end whatever this is, so it is long by default. A
            consumer whose process is not run for tens of seconds on a loaded host (measured:
            38 s, both decode workers of a real-engine pair at once) keeps its session and its
            reads; a shorter one failed those reads (`docs/connectors.md`, "Failures").
        released_ttl_s: how long a released request id is remembered (refused if published
            again, answered "released" to a late fetch).
        max_sessions: the most consumer sessions at once; more handshakes are refused.
        backend: pack backend ("auto", "torch", "triton").
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
        staging_slots: int = DEFAULT_STAGING_SLOTS,
        request_timeout_s: float = 300.0,
        session_timeout_s: float = 120.0,
        released_ttl_s: float = 600.0,
        max_sessions: int = 256,
        backend: str = "auto",
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
        self._session_timeout_s = session_timeout_s
        # The side channel's ticks (its thread only): a gap between two of them, a time it
        # was not run, counts neither as its peers' silence nor against its requests' deadlines.
        self._gaps = TickGaps()
        self._backend = resolve_backend(backend, caches[0].device)
        self._copy_stream = copy_stream_for(caches[0].device)
        self._fences: dict[str, Fence] = {}  # CUDA: by published request (see `publish`)
        self._registration = CacheRegistration(self.caches, transport, host, protocol)
        self.transport = self._registration.transport
        self._cache_regions = [
            RegionInfo(r.region_id, r.address, r.nbytes) for r in self._registration.regions
        ]
        self._requests = RequestTable(released_ttl_s)
        self._expired_requests = 0  # released at their deadline (side-channel thread only)
        self._lock = threading.Lock()
        self._sessions: SessionServer[_Session] = SessionServer(
            KV_SERVICE, self._secret, max_sessions
        )
        self._spare_pools: list[StagingPool] = []
        self._warmed: set[tuple[object, ...]] = set()
        self._closed = False
        self._engine_stopped = threading.Event()  # set by close, once no read can come
        try:
            self._server = SideChannelServer(
                host,
                port,
                self._on_frames,
                self._on_tick,
                name="kvxfer-producer",
                idle_tick_s=_IDLE_TICK_S,
                busy=self._busy,
                owner=f"producer {engine_id} {spec.rank_name} side channel",
            )
        except Exception:
            self._registration.close()
            raise
        self.address = self._server.address

    # ---- public API ---------------------------------------------------------------------

    def publish(
        self,
        request_id: str,
        block_ids: Sequence[int] | np.ndarray,
        num_tokens: int,
        deadline_s: float | None = None,
        first_token: int = 0,
        ready_tokens: int | None = None,
        timeline: Mapping[str, float] | None = None,
    ) -> None:
        """Offer a request's KV (tokens `[first_token, num_tokens)` in `block_ids`) to decode
        ranks.

        `ready_tokens`: publish while the prefill still runs (its blocks allocated, tokens
        before `ready_tokens` computed; None: all of them). Chunks of tokens not ready yet are
        held until `mark_ready` covers them, so a decode rank's fetch, asked for at once, reads
        each chunk of a chunked prefill as soon as it is computed; `fail` ends it early.

        With `ready_tokens`, `block_ids` may hold fewer than `num_tokens` tokens (a chunked
        prefill allocates its blocks step by step): at least the computed ones; `extend` adds
        the rest before `mark_ready` covers them.

        `first_token` > 0: the tokens before it are not held (a sliding-window cache group's
        dropped blocks, whose `block_ids` entries are never read); a fetch that asks for them
        fails, naming its blocks, rather than read another request's bytes.

        Its blocks stay untouched by kvxfer and are handed back through `release` once every
        decode rank that fetched it reported done, or `deadline_s` (default
        `request_timeout_s`) after now.

        `timeline`: the engine's events of the request before this call (wall-clock seconds,
        `kvxfer.connector.timeline`, e.g. its `prefill_scheduled`); with the producer's own
        (when its KV was first and last offered as computed) it goes to every decode rank with
        the chunks, for the decode engine's record of where the request's time went.

        CUDA: call it on the thread, and with the current stream, that wrote the request's KV
        (or after making that stream wait for the writer), as vLLM's model runner does: packs
        run on a side stream after the kernels enqueued on the caller's current stream before
        this call (the forward passes that wrote the KV may still be running), and after
        nothing enqueued later.

        Raises:
            ValueError: a bad id, token count or block table, or an id already published.
            RuntimeError: the producer is closed.
        """
        if self._closed:
            raise RuntimeError("publish: the producer is closed; create a new KVProducer")
        request_id = check_request_id(request_id, "publish")
        where = f"publish({request_id!r})"
        tokens = check_num_tokens(num_tokens, f"{where}: num_tokens")
        if isinstance(first_token, bool) or not isinstance(first_token, (int, np.integer)):
            raise ValueError(f"{where}: first_token must be an int, got {first_token!r}")
        held_from = int(first_token)
        if not 0 <= held_from < tokens:
            raise ValueError(
                f"{where}: first_token {held_from} is outside [0, num_tokens={tokens}); pass "
                "the first token whose KV the blocks still hold (0 for all of them)"
            )
        ready = None if ready_tokens is None else _check_ready(ready_tokens, tokens, where)
        # A prefill still computing may not have every block yet (a chunked prefill): its
        # table covers what it allocated, at least what is computed; `extend` grows it.
        ids, covered = check_published_table(self.spec, block_ids, tokens, where, held_from, ready)
        timeout = self._request_timeout_s if deadline_s is None else deadline_s
        fence = self._copy_stream.fence()  # before the table: a pack may start right after it
        if fence is not None:
            with self._lock:
                self._fences[request_id] = fence
        try:
            release_now = self._requests.publish(
                request_id, ids, tokens, timeout, held_from, ready, covered, timeline
            )
        except ValueError:
            if fence is not None and self._requests.get(request_id) is None:
                with self._lock:
                    self._fences.pop(request_id, None)  # a live one keeps its later fence
            raise
        if release_now is not None:
            self._release(request_id, release_now)
        else:  # chunks asked for before the publish are served now, not at the next tick
            self._server.post(self._serve_waiting)

    def mark_ready(self, request_id: str, tokens: int, layers: int | None = None) -> None:
        """Tokens before `tokens` of a request published with `ready_tokens` are computed now,
        in every layer (`layers` None) or in this rank's first `layers` layers (local indices:
        an attention layer's write during the step that computes those tokens): the chunks
        they complete are served at once, so the read of layer l overlaps the compute of layer
        l + 1 for a consumer that fetches it streamed (`KVConsumer.fetch(streamed=True)`).

        CUDA: as `publish`, call it on the thread and current stream that wrote those tokens
        (packs from now on run after what that stream enqueued before this call: the event
        recorded here, which the side stream waits on; the host never syncs).

        Raises:
            ValueError: the request is not live, `tokens` is below what was ready in every
                layer or beyond its length, `layers` is outside `[0, num_layers]` or below what
                was marked for the same tokens.
        """
        where = f"mark_ready({request_id!r})"
        tokens = _check_ready(tokens, None, where)
        if layers is not None:
            layers = _check_layers(layers, self.spec.num_layers, where)
            if layers == self.spec.num_layers:
                layers = None  # every layer: the tokens are computed
        fence = self._copy_stream.fence()
        self._requests.mark_ready(request_id, tokens, layers)
        if fence is not None:
            with self._lock:
                self._fences[request_id] = fence  # later than the publish's: covers these
        self._server.post(self._serve_waiting)

    def extend(self, request_id: str, block_ids: Sequence[int] | np.ndarray) -> None:
        """A request published with part of its block table (a chunked prefill, whose next
        step allocated more blocks): `block_ids` is its whole table so far, starting with the
        published one.

        Raises:
            ValueError: not live, a bad table, or one that does not start with the published
                table (from `first_token`'s block on).
        """
        where = f"extend({request_id!r})"
        request = self._requests.get(request_id)
        if request is None:
            raise ValueError(f"{where}: not published, or released already")
        covered = covered_tokens(self.spec, block_ids, request.num_tokens)
        ids = check_block_ids(self.spec, block_ids, covered, where, request.first_token)
        first, old = request.first_token // self.spec.block_size, request.block_ids
        if len(ids) < len(old) or not np.array_equal(ids[first : len(old)], old[first:]):
            raise ValueError(
                f"{where}: the new table must start with the published one (those blocks stay "
                "the request's); pass the whole table so far"
            )
        self._requests.extend(request_id, ids, covered)

    def fail(self, request_id: str, reason: str = "the prefill failed") -> None:
        """The prefill of a request published with `ready_tokens` failed or was aborted
        half-way: every chunk not served yet fails (its fetch reports those blocks), chunks
        being read fail their confirmation, and the request is released once. Unknown or
        released ids are ignored.

        Once it returns no read is confirmed any more, so the caller may give the request's
        blocks to another request at once (an engine that freed them under a preemption):
        a chunk confirmed before was read before. Its release callback comes later, once."""
        if self._requests.fail(request_id, reason):
            self._server.post(lambda: self._fail_request(request_id))

    @property
    def pending_requests(self) -> list[str]:
        """Published requests not released yet."""
        return self._requests.pending()

    @property
    def expired_requests(self) -> int:
        """Requests released because their deadline passed before every decode rank that
        fetched them (if any) reported done, since this producer started."""
        return self._expired_requests

    def staging_free_slots(self) -> dict[tuple[str, int], int]:
        """Free slots of each live consumer session's staging pool (all free when idle)."""
        sessions = self._peers()
        return {(s.engine_id, s.rank): s.pool.free_slots for s in sessions if s.pool is not None}

    def stats_snapshot(self) -> dict[str, object]:
        """Live state, for monitoring and leak checks: sessions, pending and remembered
        request ids, leases, the transport, and the threads this producer runs."""
        sessions = self._peers()
        return {
            "sessions": len(sessions),
            "pending_requests": len(self._requests.pending()),
            "released_ids_kept": self._requests.released_kept,
            "expired_requests": self._expired_requests,
            "leases": sum(len(s.leases) for s in sessions),
            "waiting_chunks": sum(len(s.waiting) for s in sessions),
            "spare_pools": len(self._spare_pools),
            "transport": getattr(self.transport, "protocol", type(self.transport).__name__),
            "threads": 2 + len(sessions),  # side channel, transport pump, a worker per session
        }

    def close(self) -> None:
        """Stop serving, release every pending request once, free staging, unregister."""
        if self._closed:
            return
        self._closed = True
        self._server.close()
        for request_id in self._requests.pending():
            self._release(request_id, "the producer closed")
        sessions = [s for s in self._peers() if self._sessions.end(s.id) is not None]
        for session in sessions:
            session.worker.shutdown(wait=True)
        self._registration.close()  # ends the engine first when it is ours: no read in flight
        self._engine_stopped.set()  # pools held for ended sessions' leases may go now
        for session in sessions:
            if session.pool is not None:
                session.pool.close()
        for pool in self._spare_pools:
            pool.close()

    def __enter__(self) -> KVProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _busy(self) -> bool:
        """(server thread) Published requests, held chunks or leases: deadlines to watch."""
        return self._requests.live_count > 0 or any(s.waiting or s.leases for s in self._peers())

    def _peers(self) -> list[_Session]:
        return [link.state for link in self._sessions.open_sessions()]

    # ---- side channel (server thread: never blocks) ---------------------------------------

    def _on_frames(self, identity: bytes, frames: list[bytes]) -> None:
        try:
            event = self._sessions.receive(identity, frames)
            if isinstance(event, Reply):
                self._server.send(identity, event.frames)
            elif isinstance(event, Claim):
                self._open_session(event)
            else:
                self._on_session_message(event.session.state, decode(event.payload))
        except ProtocolError as exc:
            log.warning("producer %s: refused a frame: %s", self.engine_id, exc)
            self._server.send(identity, refusal(str(exc)))

    def _open_session(self, claim: Claim) -> None:
        """A consumer rank proved the secret: check its geometry, then open its session."""
        consumer = decode_terms(claim.claim, KVClaim)
        try:
            check_pairable(self.spec, consumer.spec)
        except ValueError as exc:
            raise ProtocolError(f"handshake refused: {exc}") from exc
        # What this rank serves that consumer rank (layers both hold, heads it supplies), the
        # route the consumer plans too; None: the consumer fetches nothing here, and keeps the
        # session for its done and abort notices (every decode rank reports to every rank).
        route = route_pair(self.spec, consumer.spec)
        terms = KVTerms(
            engine_id=self.engine_id,
            spec=self.spec,
            endpoint=self.transport.endpoint,
            cache_regions=self._cache_regions,
            staging_slot_bytes=self._slot_bytes,
        )
        worker = ThreadPoolExecutor(1, thread_name_prefix="kvxfer-producer-peer")
        _, welcome = self._sessions.accept(
            claim,
            encode(terms),
            lambda session_id: _Session(
                session_id, consumer.engine_id, consumer.spec, route, worker
            ),
        )
        if route is not None:
            worker.submit(self._warm_up, route, consumer.spec)
        self._server.send(claim.identity, welcome)

    def _on_session_message(self, session: _Session, message: Message) -> None:
        if isinstance(message, Ping):
            self._send(session, Pong())
        elif isinstance(message, TransferRequest):
            self._on_transfer(session, message)
        elif isinstance(message, ChunkRead):
            self._on_chunk_read(session, message)
        elif isinstance(message, StagingRead):
            self._give_back_lease(session, message.request_id, message.chunk_id)
        elif isinstance(message, RequestsDone):
            for request_id in message.request_ids:
                self._on_request_done(session, request_id)
        elif isinstance(message, Abort):
            self._forget_request(session, message.request_id)
            if self._requests.abort(message.request_id, session.engine_id):
                self._release(message.request_id, f"engine {session.engine_id} aborted it")
        else:
            raise ProtocolError(f"a producer does not accept {type(message).__name__} messages")

    def _on_request_done(self, session: _Session, request_id: str) -> None:
        self._forget_request(session, request_id)
        # Every rank of the decode engine (pp x tp) reports, fetching here or not.
        size = session.spec.engine_size
        if self._requests.report_done(request_id, session.engine_id, session.rank, size):
            self._release(request_id, "every decode rank is done")

    def _send(self, session: _Session, message: Message) -> None:
        link = self._sessions.get(session.id)
        if link is None:  # ended meanwhile: its consumer learns so on its next frame
            return
        self._server.send(link.identity, self._sessions.seal(link, encode(message)))

    def _on_transfer(self, session: _Session, ask: TransferRequest) -> None:
        received = time.monotonic()
        with session.lock:
            session.finished.pop(ask.request_id, None)  # fetched again
        try:
            check_strategy(ask.strategy)
        except ValueError as exc:
            self._send(session, _failed(ask, str(exc)))
            return
        if session.route is None:
            reason = (
                f"producer {self.spec.rank_name} holds no layers and heads that consumer "
                f"{session.spec.rank_name} needs"
            )
            self._send(session, _failed(ask, reason))
        elif self._servable(self._requests.get(ask.request_id), ask):
            self._serve_chunk(session, ask, received)
        elif self._requests.was_released(ask.request_id):
            self._send(session, _failed(ask, "the request was already released"))
        elif len(session.waiting) >= _MAX_WAITING_PER_SESSION:
            reason = "too many chunks wait for unpublished requests or uncomputed tokens"
            self._send(session, _failed(ask, reason))
        else:
            session.waiting.append(_Waiting(ask, received, received + ask.wait_seconds))

    def _servable(self, request: PublishedRequest | None, ask: TransferRequest) -> bool:
        """Whether a chunk can be answered now: its request is published, and its tokens are
        computed in its layers, or the prefill failed, or the ask does not fit the request (the
        answer is then the failure or the refusal, at once)."""
        if request is None:
            return False
        if request.failure or ask.num_tokens != request.num_tokens:
            return True
        if not 0 < ask.token_end <= request.num_tokens:
            return True  # refused at once
        layer_end = ask.layer_end - self.spec.layer_start  # this rank's own layer index
        return self._requests.is_ready(request, ask.token_end, layer_end)

    def _chunk_route(self, session: _Session, ask: TransferRequest) -> HeadRoute | str:
        """The route of the chunk's layers (the session's, or fewer of them), or why not."""
        route = session.route
        assert route is not None
        layers = route.global_layers(self.spec)
        if range(ask.layer_start, ask.layer_end) == layers:
            return route
        if not layers.start <= ask.layer_start < ask.layer_end <= layers.stop:
            return (
                f"layers [{ask.layer_start}, {ask.layer_end}) are not among the layers "
                f"[{layers.start}, {layers.stop}) this producer serves that consumer"
            )
        return route.narrowed(ask.layer_start, ask.layer_end)

    def _serve_chunk(self, session: _Session, ask: TransferRequest, received: float) -> None:
        request = self._requests.get(ask.request_id)
        if request is None:
            self._send(session, _failed(ask, "the request was released before its chunk ran"))
            return
        if request.failure:
            self._send(session, _failed(ask, f"the prefill failed: {request.failure}"))
            return
        if ask.num_tokens != request.num_tokens or not (
            request.first_token <= ask.token_start < ask.token_end <= request.num_tokens
        ):
            held = f"tokens [{request.first_token}, {request.num_tokens})"
            reason = (
                f"tokens [{ask.token_start}, {ask.token_end}) of {ask.num_tokens} do not fit the "
                f"published {held}"
                + (
                    " (a sliding window: the earlier blocks were dropped)"
                    if request.first_token and ask.token_start < request.first_token
                    else ""
                )
            )
            self._send(session, _failed(ask, reason))
            return
        route = self._chunk_route(session, ask)
        if isinstance(route, str):
            self._send(session, _failed(ask, route))
            return
        self._requests.note_fetcher(ask.request_id, session.engine_id, session.spec.engine_size)
        # The chunk's blocks only (validated once, at publish): a chunk's work and message
        # are O(its tokens), never O(the request).
        lo, hi = ask.token_start, ask.token_end
        blocks = chunk_blocks(request.block_ids, self.spec.block_size, lo, hi)
        strategy = check_strategy(ask.strategy)
        pack = chunk_pack_copy(strategy, route, self.spec, session.spec, blocks, lo, hi)
        ready = ChunkReady(
            request_id=ask.request_id,
            chunk_id=ask.chunk_id,
            generation=request.generation,
            # Read from staging when packed: the consumer needs no block id of mine then.
            src_block_ids=[] if pack is not None else blocks.tolist(),
            staging=None,
            timeline=self._requests.timeline(request),
        )
        if pack is None:  # the consumer reads the cache blocks themselves
            self._send(session, ready)
        else:
            job = _PackJob(ask, ready, pack, received)
            if not self._pack_now(session, job):
                session.worker.submit(self._pack_chunk, session, job)

    def _on_chunk_read(self, session: _Session, read: ChunkRead) -> None:
        """A chunk read from the cache: were its blocks the request's all along?"""
        valid = self._requests.holds(read.request_id, read.generation)
        reason = "" if valid else "the source was released before the read was confirmed"
        self._send(
            session,
            ChunkValid(request_id=read.request_id, chunk_id=read.chunk_id, ok=valid, reason=reason),
        )

    def _on_tick(self) -> None:
        now = time.monotonic()
        away = self._gaps.away(now)
        if away > 0:  # a request's deadline counts the time this side channel could serve it
            self._requests.postpone(away)
        for request_id in self._requests.expired(now):
            self._release(request_id, "its deadline passed", expired=True)
        self._sessions.expire_challenges()
        for link in self._sessions.open_sessions():
            session = link.state
            if away > 0:  # this thread was not run: whoever it did not hear from was not heard
                link.last_heard = min(now, link.last_heard + away)
                for chunk in session.waiting:  # nor could it serve what waited
                    chunk.deadline += away
            if now - link.last_heard > self._session_timeout_s:
                self._end_session(session, "silent for too long")
                continue
            self._expire_leases(session, now)
            if session.waiting:
                self._dispatch_waiting(session, now)

    def _fail_request(self, request_id: str) -> None:
        """(side-channel thread) Answer the request's held chunks, then release it."""
        self._serve_waiting()
        self._release(request_id, "its prefill failed")

    def _serve_waiting(self) -> None:
        now = time.monotonic()
        for link in self._sessions.open_sessions():
            if link.state.waiting:
                self._dispatch_waiting(link.state, now)

    def _dispatch_waiting(self, session: _Session, now: float) -> None:
        still = []
        for chunk in session.waiting:
            request = self._requests.get(chunk.ask.request_id)
            if self._servable(request, chunk.ask):
                self._serve_chunk(session, chunk.ask, chunk.received)
            elif self._requests.was_released(chunk.ask.request_id):
                self._send(session, _failed(chunk.ask, "the request was already released"))
            elif now >= chunk.deadline:
                what = "published" if request is None else "computed (mark_ready)"
                reason = f"not {what} within {chunk.ask.wait_seconds:.1f} s"
                self._send(session, _failed(chunk.ask, reason))
            else:
                still.append(chunk)
        session.waiting = still

    def _end_session(self, session: _Session, why: str) -> None:
        log.info(
            "producer %s: session of %s rank %d ended: %s",
            self.engine_id,
            session.engine_id,
            session.rank,
            why,
        )
        self._sessions.end(session.id)
        session.ended = True
        session.worker.shutdown(wait=False)
        # Its pool goes back to the spares once its last pack finished (the worker's last job).
        threading.Thread(target=self._recycle_pool, args=(session,), daemon=True).start()

    def _recycle_pool(self, session: _Session) -> None:
        session.worker.shutdown(wait=True)
        # Its consumer may still read (frozen, or alive but silent too long): a range leased to
        # it stays untouched until its hold ends, or until this producer's engine has stopped.
        with session.lock:
            held_until = max((lease.expires for lease in session.leases.values()), default=0.0)
        self._engine_stopped.wait(max(0.0, held_until - time.monotonic()))
        with session.lock:
            session.leases.clear()
            pool = session.pool
            session.pool = None
        if pool is None:
            return
        pool.reset()
        with self._lock:
            if self._closed:
                pool.close()
            else:
                self._spare_pools.append(pool)

    def _give_back_lease(self, session: _Session, request_id: str, chunk_id: int) -> None:
        """The session's consumer read the chunk from staging: its range is free again."""
        with session.lock:
            lease = session.leases.pop((request_id, chunk_id), None)
            pool = session.pool
        if lease is not None:
            _give_back(pool, [lease.slot])

    def _expire_leases(self, session: _Session, now: float) -> None:
        with session.lock:
            expired = [key for key, lease in session.leases.items() if lease.expires <= now]
            slots = [session.leases.pop(key).slot for key in expired]
            pool = session.pool
        _give_back(pool, slots)

    def _forget_request(self, session: _Session, request_id: str) -> None:
        """The session is done with a request: its waiting chunks, leases and packs to come
        are dropped (a chunk it gave up on must not hold a slot until its deadline)."""
        session.waiting = [w for w in session.waiting if w.ask.request_id != request_id]
        with session.lock:
            session.finished[request_id] = None
            while len(session.finished) > _MAX_FINISHED_PER_SESSION:
                session.finished.popitem(last=False)
            keys = [key for key in session.leases if key[0] == request_id]
            slots = [session.leases.pop(key).slot for key in keys]
            pool = session.pool
        _give_back(pool, slots)

    def _release(self, request_id: str, why: str, expired: bool = False) -> None:
        if not self._requests.release(request_id):
            return  # released already: the callback runs once
        if expired:  # counted before the callback: whoever it tells sees the count
            self._expired_requests += 1
        with self._lock:
            self._fences.pop(request_id, None)
        log.debug("releasing request %s: %s", request_id, why)
        if self._release_cb is not None:
            try:
                self._release_cb(request_id)
            except Exception:
                log.exception("release callback failed for request %s", request_id)

    # ---- a session's worker thread -------------------------------------------------------

    def _warm_up(self, route: HeadRoute, consumer_spec: KVCacheSpec) -> None:
        """Compile the packs this pair may ask for now, not on its first request."""
        key = (
            route.num_heads,
            route.src_head_offset,
            consumer_spec.block_size,
            consumer_spec.layout,
            consumer_spec.kv_placement,
        )
        if key in self._warmed:
            return
        one = np.zeros(1, dtype=np.int64)
        for strategy in ("pack", "pack+unpack"):
            shape = program_shape(strategy, route, self.spec, consumer_spec, one, one, 0, 1)
            assert shape.pack is not None
            dtype, device = self.caches[0].dtype, self.caches[0].device
            compile_pack = functools.partial(warm_up, shape.pack, dtype, device, self._backend)
            self._copy_stream.launch(compile_pack).wait()  # on the side stream's device
        self._warmed.add(key)

    def _pack_bytes(self, pack: CellCopy) -> int:
        """The staging bytes a pack fills: between two KV dtypes, the destination's."""
        layers = pack.num_layers or self.spec.num_layers  # the route's layers
        return layers * pack.dst.geometry.layer_bytes

    def _pack_now(self, session: _Session, job: _PackJob) -> bool:
        """(server thread) Pack a small CPU chunk here and answer it, if its staging bytes are
        free at once (never waiting: a taker already waiting for room keeps its turn, see
        `StagingPool.try_acquire`). Returns whether it did; else the session's worker packs.

        Order between chunks does not matter (each is its own range and answer); what the
        server thread spends is one short copy."""
        nbytes = self._pack_bytes(job.pack)
        if not copies_inline(self.caches[0].device, self._backend, nbytes):
            return False
        pool = self._pool_for(session)
        slot = pool.try_acquire(nbytes)
        if slot is None:
            return False
        try:
            self._pack_into(session, job, pool, slot, nbytes)
        except Exception as exc:
            self._pack_failed(session, job.ask, exc)
        return True

    def _pack_chunk(self, session: _Session, job: _PackJob) -> None:
        """(the session's worker) Wait for staging room, then pack the chunk and answer it."""
        try:
            pool = self._pool_for(session)
            remaining = max(0.0, job.ask.wait_seconds)
            nbytes = self._pack_bytes(job.pack)
            slot = self._acquire_slot(session, pool, nbytes, max(remaining, 0.1))
            self._pack_into(session, job, pool, slot, nbytes)
        except Exception as exc:
            self._pack_failed(session, job.ask, exc)

    def _pack_failed(self, session: _Session, ask: TransferRequest, exc: Exception) -> None:
        log.warning("request %s chunk %d: pack failed: %s", ask.request_id, ask.chunk_id, exc)
        self._send(session, _failed(ask, f"{type(exc).__name__}: {exc}"))

    def _pack_into(
        self, session: _Session, job: _PackJob, pool: StagingPool, slot: int, nbytes: int
    ) -> None:
        """Pack the chunk into `nbytes` at `slot` of `pool` (taken for it), lease them to the
        session and answer `ChunkReady` with the lease's end as seconds after the ask arrived;
        the range goes back to the pool if the pack fails or the session finished the request
        meanwhile.

        The lease lasts the fetch's remaining time and a second more, counted from now: it
        outlives the fetch, so it never ends a read the consumer still wants."""
        ask, ready = job.ask, job.ready
        remaining = max(0.0, ask.wait_seconds)
        try:
            staging = pool.slot_tensor(slot, torch.uint8)
            info = RegionInfo(
                pool.region.region_id, pool.region.address + pool.offset(slot), nbytes
            )
            with self._lock:
                fence = self._fences.get(ask.request_id)
            # After the publish's fence; then wait for this pack's own event only: the NIC
            # reads finished bytes, and nothing waits for the engine's later work.
            run = functools.partial(run_cell_copy, job.pack, self.caches, [staging], self._backend)
            self._copy_stream.launch(run, fence).wait()
        except BaseException:
            pool.release(slot)
            raise
        # The consumer trusts the packed bytes for the hold, without asking again: they must
        # be the request's. Released or failed before the pack finished, the engine may have
        # written those blocks for another request during it.
        if not self._requests.holds(ask.request_id, ready.generation):
            pool.release(slot)
            self._send(session, _failed(ask, "the request was released while its chunk was packed"))
            return
        with session.lock:
            if ask.request_id in session.finished:  # done meanwhile: nobody will read
                pool.release(slot)
                return
            expires = time.monotonic() + remaining + 1.0
            session.leases[(ask.request_id, ask.chunk_id)] = _Lease(slot, expires)
        self._send(session, _with_staging(ready, info, expires - job.received))

    def _acquire_slot(
        self, session: _Session, pool: StagingPool, nbytes: int, timeout: float
    ) -> int:
        """`nbytes` of the session's pool; gives up after `timeout`, at `close` or when the
        session ends (its consumer's own leases fill the pool: only it waits)."""
        return pool.acquire(nbytes, timeout=timeout, give_up=lambda: self._closed or session.ended)

    def _pool_for(self, session: _Session) -> StagingPool:
        with session.lock:
            if session.pool is None:
                with self._lock:
                    spare = self._spare_pools.pop() if self._spare_pools else None
                session.pool = spare or StagingPool(
                    self.transport,
                    self._staging_bytes,
                    self._staging_slots,
                    self.caches[0].device,
                )
            return session.pool


def _give_back(pool: StagingPool | None, slots: list[int]) -> None:
    """Return leased ranges to their session's pool (read with the leases, under the session's
    lock). A range the pool no longer holds was freed by its reset: the session ended and its
    pool was recycled between the lease's end and this call."""
    if pool is None:
        return
    for slot in slots:
        with contextlib.suppress(ValueError):
            pool.release(slot)


def _with_staging(ready: ChunkReady, staging: RegionInfo, held_seconds: float) -> ChunkReady:
    return ChunkReady(
        request_id=ready.request_id,
        chunk_id=ready.chunk_id,
        generation=ready.generation,
        src_block_ids=ready.src_block_ids,
        staging=staging,
        held_seconds=held_seconds,
        timeline=ready.timeline,
    )


def _check_layers(layers: object, num_layers: int, where: str) -> int:
    if isinstance(layers, bool) or not isinstance(layers, (int, np.integer)):
        raise ValueError(f"{where}: layers must be an int or None, got {layers!r}")
    if not 0 <= int(layers) <= num_layers:
        raise ValueError(
            f"{where}: layers {layers} is outside [0, {num_layers}]; pass how many of this "
            "rank's layers (local, in order) have written the tokens"
        )
    return int(layers)


def _failed(ask: TransferRequest, reason: str) -> ChunkFailed:
    return ChunkFailed(request_id=ask.request_id, chunk_id=ask.chunk_id, reason=reason)


def _check_ready(ready_tokens: object, num_tokens: int | None, where: str) -> int:
    """`ready_tokens` as an int in `[0, num_tokens]` (no upper bound when None)."""
    if isinstance(ready_tokens, bool) or not isinstance(ready_tokens, (int, np.integer)):
        raise ValueError(f"{where}: ready_tokens must be an int, got {ready_tokens!r}")
    ready = int(ready_tokens)
    if ready < 0 or (num_tokens is not None and ready > num_tokens):
        raise ValueError(
            f"{where}: ready_tokens {ready} is outside [0, num_tokens={num_tokens}]; pass how "
            "many of the request's first tokens are computed"
        )
    return ready
