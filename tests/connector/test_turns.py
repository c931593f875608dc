"""A loop thread kept from its sockets for long says so in the log (`kvxfer.connector.turns`):
a producer's side channel and a consumer's loop, each with a posted task that holds the thread
for longer than `SLOW_TURN_S`, and a thread that the GIL kept from running after its poll. A
peer's "presumed dead" on the other side can then be matched with its cause."""

from __future__ import annotations

import logging
import sys
import threading
import time

import pytest

from kvxfer.connector.consumer.loop import EventLoop
from kvxfer.connector.sidechannel import SideChannelServer
from kvxfer.connector.turns import SLOW_TURN_S, TurnClock

HELD_S = SLOW_TURN_S + 0.3


def _hold_the_thread() -> None:
    time.sleep(HELD_S)  # a wait, not work: the thread's own CPU stays near zero


def _posted_and_run(post, caplog) -> None:
    done = threading.Event()
    with caplog.at_level(logging.WARNING):
        post(_hold_the_thread)
        post(done.set)
        assert done.wait(30)


def test_a_side_channel_turn_that_held_its_thread_is_reported(caplog) -> None:
    server = SideChannelServer(
        "127.0.0.1", 0, lambda identity, frames: None, owner="producer p rank 0 side channel"
    )
    try:
        _posted_and_run(server.post, caplog)
    finally:
        server.close()
    # The held turn's warning (a loaded machine may add warnings of its own stalls).
    warnings = [r.getMessage() for r in caplog.records if "one turn" in r.getMessage()]
    assert any(
        _held_turn(w, "producer p rank 0 side channel: one turn (0 messages, ") for w in warnings
    ), warnings


def _held_turn(warning: str, start: str) -> bool:
    """Whether `warning` reports the held turn: `start`, at least `HELD_S`, waited not worked."""
    if not warning.startswith(start):
        return False
    assert "of it on this thread's CPU; peers got no answer for that long" in warning
    wall, cpu = (float(w.split(" s")[0]) for w in warning.split("took ")[1].split(", "))
    return wall >= HELD_S - 0.05 and cpu < wall / 2


def test_a_consumer_loop_turn_that_held_its_thread_is_reported(caplog) -> None:
    loop = EventLoop("test-loop", "decode-0", lambda: [], lambda sock: None, lambda: None)
    loop.start()
    try:
        _posted_and_run(loop.post, caplog)
    finally:
        loop.post(loop.stop)
        loop.join()
        loop.close()
    warnings = [r.getMessage() for r in caplog.records if "one turn" in r.getMessage()]
    assert any(_held_turn(w, "consumer decode-0 loop: one turn (") for w in warnings), warnings


def test_a_thread_the_gil_kept_from_running_after_its_poll_is_reported(caplog) -> None:
    """The main thread holds the GIL (a pure-Python loop, with the interpreter told not to
    hand it over for 10 s) while the side channel's 10 ms polls end: its thread runs again
    only when the loop is over, and says how late it woke."""
    server = SideChannelServer(
        "127.0.0.1", 0, lambda identity, frames: None, tick_s=0.01, owner="side channel"
    )
    interval = sys.getswitchinterval()
    try:
        time.sleep(0.1)  # the thread is in its poll loop
        with caplog.at_level(logging.WARNING):
            sys.setswitchinterval(10.0)
            try:
                until = time.monotonic() + HELD_S + 0.2
                while time.monotonic() < until:
                    pass
            finally:
                sys.setswitchinterval(interval)
            time.sleep(0.2)  # the thread's turn, now that it can run
    finally:
        server.close()
    messages = [r.getMessage() for r in caplog.records if r.getMessage().startswith("side")]
    # Its poll had returned (the usual case: then "woke ... late"), or, if the loop caught it
    # in the middle of a turn, that turn was the long one.
    stalls = [m for m in messages if "poll ended: its thread was not run" in m or "turn (" in m]
    # Where the thread that held the GIL was: this test's loop, on the main thread (a loaded
    # machine may add warnings of its own stalls).
    assert any(
        "The other threads now: " in m and "MainThread [test_turns.py:" in m for m in stalls
    ), stalls


@pytest.mark.parametrize("late_s", [0.0, SLOW_TURN_S - 0.1])
def test_a_wake_within_the_threshold_is_not_reported(caplog, late_s) -> None:
    clock = TurnClock(logging.getLogger("t"), "loop")
    with caplog.at_level(logging.WARNING):
        clock.waiting()
        clock._wait_began -= 0.01 + late_s  # as if the poll had begun that long ago
        clock.polled(0.01)
        assert not clock.turn_was_long()
    assert not caplog.records


def test_a_late_wake_is_reported_with_how_late(caplog) -> None:
    clock = TurnClock(logging.getLogger("t"), "loop")
    with caplog.at_level(logging.WARNING):
        clock.waiting()
        clock._wait_began -= 2.51
        clock.polled(0.01)
    [record] = caplog.records
    assert record.getMessage().startswith("loop: woke 2.5 s after its 10 ms poll ended")
