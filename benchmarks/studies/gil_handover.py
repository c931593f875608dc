"""What a call that gives up the GIL costs beside a thread that keeps it busy.

    .venv/bin/python benchmarks/studies/gil_handover.py

pyzmq gives up the GIL in every send and receive; numpy keeps it in a small gather or scatter.
A thread that gives it up takes it back only when the thread now holding it gives it up in
turn, at the latest after `sys.getswitchinterval()` (5 ms): so beside a busy thread, each such
call costs up to that interval, however short the call itself. Prints the microseconds per call
of a small ZeroMQ send (three frames over TCP on 127.0.0.1), a 64-row numpy gather and scatter,
and a short Python loop, alone and beside one thread spinning in Python. Nothing is asserted.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

import numpy as np
import zmq


def per_call_us(call: Callable[[], object], calls: int) -> float:
    """Microseconds per call of `call`, over `calls` calls."""
    began = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - began) / calls * 1e6


def main() -> None:
    """Time each call alone, then beside a spinning thread."""
    rows = np.random.default_rng(0).permutation(4096)[:64]
    reads, writes = np.zeros((4096, 32), np.int64), np.zeros((4096, 32), np.int64)
    context = zmq.Context()
    inbox = context.socket(zmq.PAIR)
    inbox.bind("tcp://127.0.0.1:*")
    outbox = context.socket(zmq.PAIR)
    outbox.connect(str(inbox.getsockopt_string(zmq.LAST_ENDPOINT)))
    frames = [b"x" * 16, b"y" * 200, b"z" * 32]
    calls: dict[str, Callable[[], object]] = {
        "zmq send_multipart": lambda: outbox.send_multipart(frames, zmq.NOBLOCK),
        "numpy take, 64 rows": lambda: np.take(reads, rows, axis=0, out=writes[:64]),
        "numpy scatter, 64 rows": lambda: writes.__setitem__(rows, reads[:64]),
        "python, 50 additions": lambda: sum(range(50)),
    }
    alone = {name: per_call_us(call, 500) for name, call in calls.items()}
    spinning = True

    def spin() -> None:
        while spinning:
            pass

    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    beside = {name: per_call_us(call, 50) for name, call in calls.items()}
    spinning = False
    spinner.join()
    print(f"switch interval {sys.getswitchinterval()} s")
    print(f"{'call':<26}{'alone us':>10}{'beside a busy thread us':>26}")
    for name in calls:
        print(f"{name:<26}{alone[name]:>10.1f}{beside[name]:>26.1f}")
    context.destroy(linger=0)


if __name__ == "__main__":
    main()
