"""Freezing a test's processes for real: SIGSTOP, then wait until every thread has stopped.

`os.kill(pid, SIGSTOP)` returns once the signal is queued. Each thread stops only when it next
passes through the kernel's signal path, and a thread waiting for a CPU (a loaded machine) or in
an uninterruptible wait gets there late: until then the others run on, and a "frozen" producer
still answers (issue 22: an encoder-cache producer answered a query 7 ms after its SIGSTOP).
A test that means "frozen" waits for the kernel to report every thread stopped. The threads'
states are read from /proc, so this works for any process of the user, children of a
forkserver included (`os.waitid` sees only one's own children).
"""

from __future__ import annotations

import os
import signal
import time


def thread_states(pid: int) -> dict[int, str]:
    """The scheduler state of each of a process's threads ("R", "S", "D", "T", ...)."""
    states = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states[int(tid)] = f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:  # the thread ended meanwhile
            continue
    return states


def stopped(pid: int) -> bool:
    """Whether every thread of process `pid` has stopped (job-control stop, or traced)."""
    states = thread_states(pid)
    return bool(states) and all(state in ("T", "t") for state in states.values())


def wait_stopped(pid: int, timeout: float = 30.0) -> None:
    """Wait until every thread of process `pid` has stopped.

    The kernel offers no event for another process's threads stopping (a parent's
    `waitid(WSTOPPED)` is one, but only for its own children): this polls /proc every
    millisecond, a wait on the kernel's state, not a guess at how long a stop takes.

    Raises:
        TimeoutError: not stopped within `timeout` seconds.
    """
    deadline = time.monotonic() + timeout
    while not stopped(pid):
        if time.monotonic() >= deadline:
            raise TimeoutError(f"process {pid} did not stop within {timeout} s of its SIGSTOP")
        time.sleep(0.001)


def freeze(pid: int, timeout: float = 30.0) -> None:
    """SIGSTOP process `pid` and wait until every thread of it has stopped."""
    os.kill(pid, signal.SIGSTOP)
    wait_stopped(pid, timeout)
