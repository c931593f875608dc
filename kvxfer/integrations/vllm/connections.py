"""A prefill engine a decode worker loads from, one DP rank of it: a `Remote`, whose
connection moves through an explicit state machine (`Connection`, one table of `TRANSITIONS`;
any other change raises `IllegalTransition`). `kvxfer.integrations.vllm.remotes` looks them up,
connects and retires them (its docstring has the rules).

    NEW                              --connect-->      CONNECTING
    CONNECTING                       --connected-->    CONNECTED
    CONNECTING                       --failed-->       DISCONNECTED
    CONNECTED                        --load failed-->  STALE
    CONNECTED, STALE, DISCONNECTED   --connect-->      CONNECTING
    CONNECTED, STALE, DISCONNECTED   --retire-->       RETIRED

(a failed load changes nothing in CONNECTING, STALE or DISCONNECTED).
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvxfer.connector.transitions import IllegalTransition, look_up, moves_table
from kvxfer.integrations.vllm.metadata import Route

if TYPE_CHECKING:
    from kvxfer.connector import GroupedConsumer
    from kvxfer.integrations.vllm.loads import Load

__all__ = [
    "TRANSITIONS",
    "Connection",
    "Event",
    "Fingerprint",
    "IllegalTransition",
    "Remote",
    "every_session_alive",
    "next_state",
]

log = logging.getLogger(__name__)

Fingerprint = tuple[tuple[str, str], ...]  # (address, generation) per rank, from the service


class Connection(enum.Enum):
    """Where a remote engine's connection stands."""

    NEW = "new"  # created: nothing connected, no connect in flight
    CONNECTING = "connecting"  # a look-up and connect in flight on the pool
    CONNECTED = "connected"  # its consumer serves the ranks it was connected to
    STALE = "stale"  # connected, but a load failed since: look it up again before the next
    DISCONNECTED = "disconnected"  # its last connect failed; its consumer, if any, is kept
    RETIRED = "retired"  # forgotten: replaced by another engine, or never connected


class Event(enum.Enum):
    """What happens to a remote engine's connection."""

    CONNECT = "connect"  # a connect starts
    CONNECTED = "connected"  # the connect in flight succeeded
    FAILED = "failed"  # the connect in flight failed
    LOAD_FAILED = "load failed"  # a load from the engine failed
    RETIRE = "retire"  # the engine is forgotten


_C, _E = Connection, Event
TRANSITIONS: Mapping[tuple[Connection, Event], Connection] = moves_table(
    {
        _C.NEW: {_E.CONNECT: _C.CONNECTING},
        # While a connect is in flight, its outcome decides.
        _C.CONNECTING: {
            _E.CONNECTED: _C.CONNECTED,
            _E.FAILED: _C.DISCONNECTED,
            _E.LOAD_FAILED: _C.CONNECTING,
        },
        _C.CONNECTED: {_E.CONNECT: _C.CONNECTING, _E.LOAD_FAILED: _C.STALE, _E.RETIRE: _C.RETIRED},
        _C.STALE: {_E.CONNECT: _C.CONNECTING, _E.LOAD_FAILED: _C.STALE, _E.RETIRE: _C.RETIRED},
        # A disconnected engine connects again before its next load anyway.
        _C.DISCONNECTED: {
            _E.CONNECT: _C.CONNECTING,
            _E.LOAD_FAILED: _C.DISCONNECTED,
            _E.RETIRE: _C.RETIRED,
        },
    }
)


def next_state(state: Connection, event: Event) -> Connection:
    """The state `event` moves `state` to.

    Raises:
        IllegalTransition: `TRANSITIONS` has no such change.
    """
    return look_up(TRANSITIONS, state, event, "a remote engine's connection")


@dataclass(eq=False)
class Remote:
    """One DP rank of a prefill engine this worker loads from. Only the engine's thread
    touches it, but for `aborts`; its state changes only through `TRANSITIONS`.

    Attributes:
        consumer: its `GroupedConsumer`, once a connect created one.
        connected: the ranks `consumer` is connected to, each rank's side channels
            (`rank_channels`): set while CONNECTED or STALE, kept while CONNECTING.
        route: how `connected` was found.
        fingerprint: the registrations `connected` came from (None: unknown).
        seen_at: where the engine was last connected (to retire engines it replaced).
        connecting: the route of the connect in flight (CONNECTING only).
        waiting: loads waiting for the connect in flight.
        aborts: aborts waiting for a connect, with their routes: the connect's task sends
            them (the pool's threads touch them: guarded by `_aborts_lock`).
    """

    engine_id: str
    dp_rank: int | None  # None: the engine id's only DP rank, found through the bootstrap
    consumer: GroupedConsumer | None = None
    connected: tuple[str, ...] | None = None
    route: Route | None = None
    fingerprint: Fingerprint | None = None
    seen_at: tuple[str, ...] = ()
    connecting: Route | None = None
    waiting: list[Load] = field(default_factory=list)
    aborts: list[tuple[Route, str]] = field(default_factory=list)
    _state: Connection = field(default=Connection.NEW, init=False)
    _aborts_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    @property
    def state(self) -> Connection:
        """Where its connection stands (changed by the methods below, through the table)."""
        return self._state

    @property
    def key(self) -> tuple[str, int | None]:
        """(engine id, DP rank)."""
        return self.engine_id, self.dp_rank

    def __str__(self) -> str:
        rank = "its DP rank" if self.dp_rank is None else f"DP rank {self.dp_rank}"
        return f"{self.engine_id} ({rank})"

    def ready(self, route: Route) -> bool:
        """Whether its consumer serves `route` as it is, with no connect in flight: for fixed
        addresses, connected to them; for a bootstrap route, connected to what it found there,
        no load failed since and no producer rank lost (a restarted worker registers new
        ports: look it up again first)."""
        if self.state not in (Connection.CONNECTED, Connection.STALE):
            return False
        if route.bootstrap is None:
            return self.connected == route.addresses
        return (
            self.state is Connection.CONNECTED
            and self.route == route
            and every_session_alive(self.consumer)
        )

    def start_connect(self, route: Route) -> None:
        """A connect along `route` starts."""
        self._move(Event.CONNECT)
        self.connecting = route

    def on_connected(
        self,
        route: Route,
        addresses: tuple[str, ...],
        fingerprint: Fingerprint | None,
        consumer: GroupedConsumer | None,
    ) -> None:
        """The connect in flight connected `consumer` to `addresses` (found along `route`,
        from the registrations `fingerprint` when it looked them up)."""
        self._move(Event.CONNECTED)
        self.connecting, self.connected = None, addresses
        if self.seen_at and self.seen_at != addresses:
            log.info(
                "kvxfer: engine %s is now at %s (was %s): connected again",
                self,
                ", ".join(addresses),
                ", ".join(self.seen_at),
            )
        self.consumer, self.seen_at, self.route = consumer, addresses, route
        if fingerprint is not None:
            self.fingerprint = fingerprint
        elif self.fingerprint and tuple(a for a, _ in self.fingerprint) != addresses:
            self.fingerprint = None  # connected elsewhere: its registrations unknown

    def on_failed(self) -> None:
        """The connect in flight failed."""
        self._move(Event.FAILED)
        self.connecting, self.connected = None, None

    def load_failed(self) -> None:
        """A load from this engine failed: look it up again before the next one."""
        self._move(Event.LOAD_FAILED)

    def retire(self) -> None:
        """Forget the engine."""
        self._move(Event.RETIRE)

    def add_abort(self, route: Route, remote_request_id: str) -> None:
        """An abort to send once connected along `route`."""
        with self._aborts_lock:
            self.aborts.append((route, remote_request_id))

    def take_aborts(self, route: Route) -> list[str]:
        """Remove and return the aborts waiting for a connect along `route`."""
        with self._aborts_lock:
            mine = [rid for where, rid in self.aborts if where == route]
            self.aborts = [(where, rid) for where, rid in self.aborts if where != route]
        return mine

    def next_route(self) -> Route | None:
        """The route of the next connect that something waits for: the last waiting load's,
        else the last waiting abort's (None: nothing waits)."""
        if self.waiting:
            return self.waiting[-1].route
        with self._aborts_lock:
            return self.aborts[-1][0] if self.aborts else None

    def _move(self, event: Event) -> None:
        try:
            self._state = next_state(self._state, event)
        except IllegalTransition as exc:
            raise IllegalTransition(f"kvxfer: engine {self}: {exc}") from None


def every_session_alive(consumer: GroupedConsumer | None) -> bool:
    """Whether `consumer` has lost no producer rank in any group (a dead session: the rank
    went silent or restarted). Its monitoring snapshots take no lock and make no call."""
    if consumer is None:
        return False
    try:
        return consumer.dead_sessions() == 0
    except Exception:  # a snapshot taken while the consumer changes: look up again
        return False
