"""`EventLoop`: the one thread that owns every socket and every state machine of a consumer.

No thread per fetch or per session, so abandoned fetches cannot exhaust anything: other threads
(the caller's, the transport's completions, the copy workers) `post` callables to it, and a
pipe wakes it. Each turn it reads every readable socket, runs what was posted, `tick`s
(heartbeats, the chunks that the turn's events let move on), then drives the transport's reads
when it owns them (`drive`, last, so that it sees the reads the turn started; their completions
come back on this thread, no hand-over, and are run at the start of the next turn). It sleeps
at most `_TICK_S` between turns while its owner is busy (fetches or connects running),
`_IDLE_TICK_S` otherwise: an idle consumer wakes ten times a second for its heartbeats, not a
hundred. While reads it drives are in flight it turns again when their next poll is due (what
`drive` returns: 0.2-2 ms, `kvxfer.transport.completion`); ZeroMQ's poll counts whole
milliseconds, so under one it sleeps, then polls without waiting. Work that grows with what
is in flight (every fetch's deadline) runs once per `_TICK_S` (`sweep_due`), not every turn.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable

import zmq

from kvxfer.connector.turns import TurnClock

log = logging.getLogger(__name__)

_TICK_S = 0.01  # the loop's longest sleep while busy: fetch deadlines are checked this often
# Idle: heartbeats (every `heartbeat_s`, 0.5 s by default) and peers' silence (2 s) only.
# Measured with benchmarks/latency.py (four idle consumers in one process): see RESULTS.md.
_IDLE_TICK_S = 0.1
_SLEEP_UNDER_S = 0.001  # a wait for reads shorter than this sleeps (ZeroMQ's poll counts ms)


class EventLoop:
    """One thread: poll, drain readable sockets, run posted events, tick.

    Args:
        name: the thread's name.
        owner: who runs it, for the log of an internal error.
        sockets: the sockets to poll, asked every turn.
        drain: reads everything waiting on a readable socket.
        tick: runs once a turn, after the posted events.
        busy: whether the owner has work whose deadlines need the short tick (default: always).
        drive: moves the owner's reads on, once a turn after the tick; returns the seconds
            until it wants the next turn, or None when no read is in flight (default: none to
            drive).
    """

    def __init__(
        self,
        name: str,
        owner: str,
        sockets: Callable[[], list[zmq.Socket]],
        drain: Callable[[zmq.Socket], None],
        tick: Callable[[], None],
        busy: Callable[[], bool] = lambda: True,
        drive: Callable[[], float | None] | None = None,
    ) -> None:
        self._owner, self._sockets, self._drain, self._tick = owner, sockets, drain, tick
        self._busy, self._drive = busy, drive
        self._clock = TurnClock(log, f"consumer {owner} loop")
        self._reads_due_in: float | None = None  # what the last turn's `drive` returned
        self._events: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        self._woken = False  # a byte is in the pipe that the loop has not read yet
        os.set_blocking(self._wake_w, False)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._swept = time.monotonic()

    def start(self) -> None:
        """Start the thread."""
        self._thread.start()

    def post(self, event: Callable[[], None]) -> None:
        """(any thread) Run `event` on the loop, soon (posted by the loop itself: within this
        turn or at the start of the next, which does not sleep then)."""
        self._events.put(event)
        if threading.current_thread() is not self._thread:
            self.wake()

    def wake(self) -> None:
        """(any thread) End the loop's sleep now.

        One byte in the pipe until the loop reads it: a loop already woken is not written to
        again (each write and read is a system call that gives up the GIL, and a busy consumer
        posted several events per turn). Safe without a lock: the loop clears `_woken` after it
        read the pipe and before it runs what was posted, so an event whose write was skipped
        is run by that turn, and `_woken` is set only by a caller about to write."""
        fd = self._wake_w
        if fd < 0:
            return  # closed
        if self._woken:
            return
        self._woken = True
        with contextlib.suppress(BlockingIOError):  # a full pipe wakes the loop anyway
            os.write(fd, b"x")

    def sweep_due(self, now: float) -> bool:
        """(the loop) Whether `_TICK_S` has passed since the last sweep (then this one is
        it): how often the owner looks at everything in flight, whatever the turns."""
        if now - self._swept < _TICK_S:
            return False
        self._swept = now
        return True

    def run_posted(self) -> None:
        """(the loop) Run every event posted so far."""
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return
            event()

    def stop(self) -> None:
        """(the loop) End the loop after this turn."""
        self._stop.set()

    def join(self) -> None:
        """(another thread) Wait for the loop to end."""
        self._thread.join()

    def close(self) -> None:
        """(another thread, once the loop ended) Close the wake-up pipe; `wake` is a no-op from
        now on."""
        wake_r, wake_w = self._wake_r, self._wake_w
        self._wake_w = -1  # callbacks that still come must not write to a reused descriptor
        os.close(wake_r)
        os.close(wake_w)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        registered: set[zmq.Socket] = set()
        while not self._stop.is_set():
            sockets = set(self._sockets())
            for sock in registered - sockets:
                poller.unregister(sock)
            for sock in sockets - registered:
                poller.register(sock, zmq.POLLIN)
            registered = sockets
            self._clock.waiting()
            slept, reads_due_in = 0.0, self._reads_due_in
            if not self._events.empty():  # posted by this thread late in the last turn
                timeout_ms = 0
            elif reads_due_in is not None and reads_due_in < _SLEEP_UNDER_S:
                time.sleep(reads_due_in)
                timeout_ms, slept = 0, reads_due_in
            else:
                wait = _TICK_S if self._busy() else _IDLE_TICK_S
                if reads_due_in is not None:
                    wait = min(wait, reads_due_in)
                timeout_ms = int(wait * 1000)
            readable = poller.poll(timeout_ms)
            self._clock.polled(slept + timeout_ms / 1000)
            for sock_or_fd, _ in readable:
                if sock_or_fd == self._wake_r:
                    os.read(self._wake_r, 4096)
                    self._woken = False  # after the read, before the posted run: see `wake`
                else:
                    self._drain(sock_or_fd)
            self._guarded(self.run_posted)
            self._guarded(self._tick)
            self._guarded(self._drive_reads)
            if self._clock.turn_was_long():
                self._clock.report_turn(f"{len(readable)} readable sockets, posted events, tick")

    def _drive_reads(self) -> None:
        self._reads_due_in = None  # until the drive says otherwise: a failed one must not spin
        if self._drive is not None:
            self._reads_due_in = self._drive()

    def _guarded(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:  # a bug must not stop every other fetch: log it, go on
            log.exception("consumer %s: internal error", self._owner)
