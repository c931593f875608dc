"""`ChunkServer`: what a producer does with each chunk a consumer asks for, on the side-channel
thread: serve it now or keep it waiting for its request's publish (or its tokens' compute),
offer it from the cache or pack it into the session's staging, lease the packed range until
its consumer read it, and answer failures. Every move of a chunk's state goes through
`ConsumerSession.advance` (`kvxfer.connector.producer.states`' table).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kvxfer.connector.messages import (
    ChunkFailed,
    ChunkRead,
    ChunkReady,
    ChunkValid,
    Message,
    RegionInfo,
    TransferRequest,
)
from kvxfer.connector.producer.packing import Packer, PackJob, give_back
from kvxfer.connector.producer.sessions import ConsumerSession, ServedChunk
from kvxfer.connector.producer.states import ServedEvent, ServedState
from kvxfer.connector.requests import PublishedRequest, RequestTable
from kvxfer.connector.staging import StagingPool
from kvxfer.plan import HeadRoute
from kvxfer.plan.program import PairChunk, check_strategy
from kvxfer.spec import KVCacheSpec

log = logging.getLogger(__name__)

MAX_WAITING_PER_SESSION = 4096  # chunks waiting for their request to be published

E = ServedEvent


class ChunkServer:
    """Serves consumers' chunks of this rank's published requests (the side channel's).

    Args:
        spec: this rank's geometry.
        requests: the published requests.
        packer: packs chunks into the sessions' staging.
        send: sends a message to a session's consumer.
    """

    def __init__(
        self,
        spec: KVCacheSpec,
        requests: RequestTable,
        packer: Packer,
        send: Callable[[ConsumerSession, Message], None],
    ) -> None:
        self.spec = spec
        self._requests = requests
        self._packer = packer
        self.send = send

    # ---- asks -----------------------------------------------------------------------------

    def on_transfer(self, session: ConsumerSession, ask: TransferRequest) -> None:
        """A consumer asks for a chunk: served now, refused, or kept waiting."""
        received = time.monotonic()
        try:
            check_strategy(ask.strategy)
        except ValueError as exc:
            self.send(session, _failed(ask, str(exc)))
            return
        if session.route is None:
            reason = (
                f"producer {self.spec.rank_name} holds no layers and heads that consumer "
                f"{session.spec.rank_name} needs"
            )
            self.send(session, _failed(ask, reason))
            return
        chunk = ServedChunk(ask, received, received + ask.wait_seconds)
        old = session.add(chunk)
        if old is not None:
            self._forget(session, old)
        self._try_serve(session, chunk, received)
        if (
            chunk.state is ServedState.WAITING
            and session.counts[ServedState.WAITING] > MAX_WAITING_PER_SESSION
        ):
            reason = "too many chunks wait for unpublished requests or uncomputed tokens"
            self._fail(session, chunk, reason)

    def serve_waiting(self, session: ConsumerSession, now: float) -> None:
        """Serve or fail what waits, now that requests were published or computed further (or
        time passed)."""
        for chunk in session.in_state(ServedState.WAITING):
            self._try_serve(session, chunk, now)

    def postpone(self, session: ConsumerSession, seconds: float) -> None:
        """The side channel was not run `seconds`: what waited could not be served meanwhile."""
        for chunk in session.in_state(ServedState.WAITING):
            chunk.deadline += seconds

    def _try_serve(self, session: ConsumerSession, chunk: ServedChunk, now: float) -> None:
        ask = chunk.ask
        request = self._requests.get(ask.request_id)
        if self._servable(request, ask):
            self._serve(session, chunk)
        elif self._requests.was_released(ask.request_id):
            self._fail(session, chunk, "the request was already released")
        elif now >= chunk.deadline:
            what = "published" if request is None else "computed (mark_ready)"
            self._fail(session, chunk, f"not {what} within {ask.wait_seconds:.1f} s")

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

    def _serve(self, session: ConsumerSession, chunk: ServedChunk) -> None:
        ask = chunk.ask
        request = self._requests.get(ask.request_id)
        if request is None:
            self._fail(session, chunk, "the request was released before its chunk ran")
            return
        if request.failure:
            self._fail(session, chunk, f"the prefill failed: {request.failure}")
            return
        misfit = _misfit(request, ask)
        if misfit:
            self._fail(session, chunk, misfit)
            return
        route = self._chunk_route(session, ask)
        if isinstance(route, str):
            self._fail(session, chunk, route)
            return
        self._requests.note_fetcher(ask.request_id, session.engine_id, session.spec.engine_size)
        # The chunk's blocks only (validated once, at publish): a chunk's work and message
        # are O(its tokens), never O(the request).
        lo, hi = ask.token_start, ask.token_end
        pair = PairChunk(route, check_strategy(ask.strategy), self.spec, session.spec, lo, hi)
        blocks = pair.source_blocks(request.block_ids)
        pack = pair.pack(blocks)
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
            session.advance(chunk, E.OFFER)
            self.send(session, ready)
            return
        session.advance(chunk, E.PACK)
        job = PackJob(chunk, ready, pack)
        if not self._packer.pack_inline(session, job, self.on_packed):
            self._packer.pack_on_worker(session, job, self.on_packed)

    def _chunk_route(self, session: ConsumerSession, ask: TransferRequest) -> HeadRoute | str:
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

    # ---- packs ----------------------------------------------------------------------------

    def on_packed(
        self,
        session: ConsumerSession,
        job: PackJob,
        pool: StagingPool | None,
        slot: int | None,
        error: Exception | None,
    ) -> None:
        """A pack ended: lease its range to the session and answer `ChunkReady` with the hold's
        end as seconds after the ask arrived, or give the range back.

        The hold lasts the fetch's remaining time and a second more, counted from now: it
        outlives the fetch, so it never ends a read the consumer still wants. The consumer
        trusts the packed bytes for the hold, without asking again: they must be the
        request's. Released or failed before the pack finished, the engine may have written
        those blocks for another request during it."""
        chunk, ask = job.chunk, job.ask
        chunk.slot = slot
        if error is not None:
            log.warning("request %s chunk %d: pack failed: %s", ask.request_id, ask.chunk_id, error)
            give_back(pool, slot)
            self._fail(session, chunk, f"{type(error).__name__}: {error}")
            return
        assert pool is not None and slot is not None
        if not self._requests.holds(ask.request_id, job.ready.generation):
            give_back(pool, slot)
            self._fail(session, chunk, "the request was released while its chunk was packed")
            return
        if session.advance(chunk, E.PACKED) is ServedState.SETTLED:  # dropped meanwhile
            give_back(pool, slot)
            return
        chunk.expires = time.monotonic() + max(0.0, ask.wait_seconds) + 1.0
        staging = self._packer.staging_region(pool, slot, self._packer.pack_bytes(job.pack))
        self.send(session, _with_staging(job.ready, staging, chunk.expires - chunk.received))

    # ---- the consumer's notices -----------------------------------------------------------

    def on_chunk_read(self, session: ConsumerSession, read: ChunkRead) -> None:
        """A chunk read from the cache: were its blocks the request's all along?"""
        valid = self._requests.holds(read.request_id, read.generation)
        reason = "" if valid else "the source was released before the read was confirmed"
        self.send(
            session,
            ChunkValid(request_id=read.request_id, chunk_id=read.chunk_id, ok=valid, reason=reason),
        )

    def on_staging_read(self, session: ConsumerSession, request_id: str, chunk_id: int) -> None:
        """The consumer read a chunk from staging: its range is free again."""
        chunk = session.chunks.get((request_id, chunk_id))
        if chunk is not None and chunk.state is ServedState.LEASED:
            session.advance(chunk, E.READ)
            give_back(session.pool, chunk.slot)

    def forget_request(self, session: ConsumerSession, request_id: str) -> None:
        """The session is done with a request: its waiting chunks and leases are dropped, and
        packs to come are not offered (a chunk it gave up on must not hold a range until its
        hold ends)."""
        for chunk in session.of_request(request_id):
            self._forget(session, chunk)

    def expire_leases(self, session: ConsumerSession, now: float) -> None:
        """Leased ranges whose hold ended go back to the pool."""
        for chunk in session.in_state(ServedState.LEASED):
            if chunk.expires <= now:
                session.advance(chunk, E.EXPIRE)
                give_back(session.pool, chunk.slot)

    def end(self, session: ConsumerSession) -> None:
        """The session ended: what waited is dropped, packs end unoffered; leased ranges stay
        held until their holds end (`held_until`)."""
        for chunk in list(session.chunks.values()):
            session.advance(chunk, E.END)

    def _forget(self, session: ConsumerSession, chunk: ServedChunk) -> None:
        if session.advance(chunk, E.FORGET) is ServedState.SETTLED and chunk.slot is not None:
            give_back(session.pool, chunk.slot)  # a leased range (a packing one: at its end)

    def _fail(self, session: ConsumerSession, chunk: ServedChunk, reason: str) -> None:
        dropped = chunk.state is ServedState.DROPPED
        session.advance(chunk, E.FAIL)
        if not dropped:  # its consumer moved on: nobody waits for the answer
            self.send(session, _failed(chunk.ask, reason))


def _misfit(request: PublishedRequest, ask: TransferRequest) -> str:
    """Why the ask's tokens do not fit the published request ("" when they do)."""
    if ask.num_tokens == request.num_tokens and (
        request.first_token <= ask.token_start < ask.token_end <= request.num_tokens
    ):
        return ""
    held = f"tokens [{request.first_token}, {request.num_tokens})"
    window = (
        " (a sliding window: the earlier blocks were dropped)"
        if request.first_token and ask.token_start < request.first_token
        else ""
    )
    return (
        f"tokens [{ask.token_start}, {ask.token_end}) of {ask.num_tokens} do not fit the "
        f"published {held}{window}"
    )


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


def _failed(ask: TransferRequest, reason: str) -> ChunkFailed:
    return ChunkFailed(request_id=ask.request_id, chunk_id=ask.chunk_id, reason=reason)
