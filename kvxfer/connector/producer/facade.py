"""`KVProducer` (the facade): the public API and its checks, and the side-channel loop that
owns every session and served chunk (its handshakes, messages and ticks)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from kvxfer.connector.messages import (
    KV_SERVICE,
    Abort,
    ChunkRead,
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
from kvxfer.connector.producer.packing import Packer
from kvxfer.connector.producer.serving import ChunkServer
from kvxfer.connector.producer.sessions import ConsumerSession
from kvxfer.connector.producer.states import ServedState
from kvxfer.connector.registration import CacheRegistration
from kvxfer.connector.requests import ReleaseReason, RequestTable
from kvxfer.connector.sidechannel import SideChannelServer
from kvxfer.connector.streams import copy_stream_for
from kvxfer.connector.turns import TickGaps
from kvxfer.execute import resolve_backend
from kvxfer.plan import DEFAULT_STAGING_SLOTS, check_pairable, route_pair
from kvxfer.session.protocol import Claim, Delivery, SessionServer
from kvxfer.spec import KVCacheSpec
from kvxfer.transport.base import Transport
from kvxfer.validation import (
    check_block_ids,
    check_caches,
    check_first_token,
    check_marked_layers,
    check_num_tokens,
    check_published_table,
    check_ready_tokens,
    check_request_id,
    covered_tokens,
)

log = logging.getLogger(__name__)

# With no published request, served chunk or ended session's pool to recycle, the side
# channel's tick checks only handshakes and sessions' silence (120 s): ten times a second is
# enough.
_IDLE_TICK_S = 0.1


class KVProducer:
    """Serves one prefill rank's KV cache to decode ranks.

    Args:
        spec: this rank's geometry.
        caches: this rank's layer tensors (the layout contract's shapes).
        engine_id: the prefill engine's id.
        host: address to bind the side channel and the transport to (127.0.0.1 by default).
        port: side-channel port (0: any free port; see `address`).
        release: called with a request id and a `ReleaseReason` once every decode rank that
            fetched it is done (`READ`), when its decode engine aborts it (`ABORTED`), at its
            deadline (`EXPIRED`), when its prefill fails (`FAILED`), or at `close` (`CLOSED`):
            exactly once per published request. It runs on the side-channel thread: it must
            not block.
        secret: a shared secret; consumers must prove they hold it (challenge-response, never
            sent) and every session frame is signed with a key derived from it.
        transport: a transport to share (left open), or the kind of one of its own
            (`kvxfer.transport.factory.KINDS`, on `host` and `protocol`, closed with this
            object); default: its own Mooncake transport.
        protocol: "tcp" or "rdma" for a Mooncake transport of its own.
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
        release: Callable[[str, ReleaseReason], None] | None = None,
        secret: str | None = None,
        transport: Transport | str | None = None,
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
        self._request_timeout_s = request_timeout_s
        self._session_timeout_s = session_timeout_s
        # The side channel's ticks (its thread only): a gap between two of them, a time it
        # was not run, counts neither as its peers' silence nor against its requests' deadlines.
        self._gaps = TickGaps()
        self._registration = CacheRegistration(self.caches, transport, host, protocol)
        self.transport = self._registration.transport
        self._cache_regions = [
            RegionInfo(r.region_id, r.address, r.nbytes) for r in self._registration.regions
        ]
        self._requests = RequestTable(released_ttl_s)
        self._expired_requests = 0  # released at their deadline (side-channel thread only)
        self._sessions: SessionServer[ConsumerSession] = SessionServer(
            KV_SERVICE, self._secret, max_sessions
        )
        # Ended sessions whose pools wait for their last pack and their holds' end (the side
        # channel's): `recycle_at` None until the worker's last job ran.
        self._recycling: list[ConsumerSession] = []
        self._closed = False
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
        self._packer = Packer(
            spec,
            self.caches,
            self.transport,
            resolve_backend(backend, caches[0].device),
            copy_stream_for(caches[0].device),
            staging_bytes,
            staging_slots,
            self._server.post,
        )
        self._chunks = ChunkServer(spec, self._requests, self._packer, self._send)
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
        held_from = check_first_token(first_token, tokens, where)
        ready = None if ready_tokens is None else check_ready_tokens(ready_tokens, tokens, where)
        # A prefill still computing may not have every block yet (a chunked prefill): its
        # table covers what it allocated, at least what is computed; `extend` grows it.
        ids, covered = check_published_table(self.spec, block_ids, tokens, where, held_from, ready)
        timeout = self._request_timeout_s if deadline_s is None else deadline_s
        fence = self._packer.fence()  # before the table: a pack may start right after it
        self._packer.set_fence(request_id, fence)
        try:
            release_now = self._requests.publish(
                request_id, ids, tokens, timeout, held_from, ready, covered, timeline
            )
        except ValueError:
            if fence is not None and self._requests.get(request_id) is None:
                self._packer.drop_fence(request_id)  # a live one keeps its later fence
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
        tokens = check_ready_tokens(tokens, None, where)
        if layers is not None:
            layers = check_marked_layers(layers, self.spec.num_layers, where)
            if layers == self.spec.num_layers:
                layers = None  # every layer: the tokens are computed
        fence = self._packer.fence()
        self._requests.mark_ready(request_id, tokens, layers)
        self._packer.set_fence(request_id, fence)  # later than the publish's: covers these
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
            "leases": sum(s.counts[ServedState.LEASED] for s in sessions),
            "waiting_chunks": sum(s.counts[ServedState.WAITING] for s in sessions),
            "spare_pools": self._packer.spare_pools,
            "transport": self.transport.protocol,
            "threads": 2 + len(sessions),  # side channel, transport pump, a worker per session
        }

    def close(self) -> None:
        """Stop serving, release every pending request once, free staging, unregister."""
        if self._closed:
            return
        self._closed = True
        self._packer.stop()
        self._server.close()
        for request_id in self._requests.pending():
            self._release(request_id, ReleaseReason.CLOSED)
        sessions = [s for s in self._peers() if self._sessions.end(s.id) is not None]
        for session in sessions:
            session.ended = True
        for session in sessions + self._recycling:
            session.worker.shutdown(wait=True)
        self._registration.close()  # ends the engine first when it is ours: no read in flight
        self._packer.close(sessions + self._recycling)  # no read can come any more

    def __enter__(self) -> KVProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _busy(self) -> bool:
        """(server thread) Published requests, served chunks or pools to recycle: deadlines
        to watch."""
        return (
            self._requests.live_count > 0
            or bool(self._recycling)
            or any(s.chunks for s in self._peers())
        )

    def _peers(self) -> list[ConsumerSession]:
        return [link.state for link in self._sessions.open_sessions()]

    # ---- side channel (server thread: never blocks) ---------------------------------------

    def _on_frames(self, identity: bytes, frames: list[bytes]) -> None:
        refused = self._sessions.serve(
            identity, frames, self._server.send, self._open_session, self._on_delivery
        )
        if refused is not None:
            log.warning("producer %s: refused a frame: %s", self.engine_id, refused)

    def _on_delivery(self, delivery: Delivery[ConsumerSession]) -> None:
        self._on_session_message(delivery.session.state, decode(delivery.payload))

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
            staging_slot_bytes=self._packer.slot_bytes,
            transport=self.transport.kind,
        )
        worker = ThreadPoolExecutor(1, thread_name_prefix="kvxfer-producer-peer")
        _, welcome = self._sessions.accept(
            claim,
            encode(terms),
            lambda session_id: ConsumerSession(
                session_id, consumer.engine_id, consumer.spec, route, worker
            ),
        )
        if route is not None:
            worker.submit(self._packer.warm_up, route, consumer.spec)
        self._server.send(claim.identity, welcome)

    def _on_session_message(self, session: ConsumerSession, message: Message) -> None:
        if isinstance(message, Ping):
            self._send(session, Pong())
        elif isinstance(message, TransferRequest):
            self._chunks.on_transfer(session, message)
        elif isinstance(message, ChunkRead):
            self._chunks.on_chunk_read(session, message)
        elif isinstance(message, StagingRead):
            self._chunks.on_staging_read(session, message.request_id, message.chunk_id)
        elif isinstance(message, RequestsDone):
            for request_id in message.request_ids:
                self._on_request_done(session, request_id)
        elif isinstance(message, Abort):
            self._chunks.forget_request(session, message.request_id)
            if self._requests.abort(message.request_id, session.engine_id):
                self._release(message.request_id, ReleaseReason.ABORTED, session.engine_id)
        else:
            raise ProtocolError(f"a producer does not accept {type(message).__name__} messages")

    def _on_request_done(self, session: ConsumerSession, request_id: str) -> None:
        self._chunks.forget_request(session, request_id)
        # Every rank of the decode engine (pp x tp) reports, fetching here or not.
        size = session.spec.engine_size
        if self._requests.report_done(request_id, session.engine_id, session.rank, size):
            self._release(request_id, ReleaseReason.READ)

    def _send(self, session: ConsumerSession, message: Message) -> None:
        link = self._sessions.get(session.id)
        if link is None:  # ended meanwhile: its consumer learns so on its next frame
            return
        self._server.send(link.identity, self._sessions.seal(link, encode(message)))

    def _on_tick(self) -> None:
        now = time.monotonic()
        away = self._gaps.away(now)
        if away > 0:  # a request's deadline counts the time this side channel could serve it
            self._requests.postpone(away)
        for request_id in self._requests.expired(now):
            self._release(request_id, ReleaseReason.EXPIRED)
        self._sessions.expire_challenges()
        for link in self._sessions.open_sessions():
            session = link.state
            if away > 0:  # this thread was not run: whoever it did not hear from was not heard
                link.last_heard = min(now, link.last_heard + away)
                self._chunks.postpone(session, away)  # nor could it serve what waited
            if now - link.last_heard > self._session_timeout_s:
                self._end_session(session, "silent for too long")
                continue
            self._chunks.expire_leases(session, now)
            self._chunks.serve_waiting(session, now)
        self._recycle_pools(now)

    def _serve_waiting(self) -> None:
        now = time.monotonic()
        for session in self._peers():
            self._chunks.serve_waiting(session, now)

    def _fail_request(self, request_id: str) -> None:
        """(side-channel thread) Answer the request's held chunks, then release it."""
        self._serve_waiting()
        self._release(request_id, ReleaseReason.FAILED)

    def _end_session(self, session: ConsumerSession, why: str) -> None:
        log.info(
            "producer %s: session of %s rank %d ended: %s",
            self.engine_id,
            session.engine_id,
            session.rank,
            why,
        )
        self._sessions.end(session.id)
        session.ended = True
        self._chunks.end(session)
        # Its pool is recycled once its worker's last pack ended (the job queued last) and
        # the holds of the ranges leased to it ended: its consumer may still read them (frozen,
        # or alive but silent too long).
        self._recycling.append(session)
        session.worker.submit(self._server.post, lambda: self._last_pack_ended(session))
        session.worker.shutdown(wait=False)

    def _last_pack_ended(self, session: ConsumerSession) -> None:
        session.recycle_at = session.held_until()

    def _recycle_pools(self, now: float) -> None:
        due = [s for s in self._recycling if s.recycle_at is not None and s.recycle_at <= now]
        for session in due:
            self._recycling.remove(session)
            self._chunks.expire_leases(session, now)
            self._packer.recycle(session)

    def _release(self, request_id: str, reason: ReleaseReason, by: str = "") -> None:
        """Release the request once; `by`: the engine an abort came from, for the log."""
        if not self._requests.release(request_id):
            return  # released already: the callback runs once
        if reason is ReleaseReason.EXPIRED:
            self._expired_requests += 1
        self._packer.drop_fence(request_id)
        log.debug("releasing request %s: %s%s", request_id, reason.value, by and f" ({by})")
        if self._release_cb is not None:
            try:
                self._release_cb(request_id, reason)
            except Exception:
                log.exception("release callback failed for request %s", request_id)
