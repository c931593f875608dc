"""The prefill engines a decode worker loads from: a `Remote` per DP rank of a prefill engine,
whose connection moves through an explicit state machine (`Connection`, one table of
`TRANSITIONS`; any other change raises `IllegalTransition`), and `RemoteEngines`, which looks
them up and connects them off the engine's thread.

    NEW                              --connect-->      CONNECTING
    CONNECTING                       --connected-->    CONNECTED
    CONNECTING                       --failed-->       DISCONNECTED
    CONNECTED                        --load failed-->  STALE
    CONNECTED, STALE, DISCONNECTED   --connect-->      CONNECTING
    CONNECTED, STALE, DISCONNECTED   --retire-->       RETIRED

(a failed load changes nothing in CONNECTING, STALE or DISCONNECTED).

- Connecting runs on the worker's thread pool, one task per remote engine while it connects:
  looking its ranks up in its bootstrap service, then creating and connecting its
  `GroupedConsumer` (a handshake, up to `handshake_timeout_s`). That engine's loads wait for it
  (`Remote.waiting`); others go on. The task hands its outcome over a queue and the engine's
  thread applies it (`RemoteEngines.take_connects`): the engine's thread owns every `Remote`;
  a lock of its own guards only the aborts that wait for a connect (`Remote.aborts`).
- A failed connect fails the loads that waited for it with all their blocks; the next load
  connects again (DISCONNECTED keeps its consumer for that).
- A load is fetched at once when its remote is ready for its route (`Remote.ready`). A load
  naming other fixed addresses than its engine's consumer is connected to connects again
  first; an engine that restarts at the same addresses is found again by the consumer itself.
  An engine found through its bootstrap service is looked up again before a load when its
  consumer lost a producer rank (a restart: new ports, registered under a new generation) or
  when a load from it failed since (STALE); the consumer connects again only if the
  registrations changed.
- An engine found where other engines were connected retires them (RETIRED): they restarted
  under a new engine id (vLLM's default), so nothing of theirs comes back. A remote that never
  connected, whose connect failed and for which nothing waits, is forgotten (RETIRED) too.
- Aborts that wait for a connect are sent by the connect's task itself, the moment it is
  connected: the decode engine may not step again, and nothing else would send them.
"""

from __future__ import annotations

import concurrent.futures
import enum
import logging
import queue
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvxfer.integrations.bootstrap import BootstrapClient
from kvxfer.integrations.vllm.metadata import RemoteEngine

if TYPE_CHECKING:
    from kvxfer.connector import GroupedConsumer
    from kvxfer.integrations.vllm.loads import Load

log = logging.getLogger(__name__)

BACKGROUND_THREADS = 32  # connects in flight at once (one per remote engine), and retirements
Fingerprint = tuple[tuple[str, str], ...]  # (address, generation) per rank, from the service
# How a remote's ranks are looked up: (bootstrap address, engine id, DP rank) -> each rank's
# side channels (`rank_channels`) and the registrations they come from.
LookUp = Callable[[str, str, int | None], tuple[tuple[str, ...], Fingerprint]]


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
TRANSITIONS: Mapping[tuple[Connection, Event], Connection] = {
    (_C.NEW, _E.CONNECT): _C.CONNECTING,
    (_C.CONNECTED, _E.CONNECT): _C.CONNECTING,
    (_C.STALE, _E.CONNECT): _C.CONNECTING,
    (_C.DISCONNECTED, _E.CONNECT): _C.CONNECTING,
    (_C.CONNECTING, _E.CONNECTED): _C.CONNECTED,
    (_C.CONNECTING, _E.FAILED): _C.DISCONNECTED,
    (_C.CONNECTED, _E.LOAD_FAILED): _C.STALE,
    (_C.STALE, _E.LOAD_FAILED): _C.STALE,
    # While a connect is in flight, its outcome decides; a disconnected engine connects again
    # before its next load anyway.
    (_C.CONNECTING, _E.LOAD_FAILED): _C.CONNECTING,
    (_C.DISCONNECTED, _E.LOAD_FAILED): _C.DISCONNECTED,
    (_C.CONNECTED, _E.RETIRE): _C.RETIRED,
    (_C.STALE, _E.RETIRE): _C.RETIRED,
    (_C.DISCONNECTED, _E.RETIRE): _C.RETIRED,
}


class IllegalTransition(RuntimeError):
    """A remote engine's connection was asked to change in a way `TRANSITIONS` does not list:
    a bug in the worker, never a network condition."""


def next_state(state: Connection, event: Event) -> Connection:
    """The state `event` moves `state` to.

    Raises:
        IllegalTransition: `TRANSITIONS` has no such change.
    """
    try:
        return TRANSITIONS[state, event]
    except KeyError:
        raise IllegalTransition(f"{event.value!r} in state {state.value!r}") from None


@dataclass(frozen=True)
class Route:
    """How a remote engine's ranks are found: through a bootstrap service (the prefill
    engine's parameters name one), or at fixed addresses (parameters that name none)."""

    bootstrap: str | None
    addresses: tuple[str, ...] = ()

    @classmethod
    def of(cls, remote: RemoteEngine) -> Route:
        """The route a request's parameters name."""
        if remote.bootstrap_addr is not None:
            return cls(remote.bootstrap_addr)
        return cls(None, remote.fixed_addresses())

    def __str__(self) -> str:
        return self.bootstrap or ", ".join(self.addresses)


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


@dataclass
class _Outcome:
    """A connect's outcome, handed from the pool to the engine's thread."""

    remote: Remote
    route: Route
    addresses: tuple[str, ...]
    fingerprint: Fingerprint | None
    consumer: GroupedConsumer | None
    error: Exception | None


class RemoteEngines:
    """The remote engines a decode worker loads from, by (engine id, DP rank), and the
    background work that connects and retires them (a thread pool; see the module's
    docstring for the rules).

    Args:
        new_consumer: creates a consumer over this worker's groups (on the pool).
        look_up: finds a remote engine's ranks through its bootstrap service (on the pool;
            `look_up_ranks` with the worker's settings).
        handshake_timeout_s: the longest one consumer's connect may take.
        thread_name_prefix: names the pool's threads.
        executor: runs the background work instead of a pool of `BACKGROUND_THREADS` threads
            (tests run it when they choose).
    """

    def __init__(
        self,
        new_consumer: Callable[[], GroupedConsumer],
        look_up: LookUp,
        handshake_timeout_s: float,
        *,
        thread_name_prefix: str = "kvxfer",
        executor: concurrent.futures.Executor | None = None,
    ) -> None:
        self._new_consumer, self._look_up = new_consumer, look_up
        self._handshake_timeout_s = handshake_timeout_s
        self._remotes: dict[tuple[str, int | None], Remote] = {}
        self._outcomes: queue.SimpleQueue[_Outcome] = queue.SimpleQueue()
        self._pool = executor or ThreadPoolExecutor(
            BACKGROUND_THREADS, thread_name_prefix=thread_name_prefix
        )
        self._tasks: list[concurrent.futures.Future[Any]] = []  # in flight
        self._spare: GroupedConsumer | None = None  # created, never connected (`_keep_spare`)

    def get(self, where: RemoteEngine) -> Remote:
        """The remote engine `where` names, created NEW if unknown."""
        key = (where.engine_id, where.dp_rank)
        remote = self._remotes.get(key)
        if remote is None:
            remote = self._remotes[key] = Remote(where.engine_id, where.dp_rank)
        return remote

    def known(self) -> list[Remote]:
        """Every remote engine known now."""
        return list(self._remotes.values())

    def load_failed(self, where: RemoteEngine) -> None:
        """A load from `where` failed: look it up again before its next load (if known)."""
        remote = self._remotes.get((where.engine_id, where.dp_rank))
        if remote is not None:
            remote.load_failed()

    def connect(self, remote: Remote, route: Route) -> None:
        """Look `remote` up along `route` and connect it, on the pool, unless a connect runs
        already (what still waits when it ends starts the next one)."""
        if remote.state is Connection.CONNECTING:
            return
        consumer = remote.consumer
        if consumer is None:
            consumer, self._spare = self._spare, None
        current = (remote.connected, remote.fingerprint)
        remote.start_connect(route)
        self._in_background(self._connect_task, remote, consumer, route, current)

    def abort(self, where: RemoteEngine, remote_request_id: str) -> None:
        """Tell the engine `where` names that vLLM gave up `remote_request_id`: at once when
        it is ready, else once connected (by the connect's task)."""
        route = Route.of(where)
        remote = self.get(where)
        if remote.ready(route):
            self.send_abort(remote, remote.consumer, remote_request_id)
        else:
            remote.add_abort(route, remote_request_id)
            self.connect(remote, route)

    def send_abort(
        self, remote: Remote, consumer: GroupedConsumer | None, remote_request_id: str
    ) -> None:
        """Send one abort through `consumer` (an engine that does not hear of it frees the
        request at its `request_timeout_s`)."""
        assert consumer is not None
        try:
            consumer.abort(remote_request_id)
        except Exception as exc:  # the engine frees the request at its request_timeout_s
            log.warning(
                "kvxfer: could not tell engine %s that %s is aborted: %s",
                remote,
                remote_request_id,
                exc,
            )

    def take_connects(
        self,
        fetch: Callable[[Remote, Load], None],
        fail: Callable[[Load, Exception], None],
    ) -> None:
        """Apply the connects that ended (on the engine's thread): `fetch` each load that
        waited for a connect that succeeded, `fail` each that waited for one that failed, send
        the aborts that came after the connect's task looked, and start the next connect for
        what still waits."""
        self._tasks = [t for t in self._tasks if not t.done()]
        while True:
            try:
                outcome = self._outcomes.get_nowait()
            except queue.Empty:
                return
            self._apply(outcome, fetch, fail)

    def close(self) -> None:
        """Wait for the connects in flight, then close every consumer."""
        # Connects end within twice handshake_timeout_s (a look-up, then a handshake).
        concurrent.futures.wait(self._tasks, timeout=2 * self._handshake_timeout_s + 5)
        self._pool.shutdown(wait=False)
        consumers = [self._spare, *(r.consumer for r in self._remotes.values())]
        self._spare = None
        while True:
            try:
                consumers.append(self._outcomes.get_nowait().consumer)
            except queue.Empty:
                break
        for consumer in consumers:
            if consumer is not None:
                consumer.close()
        self._remotes.clear()

    # ---- the engine's thread ----

    def _apply(
        self,
        outcome: _Outcome,
        fetch: Callable[[Remote, Load], None],
        fail: Callable[[Load, Exception], None],
    ) -> None:
        remote, route, consumer, error = (
            outcome.remote,
            outcome.route,
            outcome.consumer,
            outcome.error,
        )
        if error is None:
            remote.on_connected(route, outcome.addresses, outcome.fingerprint, consumer)
            self._retire_others(remote)
        else:
            remote.on_failed()
            if remote.consumer is None and consumer is not None:
                self._keep_spare(consumer)
            log.warning("kvxfer: cannot connect to engine %s at %s: %s", remote, route, error)
        waiting, remote.waiting = remote.waiting, []
        for load in waiting:
            if load.route != route:
                remote.waiting.append(load)  # its engine moved again meanwhile
            elif error is None:
                fetch(remote, load)
            else:
                fail(load, error)
        # The connect's task sent the aborts it found; these came after it looked (or its
        # connect failed: dropped, the prefill engine frees at its request_timeout_s).
        late = remote.take_aborts(route)
        for remote_request_id in late if error is None else []:
            self.send_abort(remote, consumer, remote_request_id)
        again = remote.next_route()
        if again is not None:
            self.connect(remote, again)
        elif remote.consumer is None:  # never connected: keep nothing
            remote.retire()
            del self._remotes[remote.key]

    def _keep_spare(self, consumer: GroupedConsumer) -> None:
        """Keep a consumer whose first connect failed for the next remote engine: destroying
        a Mooncake engine stalls the whole process for about a second (it holds the GIL), so
        a decode engine pointed at a dead prefill engine must not create and destroy one per
        load. At most one is kept."""
        if self._spare is None:
            self._spare = consumer
        else:
            self._in_background(consumer.close)

    def _retire_others(self, remote: Remote) -> None:
        """Retire the engines that were where `remote` now is, closing their consumers: they
        restarted under a new engine id (vLLM's default), so nothing of theirs comes back."""
        for other in list(self._remotes.values()):
            if other is remote or other.state is Connection.CONNECTING or other.waiting:
                continue
            if set(other.seen_at) & set(remote.seen_at):
                other.retire()
                del self._remotes[other.key]
                log.info(
                    "kvxfer: engine %s replaced engine %s at %s",
                    remote,
                    other,
                    ", ".join(remote.seen_at),
                )
                if other.consumer is not None:  # fails its fetches still running, if any
                    self._in_background(other.consumer.close)

    def _in_background(self, target: Callable[..., Any], *args: Any) -> None:
        self._tasks.append(self._pool.submit(target, *args))

    # ---- the pool's threads ----

    def _connect_task(
        self,
        remote: Remote,
        consumer: GroupedConsumer | None,
        route: Route,
        current: tuple[tuple[str, ...] | None, Fingerprint | None],
    ) -> None:
        """Find `remote`'s ranks along `route` (its bootstrap service), then connect
        `consumer` (created first if None) to them, unless it is connected to them already
        (`current`: its addresses, and the registrations they came from, if known: a new
        generation at the same addresses is a restart, connected again); hand the outcome to
        the engine's thread, which owns `remote`."""
        addresses, fingerprint, error = route.addresses, None, None
        connected, known = current
        try:
            if route.bootstrap is not None:
                addresses, fingerprint = self._look_up(
                    route.bootstrap, remote.engine_id, remote.dp_rank
                )
            if consumer is None:
                consumer = self._new_consumer()
            same = fingerprint is None or known is None or fingerprint == known
            if connected != addresses or not same:
                consumer.connect(
                    [split_channels(a) for a in addresses], timeout=self._handshake_timeout_s
                )
            self._send_aborts_along(remote, route, consumer)
        except Exception as exc:
            error = exc
        self._outcomes.put(_Outcome(remote, route, addresses, fingerprint, consumer, error))

    def _send_aborts_along(self, remote: Remote, route: Route, consumer: GroupedConsumer) -> None:
        """Send the aborts that waited for this connect, from the connect's own task: a
        decode engine whose only request was aborted steps no more, and the prefill engine
        would hold the request's blocks until its `request_timeout_s`."""
        for remote_request_id in remote.take_aborts(route):
            self.send_abort(remote, consumer, remote_request_id)


def look_up_ranks(
    bootstrap: str,
    engine_id: str,
    dp_rank: int | None,
    *,
    secret: str | None,
    timeout_s: float,
) -> tuple[tuple[str, ...], Fingerprint]:
    """The side channels of every worker of one DP rank of an engine (every TP rank of every
    pipeline stage, in (PP, TP) rank order) from its bootstrap service, waiting up to
    `timeout_s` for workers not registered yet, and the registrations they come from. The
    consumer connects to all of them: the handshake tells which layers and heads each holds,
    and this rank fetches from those holding some of its own.

    Raises:
        LookupError: workers missing at the deadline, or the service unreachable.
    """
    client = BootstrapClient(bootstrap, secret=secret, timeout_s=timeout_s)
    workers = client.lookup(engine_id, dp_rank, timeout_s)
    return (
        tuple(rank_channels(w.group_addresses or [w.address]) for w in workers),
        tuple((w.address, w.generation) for w in workers),
    )


def every_session_alive(consumer: GroupedConsumer | None) -> bool:
    """Whether `consumer` has lost no producer rank in any group (a dead session: the rank
    went silent or restarted). Its monitoring snapshots take no lock and make no call."""
    if consumer is None:
        return False
    try:
        return consumer.dead_sessions() == 0
    except Exception:  # a snapshot taken while the consumer changes: look up again
        return False


def rank_channels(addresses: list[str]) -> str:
    """A producer rank's side channels, one per KV cache group, as one string (comma
    separated: addresses hold none), so that ranks compare and log as plain strings."""
    return ",".join(addresses)


def split_channels(channels: str) -> list[str]:
    """The per-group side channels of `rank_channels`."""
    return channels.split(",")
