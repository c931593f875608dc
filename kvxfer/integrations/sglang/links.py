"""A decode rank's link to one prefill DP group (every rank of it, one `GroupedConsumer`): a
`GroupLink`, whose state moves only through one table of `TRANSITIONS` (any other move raises
`IllegalTransition`). The manager's decode side (`kvxfer.integrations.sglang.manager.decode`)
keeps one per group it reads, under its lock:

    state        event -> next state
    -----------  ------------------------------------------------------------------
    registering  answered -> connecting  refused -> failed
    connecting   connected -> connected  failed -> failed
    failed       retry -> registering

The states:
- registering: `Register` went to every rank of the group; their `Registered` answers arrive;
- connecting: every rank answered; the consumer's handshake runs (off the scheduler's thread);
- connected: the consumer serves the group's requests, for as long as the engine runs;
- failed: a rank refused the registration, or the handshake failed: the group's requests fail
  with that error until the next request registers again.

The events:
- answered: the last rank's `Registered` (naming this registration's nonce) came;
- refused: a rank answered `Refused`. A refusal is unsigned (a decode without the secret must
  learn that it was refused), so it counts only while the group registers: once every rank
  answered, signed, no refusal moves the link;
- connected, failed: the handshake ended;
- retry: a request met the failed link: it registers again (a restarted prefill engine is met
  by the next request; the failed ones reported the error).

Requests aborted before the link connected are kept (`early_aborts`) and told to the producers
once it did, so they free those pages at once rather than at their deadline.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvxfer.connector.transitions import IllegalTransition, look_up, moves_table

if TYPE_CHECKING:
    from kvxfer.connector import GroupedConsumer

__all__ = [
    "TRANSITIONS",
    "GroupLink",
    "IllegalTransition",
    "LinkEvent",
    "LinkState",
    "accepts",
    "next_state",
]


class LinkState(enum.Enum):
    """Where a decode rank's link to a prefill DP group stands (the module's table)."""

    REGISTERING = "registering"
    CONNECTING = "connecting"
    CONNECTED = "connected"
    FAILED = "failed"


class LinkEvent(enum.Enum):
    """What happens to a link (the module's table)."""

    ANSWERED = "answered"
    REFUSED = "refused"
    CONNECTED = "connected"
    FAILED = "failed"
    RETRY = "retry"


_S, _E = LinkState, LinkEvent
TRANSITIONS: Mapping[tuple[LinkState, LinkEvent], LinkState] = moves_table(
    {
        _S.REGISTERING: {_E.ANSWERED: _S.CONNECTING, _E.REFUSED: _S.FAILED},
        _S.CONNECTING: {_E.CONNECTED: _S.CONNECTED, _E.FAILED: _S.FAILED},
        _S.FAILED: {_E.RETRY: _S.REGISTERING},
    }
)
"""Every legal move: (state, event) -> the next state (the module's table)."""


def accepts(state: LinkState, event: LinkEvent) -> bool:
    """Whether a link in `state` takes `event` (a peer's message that it does not take is
    dropped, not an error)."""
    return (state, event) in TRANSITIONS


def next_state(state: LinkState, event: LinkEvent) -> LinkState:
    """The state `event` moves a link in `state` to.

    Raises:
        IllegalTransition: the table lists no such move.
    """
    return look_up(TRANSITIONS, state, event, "a prefill group's link")


@dataclass(eq=False)
class GroupLink:
    """A decode rank's link to one prefill DP group (the module's table). Its owner guards it
    with one lock; nothing here blocks.

    Attributes:
        ranks: how many ranks the group has (each answers the registration).
        nonce: the registration's nonce, which every answer must name.
        answers: each rank's side channels (one a cache group), by rank, as they came.
        consumer: the group's consumer (connected).
        error: why the link failed (failed).
        early_aborts: requests aborted before the link connected.
    """

    ranks: int
    nonce: str
    state: LinkState = LinkState.REGISTERING
    answers: dict[int, list[str]] = field(default_factory=dict)
    consumer: GroupedConsumer | None = None
    error: Exception | None = None
    early_aborts: set[int] = field(default_factory=set)

    def advance(self, event: LinkEvent) -> LinkState:
        """Move the link by `event` (`next_state`)."""
        self.state = next_state(self.state, event)
        return self.state

    def expects(self, nonce: str) -> bool:
        """Whether an answer naming `nonce` is one this link waits for."""
        return self.state is LinkState.REGISTERING and nonce == self.nonce

    def answer(self, rank: int, addresses: list[str]) -> bool:
        """Record rank `rank`'s side channels (an answer the link `expects`); whether that was
        the last answer (the link is then connecting)."""
        self.answers[rank] = addresses
        if len(self.answers) < self.ranks:
            return False
        self.advance(LinkEvent.ANSWERED)
        return True

    def side_channels(self) -> list[list[str]]:
        """Every rank's side channels, in rank order (connecting)."""
        return [self.answers[rank] for rank in sorted(self.answers)]

    def refuse(self, error: Exception) -> bool:
        """A rank refused the registration: whether the link takes it (it fails with
        `error`)."""
        if not accepts(self.state, LinkEvent.REFUSED):
            return False
        self.advance(LinkEvent.REFUSED)
        self.error = error
        return True

    def connected(self, consumer: GroupedConsumer) -> set[int]:
        """The handshake succeeded: the requests aborted meanwhile, for the producers."""
        self.advance(LinkEvent.CONNECTED)
        self.consumer = consumer
        aborted, self.early_aborts = self.early_aborts, set()
        return aborted

    def failed(self, error: Exception) -> None:
        """The handshake failed with `error`."""
        self.advance(LinkEvent.FAILED)
        self.error = error

    def retry(self, ranks: int, nonce: str) -> None:
        """Register again, from scratch, under a new nonce."""
        self.advance(LinkEvent.RETRY)
        self.ranks, self.nonce, self.error = ranks, nonce, None
        self.answers.clear()
        self.early_aborts.clear()

    def outcome(self) -> GroupedConsumer | Exception | None:
        """The consumer (connected), the error (failed), or None while joining."""
        if self.state is LinkState.CONNECTED:
            return self.consumer
        if self.state is LinkState.FAILED:
            return self.error
        return None

    def abort_early(self, room: int) -> bool:
        """Keep an aborted request for the producers while joining; whether it was kept."""
        if self.state in (LinkState.REGISTERING, LinkState.CONNECTING):
            self.early_aborts.add(room)
            return True
        return False
