"""The consumer's chunk state machine, without sockets: the transition table (every legal move,
every illegal one raising, the table in the module's docstring being the table in its code),
a fetch's bookkeeping of each move, and the `FetchMachine` driving chunks through their states
with stand-ins for the sessions, the transport and the copier (each step run by hand)."""

from __future__ import annotations

import itertools
import time
from concurrent.futures import Future

import numpy as np
import pytest
from helpers import TransitionTableCases

from kvxfer.connector.consumer import FetchHandle
from kvxfer.connector.consumer import states as states_mod
from kvxfer.connector.consumer.fetches import Chunk, Fetch
from kvxfer.connector.consumer.machine import FetchMachine
from kvxfer.connector.consumer.sessions import ProducerSession, SessionState
from kvxfer.connector.consumer.states import (
    ChunkEvent,
    ChunkState,
    IllegalTransition,
    accepts,
    next_state,
)
from kvxfer.connector.messages import (
    Abort,
    ChunkFailed,
    ChunkRead,
    ChunkReady,
    ChunkValid,
    KVTerms,
    RegionInfo,
    StagingRead,
    TransferRequest,
)
from kvxfer.connector.staging import StagingPool
from kvxfer.connector.stats import TransferStats
from kvxfer.plan import plan_pairs
from kvxfer.plan.cost import Chunking, CostModel
from kvxfer.plan.fitting import FittedPair
from kvxfer.testing import side_specs
from kvxfer.transport.base import Region

S, E = ChunkState, ChunkEvent

# Every legal move, event by event: event -> {state: next state}.
LEGAL = {
    E.ASK: {S.QUEUED: S.ASKED},
    E.OFFERED: {S.ASKED: S.READY},
    E.READ: {S.READY: S.READING},
    E.LANDED: {S.READING: S.CONFIRMING},
    E.CONFIRMED: {S.CONFIRMING: S.COPYING},
    E.REQUEUE: dict.fromkeys((S.ASKED, S.READY, S.READING, S.CONFIRMING), S.QUEUED),
    E.COPIED: {S.COPYING: S.DONE},
    E.COPY_FAILED: {S.COPYING: S.FAILED},
    E.FAIL: {
        **dict.fromkeys((S.QUEUED, S.ASKED, S.READY, S.READING, S.CONFIRMING, S.FAILED), S.FAILED),
        S.COPYING: S.COPYING,
        S.DONE: S.DONE,
    },
}


class TestChunkTable(TransitionTableCases):
    module = states_mod
    states, events = ChunkState, ChunkEvent
    legal = LEGAL


def test_a_failure_while_copying_waits_for_the_copy():
    # Nothing stops a copy half way: a chunk given up on while copying stays copying, and its
    # copy's end settles it either way.
    assert next_state(S.COPYING, E.FAIL) is S.COPYING
    assert next_state(S.COPYING, E.COPIED) is S.DONE
    assert next_state(S.COPYING, E.COPY_FAILED) is S.FAILED
    # copy_failed is the copy's own outcome: no other state takes it (the old code set
    # "confirming" so that a failure would be accepted).
    assert [s for s in ChunkState if accepts(s, E.COPY_FAILED)] == [S.COPYING]


def test_settled_states_take_only_a_failure_and_stay():
    for state in (S.DONE, S.FAILED):
        assert state.settled and not state.active
        assert [e for e in ChunkEvent if accepts(state, e)] == [E.FAIL]
        assert next_state(state, E.FAIL) is state


def test_active_states_are_those_between_the_ask_and_the_settling():
    assert {s for s in ChunkState if s.active} == {
        S.ASKED,
        S.READY,
        S.READING,
        S.CONFIRMING,
        S.COPYING,
    }
    assert not S.QUEUED.active and not S.QUEUED.settled


# ---- a fetch's bookkeeping ------------------------------------------------------------------

SRC = side_specs(1, heads=4, block_size=16, num_blocks=40)
DST = side_specs(1, heads=4, block_size=32, layout="HND", num_blocks=40)
SLOT_BYTES = 16 << 10  # 64 tokens of this geometry's wire buffer


def fitted(chunk_tokens: int = 32, depth: int = 2, strategy: str = "pack+unpack") -> FittedPair:
    (plan,) = plan_pairs(SRC, DST, strategy=strategy, landing=True)
    return FittedPair(plan, Chunking(chunk_tokens, depth), SRC[0], DST[0], CostModel(), 64)


def new_fetch(num_tokens: int = 128, timeout: float = 60.0) -> Fetch:
    now = time.monotonic()
    blocks = np.arange(-(-num_tokens // DST[0].block_size), dtype=np.int64)
    return Fetch(FetchHandle("req", lambda: None), blocks, num_tokens, 0, now + timeout, now)


def test_cut_queues_every_chunk_in_token_order():
    fetch = new_fetch(128)
    chunks = fetch.cut([fitted(32)], itertools.count(7))
    assert [(c.start, c.end) for c in chunks] == [(0, 32), (32, 64), (64, 96), (96, 128)]
    assert [c.chunk_id for c in chunks] == [7, 8, 9, 10]
    assert all(c.state is S.QUEUED for c in chunks)
    assert list(fetch.queued[0]) == chunks and fetch.active == {0: 0}
    assert fetch.unsettled == 4 and fetch.handle.chunks_total == 4


def test_advance_keeps_the_counts_of_every_move():
    fetch = new_fetch(64)
    first, second = fetch.cut([fitted(32)], itertools.count())
    for event, active, unsettled in [
        (E.ASK, 1, 2),
        (E.OFFERED, 1, 2),
        (E.READ, 1, 2),
        (E.LANDED, 1, 2),
        (E.CONFIRMED, 1, 2),
        (E.FAIL, 1, 2),  # copying: no move
        (E.COPIED, 0, 1),
        (E.FAIL, 0, 1),  # done: no move
    ]:
        fetch.advance(first, event)
        assert (fetch.active[0], fetch.unsettled) == (active, unsettled), event
    assert first.state is S.DONE
    fetch.advance(second, E.FAIL)
    assert second.state is S.FAILED and fetch.unsettled == 0 and fetch.active[0] == 0


def test_an_illegal_move_raises_and_changes_nothing():
    fetch = new_fetch(64)
    chunk, _ = fetch.cut([fitted(32)], itertools.count())
    with pytest.raises(IllegalTransition):
        fetch.advance(chunk, E.COPIED)
    assert chunk.state is S.QUEUED and fetch.unsettled == 2 and fetch.active[0] == 0
    with pytest.raises(AttributeError):
        chunk.state = S.DONE  # type: ignore[misc]  # only `advance` moves a chunk


def test_a_requeued_chunk_goes_back_in_token_order():
    fetch = new_fetch(128)
    chunks = fetch.cut([fitted(32)], itertools.count())
    queue = fetch.queued[0]
    for chunk in chunks[:2]:
        queue.popleft()
        fetch.advance(chunk, E.ASK)
    assert fetch.active[0] == 2
    fetch.advance(chunks[1], E.REQUEUE)
    fetch.advance(chunks[0], E.REQUEUE)
    assert list(fetch.queued[0]) == chunks and fetch.active[0] == 0


# ---- the machine, with stand-ins ------------------------------------------------------------


class FakeTransport:
    """Registers memory as itself; every read is a future the test settles."""

    kind = "mooncake"

    def __init__(self) -> None:
        self.reads: list[Future[None]] = []
        self._ids = itertools.count()

    def register(self, tensor):
        return Region(next(self._ids), tensor.data_ptr(), tensor.numel() * tensor.element_size())

    def unregister(self, region) -> None:
        pass

    def read(self, segments, peer) -> Future[None]:
        assert len(segments) > 0 and peer.endpoint == "127.0.0.1:1"
        self.reads.append(Future())
        return self.reads[-1]


class FakeCopier:
    """Every copy is a future the test settles."""

    def __init__(self) -> None:
        self.copies: list[Future[None]] = []

    def start(self, copy, pool, slot, fence) -> Future[None]:
        assert copy is not None and pool.size(slot) > 0  # a held range
        self.copies.append(Future())
        return self.copies[-1]


class FakeSessions:
    """A live session per producer rank (replaceable); what was sent, and the notices."""

    def __init__(self) -> None:
        self.session = live_session()
        self.sent: list[tuple[ProducerSession, object]] = []
        self.notices: list[object] = []
        self.finished: list[str] = []  # reported done (batched by the real sessions)
        self.reported: list[str] = []  # of those, the ones whose batch went out

    def session_for(self, rank, since):
        return self.session

    def send(self, session, message) -> None:
        self.sent.append((session, message))

    def notify_all(self, message) -> None:
        self.notices.append(message)

    def done(self, request_id) -> None:
        self.finished.append(request_id)

    def report_done(self) -> None:
        self.reported = list(self.finished)

    def messages(self, kind):
        return [m for _, m in self.sent if isinstance(m, kind)]


def live_session() -> ProducerSession:
    spec = SRC[0]
    regions = [
        RegionInfo(layer, 0x10000 * (layer + 1), spec.layer_extent_bytes)
        for layer in range(spec.num_layers)
    ]
    session = ProducerSession("tcp://producer", None, None, None, 0.0)  # type: ignore[arg-type]
    session.take_terms(
        KVTerms("prefill", spec, "127.0.0.1:1", regions, SLOT_BYTES), FakeTransport()
    )  # type: ignore[arg-type]
    session.state = SessionState.LIVE
    return session


class Rig:
    """A `FetchMachine` of one pair (1 -> 1, pack+unpack: read from the producer's staging; or
    unpack: read from its cache), with every outside part a stand-in, and one fetch of it
    started."""

    def __init__(
        self, num_tokens=64, chunk_tokens=32, depth=2, slots=2, timeout=60.0, strategy="pack+unpack"
    ):
        self.staged = strategy == "pack+unpack"
        self.transport, self.copier = FakeTransport(), FakeCopier()
        self.pool = StagingPool(self.transport, SLOT_BYTES * slots, slots)  # type: ignore[arg-type]
        self.posted: list = []
        self.sessions = FakeSessions()
        self.machine = FetchMachine(
            DST[0],
            {0: self.pool},
            self.transport,  # type: ignore[arg-type]
            self.copier,  # type: ignore[arg-type]
            TransferStats(),
            self.posted.append,
        )
        self.machine.sessions = self.sessions  # type: ignore[assignment]
        self.fetch = new_fetch(num_tokens, timeout)
        self.machine.start(self.fetch, [fitted(chunk_tokens, depth, strategy)])
        self.chunks = self.fetch.chunks

    def run_posted(self) -> None:
        posted, self.posted[:] = list(self.posted), []
        for event in posted:
            event()

    def offer(self, chunk: Chunk, session=None, held_seconds=60.0) -> None:
        """The producer's `ChunkReady`: its staging, held `held_seconds` from the ask; or its
        cache blocks of the chunk's tokens."""
        if self.staged:
            staging = RegionInfo(99, 0x900000, SLOT_BYTES)
            ready = ChunkReady("req", chunk.chunk_id, 1, [], staging, held_seconds)
        else:
            block = SRC[0].block_size
            blocks = list(range(chunk.start // block, -(-chunk.end // block)))
            ready = ChunkReady("req", chunk.chunk_id, 1, blocks, None)
        self.machine.answer(session or self.sessions.session, ready)

    def settle(self, future: Future[None], error: Exception | None = None) -> None:
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)
        self.run_posted()

    def confirm(self, chunk: Chunk, ok: bool = True) -> None:
        valid = ChunkValid("req", chunk.chunk_id, ok, "" if ok else "overwritten")
        self.machine.answer(self.sessions.session, valid)

    def to_copying(self, chunk: Chunk, read: int = 0) -> None:
        self.offer(chunk)
        self.settle(self.transport.reads[read])
        if not self.staged:
            self.confirm(chunk)
        assert chunk.state is S.COPYING

    def result(self):
        assert self.fetch.handle.done()
        return self.fetch.handle.future.result()


def test_a_chunk_read_from_staging_goes_ask_offer_read_copy_done():
    """Its hold, timed from before the ask, confirms the read: no round trip after it."""
    rig = Rig(num_tokens=32)
    (chunk,) = rig.chunks
    (ask,) = rig.sessions.messages(TransferRequest)
    assert (ask.chunk_id, ask.token_start, ask.token_end) == (chunk.chunk_id, 0, 32)
    assert chunk.state is S.ASKED and rig.pool.free_slots == 2  # no slot before the answer
    assert 0 < chunk.asked_at <= time.monotonic()
    rig.offer(chunk)
    assert chunk.state is S.READING and rig.pool.free_slots == 1
    rig.settle(rig.transport.reads[0])
    assert chunk.state is S.COPYING and not rig.fetch.handle.done()
    # Nothing asked of the producer, and its range is given back by the RequestsDone to come
    assert rig.sessions.messages(ChunkRead) == rig.sessions.messages(StagingRead) == []
    rig.settle(rig.copier.copies[0])
    assert chunk.state is S.DONE and rig.pool.free_slots == 2
    assert rig.result().ok
    assert rig.sessions.finished == ["req"] and rig.sessions.notices == []
    assert rig.sessions.reported == ["req"]  # the last fetch in flight: reported at once


def test_a_chunk_read_from_the_cache_is_confirmed_before_its_copy():
    """Only the producer knows whether its engine let the blocks go meanwhile."""
    rig = Rig(num_tokens=32, strategy="unpack")
    (chunk,) = rig.chunks
    rig.offer(chunk)
    assert chunk.state is S.READING and rig.pool.free_slots == 1
    rig.settle(rig.transport.reads[0])
    assert chunk.state is S.CONFIRMING
    (read,) = rig.sessions.messages(ChunkRead)
    assert read.chunk_id == chunk.chunk_id and read.generation == 1
    assert rig.copier.copies == []
    rig.confirm(chunk)
    assert chunk.state is S.COPYING and not rig.fetch.handle.done()
    rig.settle(rig.copier.copies[0])
    assert chunk.state is S.DONE and rig.pool.free_slots == 2
    result = rig.result()
    assert result.ok and result.failed_block_ids == [] and result.bytes > 0
    assert rig.sessions.finished == ["req"] and rig.sessions.notices == []
    assert rig.fetch.handle.chunks_done == 1 and rig.machine.fetches == []


def test_a_fetch_given_up_during_a_copy_ends_when_the_copy_does():
    rig = Rig(num_tokens=64)  # two chunks, both asked (depth 2)
    copying, asked = rig.chunks
    rig.to_copying(copying)
    rig.machine.abort("req")
    assert copying.state is S.COPYING and asked.state is S.FAILED
    assert not rig.fetch.handle.done()  # the copy still writes the cache: not reported yet
    assert rig.sessions.notices == [Abort(request_id="req")]
    rig.settle(rig.copier.copies[0])
    assert copying.state is S.DONE
    result = rig.result()
    assert not result.ok
    assert result.failed_block_ids == [1]  # the asked chunk's block (32 tokens a block) only
    assert result.errors == ["tokens [32, 64): aborted"]
    assert rig.pool.free_slots == 2


def test_a_copy_that_fails_fails_its_chunk_and_frees_its_slot():
    rig = Rig(num_tokens=32)
    (chunk,) = rig.chunks
    rig.to_copying(chunk)
    rig.machine.shutdown()  # given up on while copying: no move
    assert chunk.state is S.COPYING and rig.machine.copying()
    rig.settle(rig.copier.copies[0], RuntimeError("device lost"))
    assert chunk.state is S.FAILED and not rig.machine.copying()
    result = rig.result()
    assert not result.ok and result.failed_block_ids == [0]
    assert result.errors == ["tokens [0, 32): copy into the cache failed: device lost"]
    assert rig.pool.free_slots == 2


def test_a_chunk_given_up_while_reading_keeps_its_slot_until_the_read_settles():
    rig = Rig(num_tokens=32)
    (chunk,) = rig.chunks
    rig.offer(chunk)
    rig.fetch.handle.cancelled.set()
    rig.machine.tick(time.monotonic())
    assert chunk.state is S.FAILED and rig.result().errors == ["tokens [0, 32): fetch cancelled"]
    assert rig.machine.quarantine == {chunk} and rig.pool.free_slots == 1  # it may still land
    rig.settle(rig.transport.reads[0])  # landed late, into the quarantined slot
    assert rig.machine.quarantine == set() and rig.pool.free_slots == 2
    assert rig.copier.copies == []  # nothing of it is copied
    assert rig.sessions.messages(ChunkRead) == rig.sessions.messages(StagingRead) == []


def test_a_failed_read_and_a_refused_source_fail_their_chunks():
    rig = Rig(num_tokens=64, strategy="unpack")
    first, second = rig.chunks
    rig.offer(first)
    rig.settle(rig.transport.reads[0], OSError("link down"))
    rig.offer(second)
    rig.settle(rig.transport.reads[1])
    rig.confirm(second, ok=False)
    assert first.state is S.FAILED and second.state is S.FAILED
    assert rig.result().errors == [
        "tokens [0, 32): read failed: link down",
        "tokens [32, 64): producer rank 0: overwritten",
    ]
    assert rig.pool.free_slots == 2 and rig.copier.copies == []


def test_a_staging_read_that_outlasted_its_hold_fails_its_chunk():
    """The producer may have packed another chunk into the range by then: nothing of the read
    reaches the cache, and the slot is free again."""
    rig = Rig(num_tokens=32)
    (chunk,) = rig.chunks
    rig.offer(chunk, held_seconds=0.5)
    chunk.asked_at -= 1.0  # the ask left a second ago: the hold ended half a second ago
    rig.settle(rig.transport.reads[0])
    assert chunk.state is S.FAILED and rig.copier.copies == []
    assert rig.result().errors == [
        "tokens [0, 32): the read outlasted the producer's hold of its staging (0.5 s from the ask)"
    ]
    assert rig.pool.free_slots == 2


def test_a_staging_range_read_before_the_last_chunk_is_given_back_at_once():
    """More chunks to come: the producer may pack one of them into the range now. The last
    chunk's range goes back with the fetch's RequestsDone."""
    rig = Rig(num_tokens=64)
    first, second = rig.chunks
    rig.offer(first)
    rig.settle(rig.transport.reads[0])
    assert rig.sessions.messages(StagingRead) == [StagingRead("req", first.chunk_id)]
    rig.settle(rig.copier.copies[0])
    rig.offer(second)
    rig.settle(rig.transport.reads[1])
    assert rig.sessions.messages(StagingRead) == [StagingRead("req", first.chunk_id)]
    rig.settle(rig.copier.copies[1])
    assert rig.result().ok and rig.sessions.finished == ["req"]


def test_a_read_waiting_for_room_is_not_passed_by_a_later_one():
    """Reads take room in the order they came to wait for it: room that comes free without a
    turn of the machine (here, released outside it) goes to the first in line, not to a chunk
    answered after it."""
    rig = Rig(num_tokens=64)  # two chunks of 32 tokens: half a slot each
    first, second = rig.chunks
    held = [rig.pool.try_acquire(), rig.pool.try_acquire(SLOT_BYTES * 3 // 4)]
    rig.offer(first)  # a quarter of a slot free: it waits
    assert first.state is S.READY and first.slot is None
    rig.pool.release(held.pop())  # now room for one chunk, and no turn has run
    rig.offer(second)
    assert second.state is S.READY and second.slot is None  # behind the first
    assert len(rig.transport.reads) == 0
    rig.machine.tick(time.monotonic())  # a sweep: the line moves, in order
    assert first.state is S.READING and second.state is S.READING
    assert rig.pool.offset(first.slot) < rig.pool.offset(second.slot)


def test_a_read_that_fails_while_first_in_line_lets_the_next_one_in():
    """The next in line may be another fetch's: the failure moves it on at once, not at the
    next sweep."""
    rig = Rig(num_tokens=32)  # one chunk of half a slot
    other = new_fetch(32)
    rig.machine.start(other, [fitted(32, 2)])
    (first,), (second,) = rig.chunks, other.chunks
    rig.pool.try_acquire()
    held = rig.pool.try_acquire(SLOT_BYTES // 2)
    rig.pool.try_acquire(SLOT_BYTES // 4)  # a quarter of a slot free
    rig.offer(first)
    rig.offer(second)
    assert (first.slot, second.slot) == (None, None)  # both wait, the first ahead
    rig.pool.release(held)  # room for one chunk
    failed = ChunkFailed("req", first.chunk_id, "the request was already released")
    rig.machine.answer(rig.sessions.session, failed)
    rig.machine.tick(time.monotonic(), sweep=False)  # only what the failure stirred
    assert first.state is S.FAILED and second.state is S.READING


def test_a_forgotten_session_asks_again_for_the_chunks_it_had_not_served():
    rig = Rig(num_tokens=96, depth=2)
    reading, ready, queued = rig.chunks
    # Staging busy elsewhere but for one chunk's room (32 tokens: half a slot), so the second
    # offer waits for room
    rig.pool.try_acquire()
    rig.pool.try_acquire(SLOT_BYTES // 2)
    rig.offer(reading)
    rig.offer(ready)
    assert (reading.state, ready.state, queued.state) == (S.READING, S.READY, S.QUEUED)
    old = rig.sessions.session
    rig.machine.session_forgotten(old)
    assert reading.state is S.READING  # being read: its answer stays valid
    assert ready.state is S.QUEUED and ready.session is None and ready.ready is None
    assert list(rig.fetch.queued[0]) == [ready, queued]
    rig.sessions.session = live_session()  # the producer's new session
    rig.machine.tick(time.monotonic())
    asks = rig.sessions.messages(TransferRequest)
    assert [a.chunk_id for a in asks] == [c.chunk_id for c in (reading, ready)] + [ready.chunk_id]
    assert ready.state is S.ASKED and ready.session is rig.sessions.session
    assert queued.state is S.QUEUED  # depth 2: the reading chunk and the one asked again


def test_answers_the_chunk_does_not_wait_for_are_dropped():
    rig = Rig(num_tokens=32)
    (chunk,) = rig.chunks
    rig.confirm(chunk)  # a ChunkValid before any read
    rig.offer(chunk, session=live_session())  # another session's answer
    assert chunk.state is S.ASKED and rig.transport.reads == []
    rig.offer(chunk)
    rig.offer(chunk)  # repeated
    assert chunk.state is S.READING and len(rig.transport.reads) == 1
    rig.machine.answer(rig.sessions.session, ChunkFailed("req", chunk.chunk_id + 1, "who?"))
    assert chunk.state is S.READING


def test_a_dead_session_fails_its_chunks_with_the_reason():
    rig = Rig(num_tokens=64)
    first, second = rig.chunks
    rig.machine.session_ended(rig.sessions.session, "silent for 2.1 s: presumed dead")
    assert first.state is S.FAILED and second.state is S.FAILED
    assert rig.result().failed_block_ids == [0, 1]
    assert rig.result().errors[0] == (
        "tokens [0, 32): producer tcp://producer silent for 2.1 s: presumed dead"
    )
