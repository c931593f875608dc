"""How long a Mooncake submit to a frozen peer takes: the first transfer to it, and one after a
transfer to it has opened its segment.

    MC_LOG_LEVEL=ERROR .venv/bin/python benchmarks/studies/frozen_first_read.py

A peer process registers 1 MiB and is SIGSTOPped; this process submits a 4 KiB read to it with
`batch_transfer_async_read` on its main thread while a second thread ticks every 10 ms, first
without any earlier transfer to the peer ("first"), then, with a new peer, after one read from it
("after a read"). Prints each submit's return value and time, and the longest gap between ticks
meanwhile (the GIL held through the submit would show as a gap as long as the submit). Mooncake
opens a peer's segment (its handshake with the peer's RPC port) inside the first transfer to
it: the conclusion is in docs/connectors.md, "Isolation". Nothing is asserted.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from typing import Any

import numpy as np

SIZE = 1 << 20


def _engine() -> tuple[Any, np.ndarray]:
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    memory = np.zeros(SIZE, np.uint8)
    engine.register_memory(memory.ctypes.data, memory.nbytes)
    return engine, memory


def peer(answers: Any) -> None:
    """(the peer process) Register memory, say where, then wait to be stopped and killed."""
    engine, memory = _engine()
    answers.put((f"127.0.0.1:{engine.get_rpc_port()}", memory.ctypes.data))
    time.sleep(3600)


def submit_to_frozen(warm: bool) -> str:
    """Start a peer, read from it first if `warm`, SIGSTOP it, time one submit to it."""
    answers: Any = mp.get_context("spawn").Queue()
    process = mp.get_context("spawn").Process(target=peer, args=(answers,), daemon=True)
    process.start()
    endpoint, address = answers.get(timeout=120)
    engine, memory = _engine()
    local = memory.ctypes.data
    if warm:
        engine.batch_transfer_sync_read(endpoint, [local], [address], [4096])
    assert process.pid is not None
    os.kill(process.pid, signal.SIGSTOP)
    time.sleep(0.5)
    ticks: list[float] = []
    ticking = True

    def tick() -> None:
        while ticking:
            ticks.append(time.monotonic())
            time.sleep(0.01)

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    began = time.monotonic()
    batch = engine.batch_transfer_async_read(endpoint, [local], [address], [4096])
    took = time.monotonic() - began
    ticking = False
    ticker.join()
    gaps = np.diff([t for t in ticks if began - 0.05 <= t <= began + took + 0.05])
    os.kill(process.pid, signal.SIGKILL)
    process.join()
    longest = f"{gaps.max():.2f} s" if gaps.size else "none (no tick)"
    return f"returned {batch} after {took:.2f} s; longest gap between ticks {longest}"


def main() -> None:
    """Both cases, one after the other."""
    print("first transfer to a frozen peer:", submit_to_frozen(warm=False))
    print("after a read from it:          ", submit_to_frozen(warm=True))


if __name__ == "__main__":
    main()
