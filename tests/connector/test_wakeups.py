"""The fetch path wakes on events, never on the periodic ticks (issue 23, "a request costs what
the wire costs"): with every tick stretched to a minute, a connect, a fetch asked before its
publish, and a fetch of many chunks one at a time still complete at once, bit-exact. Before,
each of them waited for a tick (the consumer's 10 ms, the producer's 10 ms) at least once.

In one process over real Mooncake TCP on 127.0.0.1; the ticks are patched on the classes
before the producers and consumers start, so every loop of this test sleeps up to a minute
between turns unless an event wakes it.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import zmq

from kvxfer.connector import KVConsumer, KVProducer
from kvxfer.connector import sidechannel as sidechannel_module
from kvxfer.connector.consumer import loop as loop_module
from kvxfer.connector.consumer.loop import EventLoop
from kvxfer.connector.sidechannel import SideChannelServer
from kvxfer.reference import random_global_kv, write_rank_cells
from kvxfer.testing import make_scenario, side_specs
from kvxfer.testing.scenario import ScenarioEngines

A_MINUTE = 60.0
WAIT_S = 20.0  # far below a tick: a result within it came from an event


@pytest.fixture
def slow_ticks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loop_module, "_TICK_S", A_MINUTE)
    monkeypatch.setattr(loop_module, "_IDLE_TICK_S", A_MINUTE)
    original = SideChannelServer.__init__

    def with_slow_tick(self: SideChannelServer, *args: object, **kwargs: object) -> None:
        kwargs["tick_s"] = kwargs["idle_tick_s"] = A_MINUTE
        original(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(sidechannel_module.SideChannelServer, "__init__", with_slow_tick)


def test_posted_work_runs_without_waiting_for_a_tick(slow_ticks: None) -> None:
    ran = threading.Event()
    server = SideChannelServer("127.0.0.1", 0, lambda identity, frames: None, lambda: None)
    try:
        # The server thread is asleep in a minute-long poll: only the post's wake-up runs it.
        server.post(ran.set)
        assert ran.wait(WAIT_S), "posted work waited for the tick"
    finally:
        server.close()


@pytest.mark.parametrize("chunk_tokens", [None, 16], ids=["one-chunk", "chunks-of-16"])
def test_connect_late_publish_and_chunks_need_no_tick(slow_ticks: None, chunk_tokens) -> None:
    num_tokens = 100
    src = side_specs(2, heads=4, block_size=16, num_blocks=40)
    dst = side_specs(2, heads=4, block_size=32, layout="HND", num_blocks=40)
    scenario = make_scenario(src, dst, num_tokens)
    # One slot each side: a chunk of 16 tokens is asked only once the one before is copied.
    pool = {"staging_bytes": 1 << 16, "staging_slots": 1}
    with ScenarioEngines(scenario, pool, dict(chunk_tokens=chunk_tokens, **pool)) as engines:
        engines.connect(timeout=WAIT_S)  # completes when the handshakes do, not at a tick
        handles = engines.fetch("r", timeout=2 * WAIT_S)
        # The asks arrived before the request exists: the publish serves them at once.
        engines.publish("r")
        results = [handle.wait(WAIT_S) for handle in handles]
        assert all(r.ok for r in results), [r.errors for r in results]
        if chunk_tokens is not None:
            assert all(h.chunks_done == -(-num_tokens // chunk_tokens) for h in handles)
        scenario.assert_exact()


def test_fetches_sharing_a_slot_and_a_cancelled_fetch_need_no_tick(slow_ticks: None) -> None:
    """Two fetches on one consumer with one staging slot: a read that waits for the slot
    starts when the other fetch's copy frees it (a turn moves on only what an event stirred:
    this one is the slot's release). A fetch of a request never published, given up by its
    wait's timeout, ends at once with every block failed."""
    num_tokens = 64
    src = side_specs(1, heads=4, block_size=16, num_blocks=40)
    dst = side_specs(1, heads=4, block_size=32, layout="HND", num_blocks=40)
    scenario = make_scenario(src, dst, num_tokens)
    pool = {"staging_bytes": 1 << 16, "staging_slots": 1}
    ((spec, caches, ids),) = scenario.src
    ((dspec, dcaches, dids),) = scenario.dst
    other = np.setdiff1d(np.arange(dspec.num_blocks), dids)[: len(dids)]
    write_rank_cells(dspec, scenario.expected[0], other, random_global_kv(spec, num_tokens), 0,
                     num_tokens)  # fmt: skip
    producer = KVProducer(spec, caches, "prefill", **pool)
    consumer = KVConsumer(dspec, dcaches, "decode", chunk_tokens=16, **pool)
    try:
        consumer.connect([producer.address], timeout=WAIT_S)
        handles = [
            consumer.fetch(request_id, table, num_tokens, timeout=2 * WAIT_S)
            for request_id, table in (("a", dids), ("b", other))
        ]
        producer.publish("a", ids, num_tokens)
        producer.publish("b", ids, num_tokens)
        results = [handle.wait(WAIT_S) for handle in handles]
        assert all(r.ok for r in results), [r.errors for r in results]
        scenario.assert_exact()

        never = consumer.fetch("never", dids, num_tokens, timeout=2 * WAIT_S)
        began = time.monotonic()
        given_up = never.wait(0.2)
        assert time.monotonic() - began < WAIT_S, "the cancel waited for the tick"
        assert not given_up.ok and given_up.failed_block_ids == sorted(dids.tolist())
    finally:
        consumer.close()
        producer.close()


def test_a_loop_woken_by_many_threads_at_once_keeps_waking(slow_ticks: None) -> None:
    """`EventLoop.wake` writes the pipe only while the loop has not been woken already: after
    bursts of posts from four threads at once, every event has run and a single later post
    still wakes the loop (a flag left set with the pipe empty would leave it asleep for the
    minute-long tick)."""
    ran: list[int] = []
    loop = EventLoop("test-loop", "test", lambda: [], lambda sock: None, lambda: None)
    loop.start()

    def burst(n: int) -> None:
        for i in range(n):
            loop.post(lambda i=i: ran.append(i))

    try:
        for round_ in range(100):
            threads = [threading.Thread(target=burst, args=(50,)) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            all_ran = threading.Event()
            loop.post(all_ran.set)
            assert all_ran.wait(WAIT_S), f"round {round_}: the last post did not wake the loop"
            assert len(ran) == 200 * (round_ + 1)
    finally:
        loop.post(loop.stop)
        loop.join()
        loop.close()


def test_work_the_loop_posts_itself_runs_without_a_wake_up_or_a_tick(slow_ticks: None) -> None:
    """Posted from the loop's own thread (a driven read's completion, a copy that ran inline),
    an event writes no pipe: it runs in the same turn, or the next turn starts at once."""
    ran = threading.Event()
    posted = threading.Event()
    loop: EventLoop

    def tick() -> None:  # the last step of a turn: the loop would sleep a minute after it
        if not posted.is_set():
            posted.set()
            loop.post(ran.set)

    loop = EventLoop("test-loop", "test", lambda: [], lambda sock: None, tick)
    writes: list[bytes] = []
    real_wake = loop.wake
    loop.wake = lambda: (writes.append(b"x"), real_wake())  # type: ignore[method-assign]
    loop.start()
    try:
        loop.post(lambda: None)  # one turn, from this thread: its tick posts from the loop's
        assert ran.wait(WAIT_S), "the loop's own post waited for the tick"
        assert len(writes) == 1  # this thread's post only
    finally:
        loop.post(loop.stop)
        loop.join()
        loop.close()


@contextlib.contextmanager
def _driven_loop(due_in: float, turns: int) -> Iterator[list[float]]:
    """A loop whose reads are in flight until its `turns`-th drive, each drive saying the next
    poll is due in `due_in` s: yields the drives' times once `turns` drives happened (the loop
    still running), stops it after."""
    drives: list[float] = []
    done = threading.Event()

    def drive() -> float | None:
        drives.append(time.monotonic())
        if len(drives) == turns:
            done.set()
        return due_in if len(drives) < turns else None

    loop = EventLoop("test-loop", "test", lambda: [], lambda sock: None, lambda: None, drive=drive)
    loop.start()
    try:
        loop.post(lambda: None)
        assert done.wait(WAIT_S), "the loop did not turn while reads were in flight"
        yield drives
    finally:
        loop.post(loop.stop)
        loop.join()
        loop.close()


def test_a_loop_turns_while_its_driven_reads_are_in_flight(slow_ticks: None) -> None:
    """Reads the loop drives settle only when it drives them: it turns when their next poll is
    due (what `drive` returns: here 0.2 ms, never the minute-long tick), and sleeps again once
    none is in flight."""
    with _driven_loop(0.0002, 50) as drives:
        time.sleep(0.05)
        assert len(drives) == 50  # none in flight: asleep until the next event


@pytest.mark.parametrize("due_in", [0.0008, 0.03])  # a sleep, and a ZeroMQ poll of 30 ms
def test_a_loop_waits_for_its_reads_next_poll_not_less(slow_ticks: None, due_in: float) -> None:
    """Between polls of an old read the loop sleeps until the next poll is due (what `drive`
    returned), not a fixed 0.2 ms: no turns that poll nothing. Only lower bounds are asserted
    (a loaded machine turns later, never sooner)."""
    with _driven_loop(due_in, 6) as drives:
        gaps = [b - a for a, b in itertools.pairwise(drives)]
    # ZeroMQ's poll waits whole milliseconds, rounded down
    floor = due_in if due_in < 0.001 else int(due_in * 1000) / 1000
    assert min(gaps) >= floor * 0.95, gaps


def test_idle_loops_tick_at_the_idle_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    """With nothing in flight, the consumer's loop and a side channel sleep their idle tick
    between turns (an idle engine's threads stay idle). Only upper bounds are asserted: a
    loaded machine makes fewer turns, not more."""
    monkeypatch.setattr(loop_module, "_IDLE_TICK_S", 0.25)
    busy = threading.Event()  # never set: idle throughout
    loop_ticks: list[float] = []
    server_ticks: list[float] = []
    loop = EventLoop(
        "test-loop",
        "test",
        lambda: [],
        lambda sock: None,
        lambda: loop_ticks.append(0),
        busy.is_set,
    )
    loop.start()
    server = SideChannelServer(
        "127.0.0.1",
        0,
        lambda identity, frames: None,
        lambda: server_ticks.append(0),
        tick_s=0.01,
        idle_tick_s=0.25,
        busy=busy.is_set,
    )
    try:
        time.sleep(1.0)
        assert len(loop_ticks) <= 6, len(loop_ticks)  # 4 at 0.25 s, not 100 at 10 ms
        assert len(server_ticks) <= 6, len(server_ticks)
    finally:
        loop.post(loop.stop)
        loop.join()
        loop.close()
        server.close()


def test_a_busy_side_channel_ticks_once_per_period_whatever_its_messages() -> None:
    """A stream of messages does not run the tick after each one: its periodic work (expiry,
    deadlines) was a tenth of a busy producer's time. Only an upper bound is asserted: a loaded
    machine makes fewer ticks, not more."""
    received: list[int] = []
    ticks: list[float] = []
    began = time.monotonic()
    server = SideChannelServer(
        "127.0.0.1",
        0,
        lambda identity, frames: received.append(len(frames)),
        lambda: ticks.append(time.monotonic()),
        tick_s=0.25,
        busy=lambda: True,
    )
    context = zmq.Context()
    client = context.socket(zmq.DEALER)
    try:
        client.connect(server.address)
        sent = 0
        while time.monotonic() - began < 1.0:  # a message a millisecond for a second
            client.send(b"x")
            sent += 1
            time.sleep(0.001)
        deadline = time.monotonic() + WAIT_S
        while len(received) < sent and time.monotonic() < deadline:
            time.sleep(0.01)
        ticked, elapsed = len(ticks), time.monotonic() - began
        assert len(received) == sent  # every message was handled
        assert 1 <= ticked <= elapsed / 0.25 + 1, (ticked, elapsed, sent)
    finally:
        client.close(linger=0)
        context.term()
        server.close()
