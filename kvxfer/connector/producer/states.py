"""The states of a chunk a producer serves, the events that move it, and the one table of moves.

A consumer rank asks for a chunk (`TransferRequest`); from then on its session keeps a
`ServedChunk` until the producer holds nothing of it any more. Nothing changes a served chunk's
state except `next_state` (through `ConsumerSession.advance`), which looks the move up in
`TRANSITIONS` and raises `IllegalTransition` for any move the table does not list:

    state    event -> next state
    -------  -------------------------------------------------------------------------------
    waiting  pack -> packing  offer -> settled  fail -> settled  forget -> settled  end -> settled
    packing  packed -> leased  fail -> settled  forget -> dropped  end -> dropped
    dropped  packed -> settled  fail -> settled
    leased   read -> settled  expire -> settled  forget -> settled  end -> leased (stays)

The states:
- waiting: asked; its request is not published yet, or its tokens are not computed;
- packing: its pack into the session's staging waits for room or runs (on the session's
  worker, or inline on the side channel when small);
- dropped: packing, but its consumer is done with the request (or the session ended): the
  range goes back to the pool once the pack ends, and nothing is offered;
- leased: packed and offered (`ChunkReady` with its staging range): the range is its
  consumer's until the hold that answer promised ends, or until the consumer gives it back;
- settled: the producer holds nothing of it (the record is gone).

The events:
- pack: its request is servable and the strategy packs: a pack is on its way;
- offer: its request is servable and the consumer reads from the cache: `ChunkReady` with the
  chunk's blocks went out. The read is confirmed against the request table (`ChunkRead` ->
  `ChunkValid`), which needs no chunk state, so the chunk settles at once;
- packed: the pack ended and the request still holds those blocks;
- read: the consumer read the range (`StagingRead`);
- expire: the hold ended;
- forget: the consumer is done with the request (`RequestsDone`, `Abort`), or asked for the
  same chunk again (its newest ask stands);
- end: the session ended (silent too long, or the producer closing);
- fail: answered `ChunkFailed` (refused, not published or computed in time, the request
  released or its prefill failed, the pack raised).

Two rules the table makes explicit:
- a pack cannot be stopped half way, and it writes the session's staging: a chunk packing when
  its consumer moves on is dropped, not settled, and its range is freed once the pack ends;
- a session that ends keeps its leased ranges untouched until their holds end: its consumer
  may be frozen, not dead, and read them later (`KVProducer`'s `session_timeout_s`).
"""

from __future__ import annotations

import enum

from kvxfer.connector.transitions import IllegalTransition, look_up, moves_table

__all__ = ["TRANSITIONS", "IllegalTransition", "ServedEvent", "ServedState", "next_state"]


class ServedState(enum.Enum):
    """Where one served chunk stands (the module's table)."""

    WAITING = "waiting"
    PACKING = "packing"
    DROPPED = "dropped"
    LEASED = "leased"
    SETTLED = "settled"


class ServedEvent(enum.Enum):
    """What happens to a served chunk (the module's table)."""

    PACK = "pack"
    OFFER = "offer"
    PACKED = "packed"
    READ = "read"
    EXPIRE = "expire"
    FORGET = "forget"
    END = "end"
    FAIL = "fail"


S, E = ServedState, ServedEvent
TRANSITIONS: dict[tuple[ServedState, ServedEvent], ServedState] = moves_table(
    {
        # Whatever else happens to a chunk not packed yet settles it.
        S.WAITING: {
            E.PACK: S.PACKING,
            **dict.fromkeys((E.OFFER, E.FAIL, E.FORGET, E.END), S.SETTLED),
        },
        S.PACKING: {E.PACKED: S.LEASED, E.FAIL: S.SETTLED, E.FORGET: S.DROPPED, E.END: S.DROPPED},
        S.DROPPED: {E.PACKED: S.SETTLED, E.FAIL: S.SETTLED},
        # An end keeps the lease: its consumer may still read, held until the hold ends.
        S.LEASED: {E.READ: S.SETTLED, E.EXPIRE: S.SETTLED, E.FORGET: S.SETTLED, E.END: S.LEASED},
    }
)
"""Every legal move: (state, event) -> the next state (the module's table)."""
del S, E


def next_state(state: ServedState, event: ServedEvent) -> ServedState:
    """The state `event` moves a served chunk in `state` to.

    Raises:
        IllegalTransition: the table lists no such move.
    """
    return look_up(TRANSITIONS, state, event, "a served chunk")
