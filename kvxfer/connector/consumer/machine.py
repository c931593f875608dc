"""`FetchMachine`: drives every fetch's chunks through their states, on the consumer's loop.

For every chunk (`kvxfer.connector.consumer.states` has the table of states and events):

    ask -> producer answers ChunkReady -> read into own staging -> source held throughout?
        -> copy staging into the cache (locally) -> done

The cache is written only by that last local copy, after the read has fully landed and the
source is known to have been held throughout: a chunk read from the producer's staging by its
hold (`ChunkReady.held_seconds`, timed here from before the ask, so it ends on this clock no
later than on the producer's), a chunk read from the producer's cache by one more round trip
(`ChunkRead` -> `ChunkValid`: only the producer knows whether its engine let the blocks go).
A read that a fetch gives up on lands, if ever, in a staging slot that stays out of use
(quarantined) until the transport says the read has settled. Hence the no-late-byte
contract: once `wait` returned, or a block was reported failed, nothing of the fetch lands in
the cache (docs/connectors.md, "No late bytes").

Up to a pair's depth (at most `staging_slots`) chunks per producer rank are in flight at once,
each in its own slot, so the producer packs chunk i+1 while chunk i is read and chunk i-1 is
copied into the cache. Every method runs on the loop thread; reads complete on the transport's
thread and copies on the copier's, and both post their outcome back to the loop.
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future

from kvxfer.connector.consumer.copies import CacheCopier
from kvxfer.connector.consumer.fetches import Chunk, Fetch
from kvxfer.connector.consumer.results import TransferResult
from kvxfer.connector.consumer.sessions import ProducerSession, ProducerSessions, SessionState
from kvxfer.connector.consumer.states import ChunkEvent, ChunkState, accepts
from kvxfer.connector.messages import (
    Abort,
    ChunkFailed,
    ChunkRead,
    ChunkReady,
    ChunkValid,
    Message,
    StagingRead,
    TransferRequest,
)
from kvxfer.connector.staging import StagingPool
from kvxfer.connector.stats import TransferRecord, TransferStats
from kvxfer.connector.timeline import mark
from kvxfer.plan.fitting import FittedPair
from kvxfer.plan.paged import STAGING_REGION, blocks_of_tokens
from kvxfer.plan.reads import chunk_read_program, landing_bytes
from kvxfer.spec import KVCacheSpec
from kvxfer.transport.base import Transport

log = logging.getLogger(__name__)

# How far two hosts' monotonic clocks may run apart, as a share of the time measured: twice
# the most that NTP slews a clock (500 ppm). A staging hold is trusted that much shorter.
_CLOCK_DRIFT = 1e-3


class FetchMachine:
    """Every running fetch of one decode rank, and the chunks' moves (a `SessionListener`).

    Args:
        spec: this rank's geometry.
        pools: this rank's staging pool per producer rank (created at `connect`).
        transport: reads the chunks into the pools.
        copier: copies read chunks into the cache.
        stats: records every finished fetch.
        post: runs a callable on the loop thread (for the transport's and the copier's
            completions).
    """

    def __init__(
        self,
        spec: KVCacheSpec,
        pools: Mapping[int, StagingPool],
        transport: Transport,
        copier: CacheCopier,
        stats: TransferStats,
        post: Callable[[Callable[[], None]], None],
    ) -> None:
        self._spec, self._pools, self._transport = spec, pools, transport
        self._copier, self._stats, self._post = copier, stats, post
        self.sessions: ProducerSessions | None = None  # set by the consumer, once made
        self.fetches: list[Fetch] = []  # not finished
        self.quarantine: set[Chunk] = set()  # failed chunks whose reads have not settled
        self._chunk_ids = itertools.count()
        self._chunks: dict[int, Chunk] = {}  # chunks not done or failed, by chunk id
        # A turn moves on the fetches an event may have unblocked, not every fetch: looking at
        # each fetch in flight every turn made a turn O(fetches), a batch of them O(fetches^2).
        self._stirred: dict[Fetch, None] = {}  # insertion-ordered set
        self._waiting_for_slot: dict[Fetch, None] = {}  # fetches with chunks in fetch.waiting
        # Per producer rank, the ready chunks waiting for room in its pool, in the order they
        # came to wait: a read takes room only when no earlier one waits (chunks take what they
        # need, so short reads would otherwise pass a slot-sized one until its deadline).
        self._read_lines: dict[int, collections.deque[Chunk]] = {}
        self._sweep_asked = False  # a rare event wants every fetch looked at this turn

    # ---- what the consumer asks ----------------------------------------------------------

    def start(self, fetch: Fetch, pairs: list[FittedPair]) -> None:
        """Cut `fetch` into chunks of `pairs` and start asking for them."""
        # Chunk ids are unique in this consumer's life, so a late answer meant for an earlier
        # fetch of the same request can never pass for one of this fetch.
        self._chunks.update((c.chunk_id, c) for c in fetch.cut(pairs, self._chunk_ids))
        self.fetches.append(fetch)
        self._send_ready(fetch)
        self._finish_if_done(fetch)

    def tick(self, now: float, sweep: bool = True) -> None:
        """(each loop turn) Move on the fetches an event stirred since the last turn. On a
        sweep (`sweep`: the loop's short tick came round; or a rare event asked for one, see
        `ask_sweep`) every fetch: give up on cancelled and late ones, move the others on."""
        if sweep or self._sweep_asked:
            self._sweep_asked = False
            fetches = list(self.fetches)
        else:
            fetches = [f for f in self._stirred if not f.handle.done()]
        self._stirred.clear()
        for fetch in fetches:
            if fetch.handle.cancelled.is_set() or now >= fetch.deadline:
                why = "cancelled" if fetch.handle.cancelled.is_set() else "timed out"
                self._abandon(fetch, f"fetch {why}")
            else:
                self._send_ready(fetch)
            self._finish_if_done(fetch)

    def postpone(self, seconds: float) -> None:
        """Move every fetch's deadline `seconds` later: the loop was not run that long (a
        fetch's timeout counts the time this rank could move it)."""
        for fetch in self.fetches:
            fetch.deadline += seconds

    def ask_sweep(self) -> None:
        """Look at every fetch on the next turn, not only the stirred ones: for the rare
        events that no chunk's move announces (a fetch cancelled, a handshake awaited)."""
        self._sweep_asked = True

    def abort(self, request_id: str) -> None:
        """Abandon the fetches of `request_id` here; tell every producer to free it."""
        for fetch in self.fetches:
            if fetch.request_id == request_id:
                self._abandon(fetch, "aborted")
        self._sessions().notify_all(Abort(request_id=request_id))

    def shutdown(self) -> None:
        """Fail every running fetch (the consumer closes)."""
        for fetch in list(self.fetches):
            self._abandon(fetch, "the consumer closed")

    def copying(self) -> bool:
        """Whether a copy into the cache is still in flight (it finishes by itself)."""
        return any(c.state is ChunkState.COPYING for f in self.fetches for c in f.chunks)

    # ---- what the sessions tell (SessionListener) ----------------------------------------

    def session_ended(self, session: ProducerSession, why: str) -> None:
        """Fail every chunk asked on `session` (but those whose read, under way, settles
        first on a lost session: `_on_read_settled` asks them again)."""
        for fetch in list(self.fetches):
            for chunk in fetch.chunks:
                if chunk.session is not session:
                    continue
                if not (session.lost and chunk.state is ChunkState.READING):
                    self._fail(chunk, f"producer {session.address} {why}")

    def session_forgotten(self, session: ProducerSession) -> None:
        """The session was lost (the producer forgot it, or its connection dropped): chunks
        not in the cache yet ask again on a new session, those reading once the read settled."""
        for fetch in self.fetches:
            for chunk in fetch.chunks:
                if chunk.session is not session or chunk.state is ChunkState.READING:
                    continue
                if accepts(chunk.state, ChunkEvent.REQUEUE):
                    self._requeue(chunk)

    def _requeue(self, chunk: Chunk) -> None:
        """Ask for `chunk` again, from scratch: its slot (no read in it) is free again."""
        self._release_slot(chunk)
        chunk.session, chunk.ready, chunk.unpack = None, None, None
        self._advance(chunk, ChunkEvent.REQUEUE)

    def answer(self, session: ProducerSession, message: Message) -> None:
        """A producer's answer about one chunk; answers the chunk no longer waits for (late,
        repeated, or overtaken by a failure) are dropped."""
        if not isinstance(message, ChunkReady | ChunkValid | ChunkFailed):
            return
        chunk = self._chunk(session, message.request_id, message.chunk_id)
        if chunk is None:
            return  # a chunk given up on: its answer is too late
        if isinstance(message, ChunkFailed):
            self._fail(chunk, f"producer rank {session.rank}: {message.reason}")
        elif isinstance(message, ChunkReady) and accepts(chunk.state, ChunkEvent.OFFERED):
            chunk.ready = message
            self._advance(chunk, ChunkEvent.OFFERED)
            self._start_read(chunk)
        elif isinstance(message, ChunkValid) and accepts(chunk.state, ChunkEvent.CONFIRMED):
            if message.ok:
                self._start_copy(chunk)
            else:
                self._fail(chunk, f"producer rank {session.rank}: {message.reason}")

    # ---- the moves -----------------------------------------------------------------------

    def _advance(self, chunk: Chunk, event: ChunkEvent) -> ChunkState:
        state = chunk.fetch.advance(chunk, event)
        if state.settled:
            self._chunks.pop(chunk.chunk_id, None)
        elif state is ChunkState.QUEUED:  # to be asked again
            self._stirred[chunk.fetch] = None
        return state

    def _chunk(self, session: ProducerSession, request_id: str, chunk_id: int) -> Chunk | None:
        """The live chunk an answer is for: asked on this session, of this request."""
        chunk = self._chunks.get(chunk_id)
        if chunk is None or chunk.session is not session or chunk.fetch.request_id != request_id:
            return None
        return chunk

    def _send_ready(self, fetch: Fetch) -> None:
        """Ask for queued chunks, at most the pair's depth (`staging_slots` at most) at a time
        per producer rank, and start the reads of ready chunks once a slot is free. O(chunks
        it moves on), never O(the fetch's chunks)."""
        if fetch.waiting:
            waiting, fetch.waiting = fetch.waiting, []
            for chunk in waiting:
                if chunk.state is ChunkState.READY and chunk.slot is None:
                    self._start_read(chunk)
        sessions = self._sessions()
        for pair in fetch.pairs:
            rank = pair.src_rank
            queue = fetch.queued[rank]
            limit = fetch.ask_limit(pair)
            while queue and fetch.active[rank] < limit:
                chunk = queue[0]
                if chunk.state is not ChunkState.QUEUED:  # failed while it waited
                    queue.popleft()
                    continue
                session = sessions.session_for(rank, fetch.began)
                if isinstance(session, str):
                    queue.popleft()
                    self._fail(chunk, session)
                    continue
                if session is None:
                    self._sweep_asked = True  # until the handshake ends (rare)
                    break  # shaking hands again
                queue.popleft()
                self._ask(chunk, session)

    def _ask(self, chunk: Chunk, session: ProducerSession) -> None:
        fetch = chunk.fetch
        chunk.session = session
        chunk.asked_at = time.monotonic()  # before the ask leaves: a hold ends no later here
        self._advance(chunk, ChunkEvent.ASK)
        ask = TransferRequest(
            request_id=fetch.request_id,
            chunk_id=chunk.chunk_id,
            num_tokens=fetch.num_tokens,
            token_start=chunk.start,
            token_end=chunk.end,
            layer_start=chunk.layer_start,
            layer_end=chunk.layer_end,
            strategy=chunk.pair.plan.strategy,
            wait_seconds=max(0.0, fetch.deadline - time.monotonic()),
        )
        self._sessions().send(session, ask)

    def _start_read(self, chunk: Chunk) -> None:
        """Read a ready chunk into staging, if the pool has room for it (else it waits, ready)."""
        session, ready = chunk.session, chunk.ready
        assert session is not None and session.spec is not None and ready is not None
        pool = self._pools[chunk.pair.src_rank]
        try:
            src_ids = None if ready.staging is not None else ready.src_block_ids
            program = chunk_read_program(
                chunk.route,
                chunk.pair.plan.strategy,
                session.spec,
                self._spec,
                chunk.fetch.block_ids,
                chunk.start,
                chunk.end,
                src_ids,
            )
            chunk.slot = self._room_for(chunk, pool, landing_bytes(program, self._spec.num_layers))
        except Exception as exc:
            self._fail(chunk, f"cannot read from producer rank {session.rank}: {exc}")
            return
        if chunk.slot is None:
            chunk.fetch.waiting.append(chunk)
            self._waiting_for_slot[chunk.fetch] = None
            return  # the pool is full of reads and copies: room comes free soon
        try:
            dst_places = {STAGING_REGION: (pool.region.region_id, pool.offset(chunk.slot))}
            segments = program.segments.with_regions(session.src_places, dst_places)
            future = self._transport.read(segments, session.source(ready.staging))
        except Exception as exc:
            self._fail(chunk, f"cannot read from producer rank {session.rank}: {exc}")
            return
        chunk.unpack = program.unpack
        chunk.nbytes, chunk.num_ops = segments.nbytes, len(segments)
        chunk.read_pending = True
        self._advance(chunk, ChunkEvent.READ)

        # The callback keeps the pool alive while the read may still land in it.
        def settled(done: Future[None], pool: StagingPool = pool) -> None:
            self._post(lambda: self._on_read_settled(chunk, done, pool))

        future.add_done_callback(settled)

    def _room_for(self, chunk: Chunk, pool: StagingPool, nbytes: int) -> int | None:
        """A range of `nbytes` in `pool` for the chunk's read, or None: the chunk then waits in
        its producer rank's line, and takes room only once every chunk ahead of it did."""
        line = self._read_lines.setdefault(chunk.pair.src_rank, collections.deque())
        while line and not _waits_for_room(line[0]):  # failed or asked again meanwhile
            line.popleft()
        if line and line[0] is not chunk:
            if chunk not in line:
                line.append(chunk)
            return None
        slot = pool.try_acquire(nbytes)
        if slot is None:
            if not line:
                line.append(chunk)
            return None
        if line:  # it was first in line: the next one may fit too, on the next turn
            line.popleft()
            self._stirred.update(self._waiting_for_slot)
            self._waiting_for_slot.clear()
            self._post(_nothing)  # a turn now, not at the next event or tick
        return slot

    def _on_read_settled(self, chunk: Chunk, future: Future[None], pool: StagingPool) -> None:
        chunk.read_pending = False
        error = future.exception()
        if chunk.state is not ChunkState.READING:  # given up on while reading: freed now
            self.quarantine.discard(chunk)
            self._release_slot(chunk)
            return
        if chunk.session is not None and chunk.session.lost:
            self._requeue(chunk)  # its session was lost meanwhile: the read tells nothing
            return
        if error is not None:
            self._fail(chunk, f"read failed: {error}")
            return
        session = chunk.session
        if session is None or session.state is not SessionState.LIVE:
            self._fail(chunk, "the producer's session ended before the read was confirmed")
            return
        ready = chunk.ready
        assert ready is not None
        self._advance(chunk, ChunkEvent.LANDED)
        if ready.staging is None:  # read from the cache: did the engine hold the blocks?
            read = ChunkRead(ready.request_id, chunk.chunk_id, ready.generation)
            self._sessions().send(session, read)
            return
        # Read from staging: only the producer reuses staging, and it holds the range for
        # `held_seconds` after the ask arrived, so a read settled within that (timed from
        # before the ask) read what was packed. No round trip.
        if time.monotonic() - chunk.asked_at > ready.held_seconds * (1 - _CLOCK_DRIFT):
            held = f"{ready.held_seconds:.1f} s from the ask"
            self._fail(chunk, f"the read outlasted the producer's hold of its staging ({held})")
            return
        if chunk.fetch.unsettled > 1:  # more chunks to come: the range may take one of them
            self._sessions().send(session, StagingRead(ready.request_id, chunk.chunk_id))
        self._start_copy(chunk)

    def _start_copy(self, chunk: Chunk) -> None:
        self._advance(chunk, ChunkEvent.CONFIRMED)
        assert chunk.unpack is not None and chunk.slot is not None
        pool = self._pools[chunk.pair.src_rank]
        future = self._copier.start(chunk.unpack, pool, chunk.slot, chunk.fetch.fence)
        if future.done():  # a small CPU copy ran on this thread: no turn to wait for
            self._on_copied(chunk, future)
        else:
            future.add_done_callback(lambda f: self._post(lambda: self._on_copied(chunk, f)))

    def _on_copied(self, chunk: Chunk, future: Future[None]) -> None:
        error = future.exception()
        if error is not None:
            self._advance(chunk, ChunkEvent.COPY_FAILED)
            self._failed(chunk, f"copy into the cache failed: {error}")
            return
        self._advance(chunk, ChunkEvent.COPIED)
        self._release_slot(chunk)
        chunk.fetch.handle.chunks_done += 1
        self._move_on(chunk.fetch)

    def _fail(self, chunk: Chunk, why: str) -> None:
        """Give up on `chunk`, unless it is settled, or copying (the copy settles it)."""
        was = chunk.state
        if self._advance(chunk, ChunkEvent.FAIL) is not was:
            self._failed(chunk, why)

    def _failed(self, chunk: Chunk, why: str) -> None:
        """What a chunk that just failed leaves: its error, its slot (quarantined while a read
        may still land in it), and perhaps the end of its fetch."""
        chunk.fetch.errors.append(f"tokens [{chunk.start}, {chunk.end}): {why}")
        self._stirred[chunk.fetch] = None  # its successors are asked next turn
        line = self._read_lines.get(chunk.pair.src_rank)
        if chunk.slot is None and line and chunk in line:  # the reads behind it move up
            line.remove(chunk)
            self._stirred.update(self._waiting_for_slot)
        if chunk.read_pending:  # the slot stays out of use until the read settles
            self.quarantine.add(chunk)
        else:
            self._release_slot(chunk)
        self._finish_if_done(chunk.fetch)

    def _move_on(self, fetch: Fetch) -> None:
        """A chunk of `fetch` landed in the cache and freed its place in flight and its slot:
        ask for the next chunks and start the reads that waited for a slot now, not at the
        next tick (a fetch of many chunks would otherwise wait up to a tick per chunk), or
        finish. (A failed chunk leaves its successors to the tick: an abandoned fetch fails
        its chunks one by one and must not ask for the next meanwhile.)"""
        if fetch in self.fetches and not fetch.handle.done():
            self._send_ready(fetch)
        self._finish_if_done(fetch)

    def _release_slot(self, chunk: Chunk) -> None:
        if chunk.slot is not None:
            self._pools[chunk.pair.src_rank].release(chunk.slot)
            chunk.slot = None
            # A read that waited for a slot (of any fetch) may start now
            self._stirred.update(self._waiting_for_slot)
            self._waiting_for_slot.clear()

    def _abandon(self, fetch: Fetch, why: str) -> None:
        for chunk in fetch.chunks:
            self._fail(chunk, why)

    def _finish_if_done(self, fetch: Fetch) -> None:
        if fetch.handle.done() or fetch.unsettled:
            return
        self.fetches.remove(fetch)
        failed = fetch.chunks_in(ChunkState.FAILED)
        self._sessions().done(fetch.request_id)
        result = self._result(fetch, failed)
        if not result.ok:
            log.warning(
                "fetch %s failed, %d blocks to recompute: %s",
                fetch.request_id,
                len(result.failed_block_ids),
                "; ".join(fetch.errors[:3]),
            )
        self._stats.record(
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
        if not self.fetches:
            # Nothing in flight for a batch to stay out of the way of: tell the producers now,
            # so the report does not land in the next fetch (benchmarks/latency.py: a done batch
            # flushed during the next 16-token fetch cost it about 1 ms on 2 cores).
            self._sessions().report_done()

    def _result(self, fetch: Fetch, failed: list[Chunk]) -> TransferResult:
        block_size = self._spec.block_size
        failed_ids = {
            block
            for chunk in failed
            for block in blocks_of_tokens(fetch.block_ids, block_size, chunk.start, chunk.end)
        }
        done = fetch.chunks_in(ChunkState.DONE)
        mark(fetch.timeline, "fetch_done")
        return TransferResult(
            ok=not failed,
            failed_block_ids=sorted(failed_ids),
            bytes=sum(c.nbytes for c in done),
            num_ops=sum(c.num_ops for c in done),
            strategy=",".join(sorted({p.plan.strategy for p in fetch.pairs})),
            seconds=time.monotonic() - fetch.began,
            errors=fetch.errors,
            timeline=dict(fetch.timeline),
        )

    def _sessions(self) -> ProducerSessions:
        assert self.sessions is not None, "FetchMachine.sessions is set by the consumer"
        return self.sessions


def _waits_for_room(chunk: Chunk) -> bool:
    """Whether a chunk in a read line still waits for staging (ready, no range yet)."""
    return chunk.state is ChunkState.READY and chunk.slot is None


def _nothing() -> None:
    """Posted to wake the loop for a turn."""
