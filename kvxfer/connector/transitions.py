"""A state machine's table of legal moves, written state by state, and looking a move up in it
(the consumer's chunks, `kvxfer.connector.consumer.states`; the producer's served chunks,
`kvxfer.connector.producer.states`; the vLLM decode side's remote engines,
`kvxfer.integrations.vllm.connections`)."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import TypeVar

State = TypeVar("State", bound=enum.Enum)
Event = TypeVar("Event", bound=enum.Enum)


class IllegalTransition(RuntimeError):
    """A move a transition table does not list: a bug in the connector, never a peer's fault
    (peers' messages are checked against the states they may move before they move one)."""


def moves_table(
    exits: Mapping[State, Mapping[Event, State]],
) -> dict[tuple[State, Event], State]:
    """A table written state by state (each state's events and where they lead) as the
    `(state, event) -> next state` mapping that `look_up` reads."""
    return {
        (state, event): after for state, moves in exits.items() for event, after in moves.items()
    }


def look_up(
    table: Mapping[tuple[State, Event], State], state: State, event: Event, what: str
) -> State:
    """The state `event` moves `what` in `state` to, from `table`.

    Raises:
        IllegalTransition: the table lists no such move.
    """
    try:
        return table[state, event]
    except KeyError:
        raise IllegalTransition(
            f"{what} in state {state.value!r} cannot take event {event.value!r}"
        ) from None
