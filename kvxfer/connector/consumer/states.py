"""The states of a fetch's chunks, the events that move them, and the one table of moves.

Every chunk of a fetch goes through these states; nothing changes a chunk's state except
`next_state` (through `Fetch.advance`), which looks the move up in `TRANSITIONS` and raises
`IllegalTransition` for any move the table does not list:

    state        event -> next state
    -----------  --------------------------------------------------------------------
    queued       ask -> asked                                  fail -> failed
    asked        offered -> ready       requeue -> queued      fail -> failed
    ready        read -> reading        requeue -> queued      fail -> failed
    reading      landed -> confirming   requeue -> queued      fail -> failed
    confirming   confirmed -> copying   requeue -> queued      fail -> failed
    copying      copied -> done         copy_failed -> failed  fail -> copying (stays)
    done                                                       fail -> done (stays)
    failed                                                     fail -> failed (stays)

The states:
- queued: not asked for yet (or asked again: see requeue);
- asked: a `TransferRequest` went out; the producer waits for the request's publish, packs;
- ready: the producer answered `ChunkReady`; the chunk waits for a staging slot (slots are
  taken only now, so requests that are never published hold none);
- reading: a read is in flight into the slot;
- confirming: the read landed; whether its source was held throughout is being checked (a
  chunk read from the producer's staging passes through at once: the hold that `ChunkReady`
  promised covers the read or not; one read from the producer's cache sent `ChunkRead`);
- copying: the source was held (the staging hold, or `ChunkValid`); the slot is copied into
  the cache, locally;
- done: the chunk is in the cache; failed: it never will be (its blocks are reported failed).

The events:
- ask: a live session took the chunk's `TransferRequest`;
- offered: its `ChunkReady` came;
- read: a staging slot was free and the read started;
- landed: the read settled without error while the session was live;
- confirmed: the read settled within the staging hold, or `ChunkValid(ok=True)` came;
- copied, copy_failed: the local copy into the cache finished, or raised;
- requeue: the session was lost before the chunk reached the cache (the producer forgot it,
  or its connection dropped: `sessions`): nothing of it is in the cache (reads land in a
  staging slot), so it is asked for again on a new session. A chunk whose read is under way
  is requeued once the read settled (its slot is not free before);
- fail: given up on (timeout, cancel, abort, the producer's refusal or death, a bad answer, a
  failed read, the consumer closing).

Two rules the table makes explicit:
- fail while copying changes nothing: the local copy finishes by itself, soon, and then the
  chunk is done (copied) or failed (copy_failed). Nothing can stop a copy half way, and a chunk
  reported failed must not be written afterwards, so the chunk is not reported until its copy
  is over;
- fail of a settled chunk (done or failed) changes nothing: a fetch that gives up fails every
  chunk it has, finished or not.
"""

from __future__ import annotations

import enum

from kvxfer.connector.transitions import IllegalTransition, look_up, moves_table

__all__ = [
    "TRANSITIONS",
    "ChunkEvent",
    "ChunkState",
    "IllegalTransition",
    "accepts",
    "next_state",
]


class ChunkState(enum.Enum):
    """Where one chunk of a fetch stands (the module's table)."""

    QUEUED = "queued"
    ASKED = "asked"
    READY = "ready"
    READING = "reading"
    CONFIRMING = "confirming"
    COPYING = "copying"
    DONE = "done"
    FAILED = "failed"

    @property
    def active(self) -> bool:
        """Counted against the pair's chunks in flight (its depth): asked and not settled."""
        return self in _ACTIVE

    @property
    def settled(self) -> bool:
        """Done or failed: nothing moves it any more."""
        return self in _SETTLED


class ChunkEvent(enum.Enum):
    """What happens to a chunk (the module's table)."""

    ASK = "ask"
    OFFERED = "offered"
    READ = "read"
    LANDED = "landed"
    CONFIRMED = "confirmed"
    COPIED = "copied"
    COPY_FAILED = "copy_failed"
    REQUEUE = "requeue"
    FAIL = "fail"


_ACTIVE = frozenset(
    {
        ChunkState.ASKED,
        ChunkState.READY,
        ChunkState.READING,
        ChunkState.CONFIRMING,
        ChunkState.COPYING,
    }
)
_SETTLED = frozenset({ChunkState.DONE, ChunkState.FAILED})

S, E = ChunkState, ChunkEvent
TRANSITIONS: dict[tuple[ChunkState, ChunkEvent], ChunkState] = moves_table(
    {
        S.QUEUED: {E.ASK: S.ASKED, E.FAIL: S.FAILED},
        S.ASKED: {E.OFFERED: S.READY, E.REQUEUE: S.QUEUED, E.FAIL: S.FAILED},
        S.READY: {E.READ: S.READING, E.REQUEUE: S.QUEUED, E.FAIL: S.FAILED},
        S.READING: {E.LANDED: S.CONFIRMING, E.REQUEUE: S.QUEUED, E.FAIL: S.FAILED},
        S.CONFIRMING: {E.CONFIRMED: S.COPYING, E.REQUEUE: S.QUEUED, E.FAIL: S.FAILED},
        # A fail leaves a copy running: it finishes by itself, copied or copy_failed.
        S.COPYING: {E.COPIED: S.DONE, E.COPY_FAILED: S.FAILED, E.FAIL: S.COPYING},
        S.DONE: {E.FAIL: S.DONE},  # a fetch that gives up fails all its chunks
        S.FAILED: {E.FAIL: S.FAILED},
    }
)
"""Every legal move: (state, event) -> the next state (the module's table)."""
del S, E


def accepts(state: ChunkState, event: ChunkEvent) -> bool:
    """Whether `event` is a legal move from `state`."""
    return (state, event) in TRANSITIONS


def next_state(state: ChunkState, event: ChunkEvent) -> ChunkState:
    """The state `event` moves a chunk in `state` to.

    Raises:
        IllegalTransition: the table lists no such move.
    """
    return look_up(TRANSITIONS, state, event, "a chunk")
