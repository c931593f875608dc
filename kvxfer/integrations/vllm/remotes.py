"""The prefill engines a decode worker loads from: `RemoteEngines` keeps a `Remote` per DP rank
of a prefill engine (`kvxfer.integrations.vllm.connections`: its connection's state machine),
looks them up and connects them off the engine's thread.

- Connecting runs on the worker's thread pool, one task per remote engine while it connects:
  looking its ranks up in its bootstrap service, then creating and connecting its
  `GroupedConsumer` (a handshake). Each step has `handshake_timeout_s` to reach the engine (its
  service or ranks accepting the connection, its ranks registered); an engine that accepted
  but has not answered yet (its host is loaded, or it is frozen) is waited for as long as the
  loads that wait for the connect (their `fetch_timeout_s`), as a fetch waits for a producer
  that is there: a fixed bound there failed loads of live engines on a loaded machine, and
  vLLM recomputed them. An address where nothing listens fails at once. That engine's loads
  wait for it (`Remote.waiting`); others go on. The task hands its outcome over a queue and
  the engine's thread applies it (`RemoteEngines.take_connects`): the engine's thread owns
  every `Remote`; a lock of its own guards only the aborts that wait for a connect
  (`Remote.aborts`).
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
- One engine named two ways, with its DP rank (a router that passes the prefill's answer on)
  and without (vllm-router's mooncake mode names the engine id only: its only DP rank), is
  two remotes sharing one consumer: the second takes the first's as it is when the first is
  ready, without a look-up. Otherwise each switch between two routers would look the engine
  up, create a Mooncake engine, connect it and retire the other: seconds per worker on 2
  cores, past `handshake_timeout_s` on a loaded one. A consumer is closed once no remote holds
  it; a shared one is never connected elsewhere in place (a remote whose look-up found other
  registrations connects a consumer of its own).
- Aborts that wait for a connect are sent by the connect's task itself, the moment it is
  connected: the decode engine may not step again, and nothing else would send them.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvxfer.integrations.base import rank_channels, split_channels
from kvxfer.integrations.bootstrap import BootstrapClient
from kvxfer.integrations.vllm.connections import Connection, Fingerprint, Remote
from kvxfer.integrations.vllm.metadata import RemoteEngine, Route

if TYPE_CHECKING:
    from kvxfer.connector import GroupedConsumer
    from kvxfer.integrations.vllm.loads import Load

log = logging.getLogger(__name__)

BACKGROUND_THREADS = 32  # connects in flight at once (one per remote engine), and retirements
# How a remote's ranks are looked up: (bootstrap address, engine id, DP rank, seconds a service
# that accepted the connection may take to answer) -> each rank's side channels
# (`rank_channels`) and the registrations they come from.
LookUp = Callable[[str, str, int | None, float], tuple[tuple[str, ...], Fingerprint]]


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
        handshake_timeout_s: how long a connect's look-up and handshake may take to reach the
            engine (longer once it accepted the connection: the module's docstring).
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
        alias = self._alias(remote, route) if consumer is None else None
        remote.start_connect(route)
        if alias is not None:  # connected as it is: no look-up, no handshake
            found = _Outcome(remote, route, alias.seen_at, alias.fingerprint, alias.consumer, None)
            self._outcomes.put(found)
            return
        shared = consumer is not None and self._held_by_another(consumer, remote)
        if consumer is None:
            consumer, self._spare = self._spare, None
        current = (remote.connected, remote.fingerprint)
        held_until = self._held_until(remote)
        self._in_background(
            self._connect_task, remote, consumer, route, current, shared, held_until
        )

    def _held_until(self, remote: Remote) -> float:
        """Until when (monotonic) a connect waits for an engine that accepted its connection
        but has not answered: the last deadline of the loads that wait for it (each fails at
        its own anyway), at least `handshake_timeout_s` from now (only aborts may wait)."""
        floor = time.monotonic() + self._handshake_timeout_s
        return max([floor, *(load.deadline for load in remote.waiting)])

    def _alias(self, remote: Remote, route: Route) -> Remote | None:
        """A remote ready along `route` that is `remote`'s engine named the other way (one
        of the two without its DP rank). vLLM's engine ids are per DP rank (`_dp<rank>`
        suffixed), so both name the same ranks, which that remote's consumer is connected to
        and has lost none of: `remote` shares it without looking the engine up (a starved
        prefill engine's bootstrap service may not answer in time)."""
        for other in self._remotes.values():
            if (
                other is not remote
                and other.engine_id == remote.engine_id
                and None in (other.dp_rank, remote.dp_rank)
                and other.ready(route)
            ):
                return other
        return None

    def _held_by_another(self, consumer: GroupedConsumer, remote: Remote | None = None) -> bool:
        """Whether a remote other than `remote`, or the spare, holds `consumer`."""
        return consumer is self._spare or any(
            r.consumer is consumer for r in self._remotes.values() if r is not remote
        )

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
        # Once each: remotes may share one.
        for consumer in {id(c): c for c in consumers if c is not None}.values():
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
            before = remote.consumer
            remote.on_connected(route, outcome.addresses, outcome.fingerprint, consumer)
            if before is not consumer:  # it held a shared one, connected elsewhere now
                self._close_unheld(before)
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
            if other.consumer is not None and other.consumer is remote.consumer:
                continue  # the same engine named the other way (`_alias`)
            if set(other.seen_at) & set(remote.seen_at):
                other.retire()
                del self._remotes[other.key]
                log.info(
                    "kvxfer: engine %s replaced engine %s at %s",
                    remote,
                    other,
                    ", ".join(remote.seen_at),
                )
                self._close_unheld(other.consumer)  # fails its fetches still running, if any

    def _close_unheld(self, consumer: GroupedConsumer | None) -> None:
        """Close `consumer` in the background unless a remote or the spare still holds it."""
        if consumer is not None and not self._held_by_another(consumer):
            self._in_background(consumer.close)

    def _in_background(self, target: Callable[..., Any], *args: Any) -> None:
        self._tasks.append(self._pool.submit(target, *args))

    # ---- the pool's threads ----

    def _connect_task(
        self,
        remote: Remote,
        consumer: GroupedConsumer | None,
        route: Route,
        current: tuple[tuple[str, ...] | None, Fingerprint | None],
        shared: bool,
        held_until: float,
    ) -> None:
        """Find `remote`'s ranks along `route` (its bootstrap service), then connect
        `consumer` (created first if None) to them, unless it is connected to them already
        (`current`: its addresses, and the registrations they came from, if known: a new
        generation at the same addresses is a restart, connected again); hand the outcome to
        the engine's thread, which owns `remote`. A `shared` consumer (another remote holds
        it) is used as it is or not at all: a new one is connected instead. An engine that
        accepted the connection is waited for until `held_until`."""
        addresses, fingerprint, error = route.addresses, None, None
        connected, known = current

        def held() -> float:
            return max(0.0, held_until - time.monotonic())

        try:
            if route.bootstrap is not None:
                addresses, fingerprint = self._look_up(
                    route.bootstrap, remote.engine_id, remote.dp_rank, held()
                )
            same = fingerprint is None or known is None or fingerprint == known
            if connected != addresses or not same:
                if consumer is None or shared:
                    consumer, shared = self._new_consumer(), False
                consumer.connect(
                    [split_channels(a) for a in addresses],
                    timeout=self._handshake_timeout_s,
                    held_timeout=held(),
                )
            assert consumer is not None  # connected: it has one
            self._send_aborts_along(remote, route, consumer)
        except Exception as exc:
            error = exc
            if shared:  # another remote's: never this one's spare
                consumer = None
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
    held_s: float,
    *,
    secret: str | None,
    timeout_s: float,
) -> tuple[tuple[str, ...], Fingerprint]:
    """The side channels of every worker of one DP rank of an engine (every TP rank of every
    pipeline stage, in (PP, TP) rank order) from its bootstrap service, waiting up to
    `timeout_s` for the service to accept the connection and for workers not registered yet,
    up to `held_s` for a service that accepted it to answer; and the registrations they come
    from. The consumer connects to all of them: the handshake tells which layers and heads
    each holds, and this rank fetches from those holding some of its own.

    Raises:
        LookupError: workers missing at the deadline, or the service unreachable.
    """
    client = BootstrapClient(
        bootstrap, secret=secret, timeout_s=max(timeout_s, held_s), connect_timeout_s=timeout_s
    )
    workers = client.lookup(engine_id, dp_rank, timeout_s)
    return (
        tuple(rank_channels(w.group_addresses or [w.address]) for w in workers),
        tuple((w.address, w.generation) for w in workers),
    )
