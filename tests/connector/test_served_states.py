"""The producer's served-chunk state machine, without sockets: the transition table (every
legal move, every illegal one raising, the table in the module's docstring being the table in
its code), and a session's bookkeeping of each move (`ConsumerSession.advance`)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import TransitionTableCases, first_tokens_ask

from kvxfer.connector.producer import states
from kvxfer.connector.producer.sessions import ConsumerSession, ServedChunk
from kvxfer.connector.producer.states import ServedEvent, ServedState
from kvxfer.testing.geometry import Geometry

S, E = ServedState, ServedEvent

# Every legal move, event by event: event -> {state: next state}.
LEGAL = {
    E.PACK: {S.WAITING: S.PACKING},
    E.PACKED: {S.PACKING: S.LEASED, S.DROPPED: S.SETTLED},
    E.OFFER: {S.WAITING: S.SETTLED},
    E.READ: {S.LEASED: S.SETTLED},
    E.EXPIRE: {S.LEASED: S.SETTLED},
    E.FAIL: dict.fromkeys((S.WAITING, S.PACKING, S.DROPPED), S.SETTLED),
    E.FORGET: {S.WAITING: S.SETTLED, S.PACKING: S.DROPPED, S.LEASED: S.SETTLED},
    E.END: {S.WAITING: S.SETTLED, S.PACKING: S.DROPPED, S.LEASED: S.LEASED},
}


class TestServedTable(TransitionTableCases):
    module = states
    states, events = ServedState, ServedEvent
    legal = LEGAL


def test_a_pack_under_way_is_never_cut_short():
    # The pack writes the session's staging until it ends: whatever happens meanwhile, only
    # its end (packed, or its failure) settles it.
    for event in (E.FORGET, E.END):
        assert states.next_state(S.PACKING, event) is S.DROPPED
    assert {e for e in ServedEvent if (S.DROPPED, e) in states.TRANSITIONS} == {E.PACKED, E.FAIL}


def test_a_leased_range_outlives_its_session():
    assert states.next_state(S.LEASED, E.END) is S.LEASED
    assert states.next_state(S.LEASED, E.EXPIRE) is S.SETTLED


# ---- a session's bookkeeping ---------------------------------------------------------------


def _session() -> ConsumerSession:
    dst = Geometry(tp=1, heads=2, block_size=32, layout="HND", layers=2, head_dim=64, num_blocks=4)
    return ConsumerSession("s", "decode", dst.spec(0), None, ThreadPoolExecutor(1))


def _chunk(chunk_id: int, request_id: str = "r") -> ServedChunk:
    ask = first_tokens_ask(request_id, chunk_id, layers=1, strategy="pack", wait_seconds=5.0)
    return ServedChunk(ask, 0.0, 5.0)


def test_advance_counts_each_state_and_a_settled_chunk_leaves():
    session = _session()
    chunks = [_chunk(i) for i in range(3)]
    for chunk in chunks:
        assert session.add(chunk) is None
    assert session.counts[S.WAITING] == 3
    session.advance(chunks[0], E.PACK)
    session.advance(chunks[0], E.PACKED)
    chunks[0].expires = 9.0
    session.advance(chunks[1], E.OFFER)
    assert session.counts[S.WAITING] == 1 and session.counts[S.LEASED] == 1
    assert session.in_state(S.WAITING) == [chunks[2]]
    assert list(session.chunks.values()) == [chunks[0], chunks[2]]  # the offered one left
    assert session.held_until() == 9.0
    session.advance(chunks[0], E.READ)
    assert session.held_until() == 0.0 and session.counts[S.LEASED] == 0
    with pytest.raises(states.IllegalTransition):
        session.advance(chunks[2], E.PACKED)


def test_a_chunk_asked_again_replaces_the_first_ask():
    # The first ask's record, packing, is handed back for the caller to forget (dropped: its
    # range goes back when its pack ends); it settles without touching the newer record.
    session = _session()
    first, again = _chunk(0), _chunk(0)
    session.add(first)
    session.advance(first, E.PACK)
    assert session.add(again) is first
    session.advance(first, E.FORGET)
    assert session.chunks == {("r", 0): again}
    session.advance(first, E.PACKED)
    assert first.state is S.SETTLED and session.chunks == {("r", 0): again}
    assert session.counts[S.DROPPED] == 0 and session.counts[S.WAITING] == 1
