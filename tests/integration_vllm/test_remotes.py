"""The prefill engines a decode worker loads from (`kvxfer.integrations.vllm.remotes` and
`connections`), without
sockets or threads: a remote engine's connection changes only through the transition table,
and `RemoteEngines` applies the reconnect rules of its module docstring, driven here by fake
consumers, a fake bootstrap look-up and background work that runs when the test says so.
Runs in the vLLM environment (`make test-vllm`: the request metadata imports vLLM)."""

from __future__ import annotations

import concurrent.futures
import itertools
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import pytest

from kvxfer.integrations.vllm.connections import (
    TRANSITIONS,
    Connection,
    Event,
    IllegalTransition,
    Remote,
    next_state,
)
from kvxfer.integrations.vllm.loads import Load
from kvxfer.integrations.vllm.metadata import LoadSpec, RemoteEngine, Route
from kvxfer.integrations.vllm.remotes import RemoteEngines

BOOTSTRAP = "http://10.0.0.1:5690"
AT_A = ("tcp://10.0.0.2:7000", "tcp://10.0.0.2:7001")  # two producer ranks
AT_B = ("tcp://10.0.0.3:7000", "tcp://10.0.0.3:7001")


class Background(concurrent.futures.Executor):
    """Background work that runs when the test calls `run` (the worker's thread pool)."""

    def __init__(self) -> None:
        self.queued: list[tuple[Callable[..., Any], tuple[Any, ...], Future[Any]]] = []

    def submit(self, fn, /, *args, **kwargs):
        future: Future[Any] = Future()
        self.queued.append((fn, args, future))
        return future

    def run(self) -> int:
        """Run what is queued (and what that queues); how many tasks ran."""
        ran = 0
        while self.queued:
            fn, args, future = self.queued.pop(0)
            future.set_result(fn(*args))
            ran += 1
        return ran


class Consumer:
    """A `GroupedConsumer` as `RemoteEngines` uses it."""

    def __init__(self, fail: bool = False) -> None:
        self.fail, self.dead, self.closed = fail, 0, False
        self.connects: list[list[list[str]]] = []
        self.held_timeouts: list[float] = []
        self.aborts: list[str] = []

    def connect(self, ranks: list[list[str]], timeout: float, held_timeout: float) -> None:
        self.connects.append(ranks)
        self.held_timeouts.append(held_timeout)
        if self.fail:
            raise ConnectionError("handshake timed out")

    def abort(self, remote_request_id: str) -> None:
        self.aborts.append(remote_request_id)

    def dead_sessions(self) -> int:
        return self.dead

    def close(self) -> None:
        assert not self.closed, "closed twice"
        self.closed = True


class Engines:
    """`RemoteEngines` over fakes: `registered` is what the bootstrap service answers
    (addresses and the generation of every rank), `created` every consumer made."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.registered: dict[tuple[str, int], tuple[tuple[str, ...], str]] = {}
        self.created: list[Consumer] = []
        self.looked_up = 0
        self.look_up_held: list[float] = []
        self.pool = Background()
        self.remotes = RemoteEngines(
            self._new_consumer, self._look_up, handshake_timeout_s=1.0, executor=self.pool
        )
        self.fetched: list[Load] = []
        self.failed: list[tuple[Load, Exception]] = []

    def _new_consumer(self) -> Consumer:
        self.created.append(Consumer(self.fail))
        return self.created[-1]

    def _look_up(self, bootstrap: str, engine_id: str, dp_rank: int | None, held_s: float):
        assert bootstrap == BOOTSTRAP
        self.looked_up += 1
        self.look_up_held.append(held_s)
        if dp_rank is None:  # the engine id's only DP rank, as the bootstrap client finds it
            ranks = [rank for engine, rank in self.registered if engine == engine_id]
            if len(ranks) != 1:
                raise LookupError(f"engine {engine_id!r} has DP ranks {ranks}")
            (dp_rank,) = ranks
        if (engine_id, dp_rank) not in self.registered:
            raise LookupError(f"engine {engine_id!r} DP rank {dp_rank} not found")
        addresses, generation = self.registered[engine_id, dp_rank]
        return addresses, tuple((a, generation) for a in addresses)

    def load(
        self, where: RemoteEngine, request_id: str = "r", deadline: float = float("inf")
    ) -> Load:
        """Start a load as `WorkerSide` does: fetched at once when its engine is ready, else
        waiting for a connect."""
        spec = LoadSpec(request_id, f"remote-{request_id}", where, [[1]], 16, 0)
        load = Load(spec, Route.of(where), deadline=deadline)
        remote = self.remotes.get(where)
        if remote.ready(load.route):
            self.fetched.append(load)
        else:
            remote.waiting.append(load)
            self.remotes.connect(remote, load.route)
        return load

    def settle(self) -> None:
        """Run the background work and apply its outcomes on "the engine's thread", until
        nothing is left to run (an outcome may start the next connect)."""
        while True:
            self.pool.run()
            self.remotes.take_connects(
                lambda remote, load: self.fetched.append(load),
                lambda load, error: self.failed.append((load, error)),
            )
            if not self.pool.queued:
                return


def _engine(engine_id: str = "prefill", dp_rank: int | None = 0) -> RemoteEngine:
    return RemoteEngine(engine_id, dp_rank, BOOTSTRAP)


def _fixed(host: str = "10.0.0.2") -> RemoteEngine:
    return RemoteEngine("prefill", 0, None, host, 7000, tp_size=2)


# ---- the transition table ----


def test_every_change_the_table_does_not_list_raises() -> None:
    for state, event in itertools.product(Connection, Event):
        if (state, event) in TRANSITIONS:
            assert next_state(state, event) is TRANSITIONS[state, event]
        else:
            with pytest.raises(
                IllegalTransition,
                match=f"in state {state.value!r} cannot take event {event.value!r}",
            ):
                next_state(state, event)
    assert not any(state is Connection.RETIRED for state, _ in TRANSITIONS)  # no way back
    # Only a connect's outcome leaves CONNECTING (a failed load there changes nothing).
    leaving = {TRANSITIONS[s, e] for s, e in TRANSITIONS if s is Connection.CONNECTING}
    assert leaving == {Connection.CONNECTED, Connection.DISCONNECTED, Connection.CONNECTING}


def test_a_remote_refuses_an_outcome_it_did_not_wait_for() -> None:
    remote = Remote("prefill", 0)
    with pytest.raises(
        IllegalTransition, match=r"engine prefill \(DP rank 0\): .* cannot take event 'connected'"
    ):
        remote.on_connected(Route(BOOTSTRAP), AT_A, None, None)
    with pytest.raises(IllegalTransition, match="in state 'new' cannot take event 'retire'"):
        remote.retire()
    remote.start_connect(Route(BOOTSTRAP))
    with pytest.raises(
        IllegalTransition, match="in state 'connecting' cannot take event 'connect'"
    ):
        remote.start_connect(Route(BOOTSTRAP))
    assert remote.state is Connection.CONNECTING  # a refused change changes nothing


def test_when_a_remote_is_ready_for_a_route() -> None:
    consumer = Consumer()
    remote = Remote("prefill", 0)
    routes = [Route(BOOTSTRAP), Route(None, AT_A), Route(None, AT_B)]
    assert not any(remote.ready(route) for route in routes)  # NEW
    remote.start_connect(routes[0])
    assert not any(remote.ready(route) for route in routes)  # CONNECTING
    remote.on_connected(routes[0], AT_A, None, consumer)  # type: ignore[arg-type]
    assert [remote.ready(route) for route in routes] == [True, True, False]
    consumer.dead = 1  # a producer rank died or restarted: look the engine up again
    assert [remote.ready(route) for route in routes] == [False, True, False]
    consumer.dead = 0
    remote.load_failed()
    assert remote.state is Connection.STALE
    # Fixed addresses need no look-up: the consumer finds a restarted rank there itself.
    assert [remote.ready(route) for route in routes] == [False, True, False]
    remote.start_connect(routes[0])
    remote.on_failed()
    assert remote.state is Connection.DISCONNECTED and remote.connected is None
    assert not any(remote.ready(route) for route in routes)


# ---- RemoteEngines: the rules ----


def test_loads_wait_for_their_engines_connect_then_fetch() -> None:
    engines = Engines()
    engines.registered["prefill", 0] = (AT_A, "g1")
    first, second = engines.load(_engine(), "r1"), engines.load(_engine(), "r2")
    (remote,) = engines.remotes.known()
    assert remote.state is Connection.CONNECTING and remote.waiting == [first, second]
    assert engines.pool.run() == 1  # one connect for both
    assert remote.state is Connection.CONNECTING  # until the engine's thread applies it
    engines.remotes.take_connects(
        lambda r, load: engines.fetched.append(load), lambda *_: pytest.fail()
    )
    assert remote.state is Connection.CONNECTED and engines.fetched == [first, second]
    (consumer,) = engines.created
    assert consumer.connects == [[[AT_A[0]], [AT_A[1]]]]  # each rank's one side channel
    third = engines.load(_engine(), "r3")  # ready: fetched at once, nothing in the background
    assert engines.fetched[-1] is third and not engines.pool.queued


def test_a_failed_first_connect_fails_its_loads_and_keeps_nothing_but_the_consumer() -> None:
    """The engine is forgotten; its consumer is the next engine's (destroying one stalls the
    process)."""
    engines = Engines(fail=True)
    engines.registered["prefill", 0] = (AT_A, "g1")
    load = engines.load(_engine())
    (remote,) = engines.remotes.known()
    engines.settle()
    ((failed, error),) = engines.failed
    assert failed is load and "handshake timed out" in str(error)
    assert remote.state is Connection.RETIRED and engines.remotes.known() == []
    engines.registered["other", 0] = (AT_B, "g1")
    engines.load(_engine("other"))
    engines.settle()
    assert len(engines.created) == 1 and len(engines.created[0].connects) == 2
    engines.remotes.close()
    assert engines.created[0].closed


def test_an_engine_not_found_fails_its_loads_and_the_next_load_connects_again() -> None:
    engines = Engines()
    engines.load(_engine(), "r1")
    engines.settle()
    assert "not found" in str(engines.failed[0][1]) and engines.created == []
    engines.registered["prefill", 0] = (AT_A, "g1")
    second = engines.load(_engine(), "r2")
    engines.settle()
    assert engines.fetched == [second] and engines.looked_up == 2


def test_a_failed_load_looks_the_engine_up_again_and_connects_only_if_it_changed() -> None:
    engines = Engines()
    engines.registered["prefill", 0] = (AT_A, "g1")
    engines.load(_engine(), "r1")
    engines.settle()
    (consumer,) = engines.created
    engines.remotes.load_failed(_engine())
    (remote,) = engines.remotes.known()
    assert remote.state is Connection.STALE
    engines.load(_engine(), "r2")  # looked up again: the same registrations
    engines.settle()
    assert remote.state is Connection.CONNECTED and engines.looked_up == 2
    assert len(consumer.connects) == 1  # not connected again
    # The engine restarted at the same addresses: a new generation is connected again.
    engines.registered["prefill", 0] = (AT_A, "g2")
    engines.remotes.load_failed(_engine())
    engines.load(_engine(), "r3")
    engines.settle()
    assert len(consumer.connects) == 2 and [load.spec.request_id for load in engines.fetched] == [
        "r1",
        "r2",
        "r3",
    ]


def test_a_load_naming_other_fixed_addresses_connects_again_first() -> None:
    engines = Engines()
    engines.load(_fixed("10.0.0.2"), "r1")
    engines.settle()
    engines.load(_fixed("10.0.0.2"), "r2")  # the same addresses: at once
    assert engines.pool.queued == [] and len(engines.fetched) == 2
    engines.load(_fixed("10.0.0.3"), "r3")
    engines.settle()
    (consumer,) = engines.created
    assert consumer.connects == [[[a] for a in AT_A], [[a] for a in AT_B]]
    assert engines.looked_up == 0 and len(engines.fetched) == 3


def test_a_load_for_another_route_waits_for_the_connect_after_the_one_in_flight() -> None:
    engines = Engines()
    first = engines.load(_fixed("10.0.0.2"), "r1")
    moved = engines.load(_fixed("10.0.0.3"), "r2")  # the engine moved while connecting
    assert len(engines.pool.queued) == 1
    engines.settle()  # the first connect ends, the next starts at once for `moved`
    assert engines.fetched == [first, moved]
    assert engines.created[0].connects[-1] == [[a] for a in AT_B]


def test_an_engine_found_where_another_was_retires_the_other() -> None:
    """vLLM gives a restarted engine a new engine id: the old one is gone for good."""
    engines = Engines()
    engines.registered["old", 0] = (AT_A, "g1")
    engines.load(_engine("old"))
    engines.settle()
    (old,) = engines.remotes.known()
    engines.registered["new", 0] = (AT_A, "g2")
    engines.load(_engine("new"))
    engines.settle()
    assert old.state is Connection.RETIRED
    assert [str(r) for r in engines.remotes.known()] == ["new (DP rank 0)"]
    assert engines.created[0].closed and not engines.created[1].closed


def test_one_engine_named_with_and_without_its_dp_rank_shares_one_consumer() -> None:
    """kvxfer's proxy names the prefill's DP rank, vllm-router's mooncake mode names the engine
    id only: switching between them looks the engine up, and creates, connects and closes
    nothing."""
    engines = Engines()
    engines.registered["prefill", 0] = (AT_A, "g1")
    engines.load(_engine(dp_rank=0), "r1")
    engines.settle()
    unnamed = engines.load(_engine(dp_rank=None), "r2")
    engines.settle()
    again = engines.load(_engine(dp_rank=0), "r3")  # ready at once: no connect
    assert not engines.pool.queued
    engines.load(_engine(dp_rank=None), "r4")
    (consumer,) = engines.created
    assert consumer.connects == [[[a] for a in AT_A]] and not consumer.closed
    assert engines.looked_up == 1  # the second name needs no look-up
    assert [load.spec.request_id for load in engines.fetched] == ["r1", "r2", "r3", "r4"]
    assert unnamed in engines.fetched and again in engines.fetched
    assert sorted(str(r) for r in engines.remotes.known()) == [
        "prefill (DP rank 0)",
        "prefill (its DP rank)",
    ]
    engines.remotes.close()
    assert consumer.closed  # once: the fake refuses a second close


def test_a_shared_consumer_is_never_connected_elsewhere_in_place() -> None:
    """The engine restarted elsewhere: the remote that finds it first connects a consumer of
    its own; the other keeps the shared one until it looks the engine up itself, and the one
    no remote holds any more is closed."""
    engines = Engines()
    engines.registered["prefill", 0] = (AT_A, "g1")
    engines.load(_engine(dp_rank=0), "r1")
    engines.settle()
    engines.load(_engine(dp_rank=None), "r2")
    engines.settle()
    engines.registered["prefill", 0] = (AT_B, "g2")
    engines.remotes.load_failed(_engine(dp_rank=None))
    engines.load(_engine(dp_rank=None), "r3")
    engines.settle()
    first, second = engines.created
    assert first.connects == [[[a] for a in AT_A]] and not first.closed  # DP rank 0 holds it
    assert second.connects == [[[a] for a in AT_B]]
    engines.remotes.load_failed(_engine(dp_rank=0))
    engines.load(_engine(dp_rank=0), "r4")
    engines.settle()
    assert [load.spec.request_id for load in engines.fetched] == ["r1", "r2", "r3", "r4"]
    (remote_0,) = [r for r in engines.remotes.known() if r.dp_rank == 0]
    assert remote_0.consumer is not None and remote_0.connected == AT_B
    assert [c.closed for c in engines.created] == [
        remote_0.consumer is not c for c in (first, second)
    ]


def test_a_connect_waits_for_an_engine_that_accepted_as_long_as_its_loads() -> None:
    """The look-up and the handshake wait for a service or ranks that accepted the connection
    until the last deadline of the loads waiting for the connect; with only an abort waiting,
    `handshake_timeout_s` (1 s here)."""
    engines = Engines()
    engines.registered["prefill", 0] = (AT_A, "g1")
    engines.registered["other", 0] = (AT_B, "g1")
    now = time.monotonic()
    engines.load(_engine(), "r1", deadline=now + 300)
    engines.load(_engine(), "r2", deadline=now + 200)  # waits for the same connect
    engines.settle()
    (consumer,) = engines.created
    assert 290 < engines.look_up_held[0] <= 300 and 290 < consumer.held_timeouts[0] <= 300
    engines.remotes.abort(_engine("other"), "gone")
    engines.settle()
    assert 0 < engines.look_up_held[1] <= 1.0 and 0 < engines.created[1].held_timeouts[0] <= 1.0


def test_aborts_are_sent_at_once_or_by_the_connect_they_wait_for() -> None:
    engines = Engines()
    engines.registered["prefill", 0] = (AT_A, "g1")
    engines.remotes.abort(_engine(), "gone-1")  # nothing connected: a connect sends it
    (remote,) = engines.remotes.known()
    assert remote.state is Connection.CONNECTING and remote.aborts
    engines.pool.run()  # the connect's task sends it before the engine steps again
    (consumer,) = engines.created
    assert consumer.aborts == ["gone-1"] and remote.aborts == []
    engines.remotes.abort(_engine(), "gone-2")  # after the task looked: the engine's thread
    engines.remotes.take_connects(lambda *_: None, lambda *_: None)
    assert consumer.aborts == ["gone-1", "gone-2"]
    engines.remotes.abort(_engine(), "gone-3")  # connected: at once
    assert consumer.aborts[-1] == "gone-3" and not engines.pool.queued


def test_close_closes_every_consumer() -> None:
    engines = Engines()
    engines.registered["a", 0] = (AT_A, "g1")
    engines.registered["b", 0] = (AT_B, "g1")
    engines.load(_engine("a"))
    engines.load(_engine("b"))
    engines.settle()
    engines.remotes.close()
    assert [c.closed for c in engines.created] == [True, True]
    assert engines.remotes.known() == []
