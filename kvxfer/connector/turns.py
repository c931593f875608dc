"""`TurnClock`: a warning when an event loop's thread stayed away from its sockets for long.

A producer's side channel and a consumer's loop each answer their peers from one thread: a
turn that keeps that thread from its sockets for seconds delays every peer's answers (liveness
itself rides on libzmq's heartbeats, answered without the GIL). Two such stalls show:

- a late wake: the thread came back from its poll long after the poll's timeout (it was not
  run: the machine's CPUs or the GIL were held elsewhere);
- a long turn: handling what the poll returned took long, reported with the thread's own CPU
  in it (CPU close to the wall time: work done on the thread, such as a copy; far below it: the
  thread waited, for a lock, the GIL or a CPU).

Either is logged once it ends, with where the process's other threads are then, so that a
peer's slow answers, or a load's timeout, can be matched with the cause in the other side's
log. The cost is five
clock reads a turn (two of them CPU clocks), nothing while the thread sleeps.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback

SLOW_TURN_S = 2.0
"""A turn, or a wake past its poll's timeout, longer than this is logged. Shorter stalls happen
on a loaded machine (a whole process not run for 1.9 s while a test suite ran beside it) and
delay nobody much."""


class TurnClock:
    """Times the turns of one event loop's thread (call every method from that thread).

    Args:
        log: where the warnings go.
        owner: the loop's name in them ("producer prefill-0 side channel").
        slow_s: the threshold.
    """

    def __init__(self, log: logging.Logger, owner: str, slow_s: float = SLOW_TURN_S) -> None:
        self._log, self._owner, self._slow_s = log, owner, slow_s
        self._wait_began = self._wait_cpu = 0.0
        self._turn_began = self._turn_cpu = 0.0

    def waiting(self) -> None:
        """The thread is about to poll (or sleep, then poll)."""
        self._wait_began, self._wait_cpu = time.monotonic(), time.process_time()

    def polled(self, timeout_s: float) -> None:
        """The poll, whose timeout (with any sleep before it) was `timeout_s`, returned now:
        warn if it returned `slow_s` past that, with the process's CPU meanwhile (the thread's
        own process busy: the GIL or the CPUs held by its other threads; idle: the machine's
        CPUs held by other processes) and where the other threads are now; the turn begins."""
        now = time.monotonic()
        late = now - self._wait_began - timeout_s
        if late > self._slow_s:
            self._log.warning(
                "%s: woke %.1f s after its %.0f ms poll ended: its thread was not run "
                "meanwhile, while this process used %.1f s of CPU; peers got no answer for "
                "that long. The other threads now: %s",
                self._owner,
                late,
                timeout_s * 1e3,
                time.process_time() - self._wait_cpu,
                other_threads(),
            )
        self._turn_began, self._turn_cpu = now, time.thread_time()

    def turn_was_long(self) -> bool:
        """Whether the turn begun at the last `polled` has taken `slow_s` so far (then
        `report_turn` says what it did)."""
        return time.monotonic() - self._turn_began > self._slow_s

    def report_turn(self, what: str) -> None:
        """Warn that the turn begun at the last `polled`, which did `what`, took long."""
        self._log.warning(
            "%s: one turn (%s) took %.1f s, %.1f s of it on this thread's CPU; peers got no "
            "answer for that long. The other threads now: %s",
            self._owner,
            what,
            time.monotonic() - self._turn_began,
            time.thread_time() - self._turn_cpu,
            other_threads(),
        )


def other_threads(frames: int = 3) -> str:
    """Where every other Python thread of this process is now: its name and its innermost
    `frames` calls (the thread that held the GIL or the CPUs is likely still there)."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    me = threading.get_ident()
    where = []
    for ident, frame in sys._current_frames().items():
        if ident == me:
            continue
        calls = []
        for summary in traceback.extract_stack(frame)[-frames:]:
            calls.append(f"{os.path.basename(summary.filename)}:{summary.lineno} {summary.name}")
        where.append(f"{names.get(ident, ident)} [{' < '.join(reversed(calls))}]")
    return "; ".join(where)


class TickGaps:
    """How long an event loop's thread was away between two ticks, beyond what its ticks
    allow (they come every 10-100 ms while it runs): the time it was not run, which its
    deadlines do not count. A producer's peers' silence and its published requests' deadlines,
    a consumer's handshakes and fetches: a process the machine did not run for 20 s does not
    give up, the moment it runs again, on what only its own absence made late.

    Call `away` from the loop's thread, once a tick.
    """

    ALLOWED_S = 1.0
    """A gap longer than this between ticks means the thread was not run meanwhile."""

    def __init__(self) -> None:
        self.ticked = time.monotonic()  # the last tick

    def away(self, now: float) -> float:
        """The seconds this thread was not run since the last tick (0 if it ran); the tick
        at `now` is the last one from then on."""
        gap = now - self.ticked - self.ALLOWED_S
        self.ticked = now
        return max(0.0, gap)
