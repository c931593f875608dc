"""Encoder outputs shared by the encoder-cache tests, reproducible in every process."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import signal
import time
from collections.abc import Callable

import torch

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
SHAPES = [(1, 7), (16, 64), (3, 5, 8), (577, 32)]


def items() -> dict[str, torch.Tensor]:
    """Tensors of every dtype and shape, keyed by the hash of their content."""
    out = {}
    for i, dtype in enumerate(DTYPES):
        for j, shape in enumerate(SHAPES):
            gen = torch.Generator().manual_seed(100 * i + j)
            tensor = torch.randn(shape, generator=gen).to(dtype)
            digest = hashlib.sha256(tensor.view(torch.uint8).numpy().tobytes()).hexdigest()
            out[digest[:32]] = tensor
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(
            a.contiguous().reshape(-1).view(torch.uint8),
            b.contiguous().reshape(-1).view(torch.uint8),
        )
    )


def zero_dim_items() -> dict[str, torch.Tensor]:
    """0-d tensors (and empty ones) of several dtypes, with bit patterns worth checking."""
    return {
        "zero-d-f32": torch.tensor(-0.0, dtype=torch.float32),
        "zero-d-bf16": torch.tensor(3.140625, dtype=torch.bfloat16),
        "zero-d-f16": torch.tensor(float("inf"), dtype=torch.float16),
        "zero-d-i64": torch.tensor(-(2**62) - 7, dtype=torch.int64),
        "zero-d-bool": torch.tensor(True),
        "empty-f32": torch.empty(0, 5, dtype=torch.float32),
    }


def producer_process(name: str, config: dict, conn, picks=None, extra=None) -> None:
    """Save items with connector `name` (all of `items()`, or those at the indices `picks`,
    plus `extra` {hash: (shape, seed)} float32 tensors), report its address, serve until told
    to stop."""
    import os

    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    from kvxfer.ec import ECConnectorFactory

    connector = ECConnectorFactory.create(name, "producer", config)
    for i, (mm_hash, tensor) in enumerate(items().items()):
        if picks is None or i in picks:
            connector.save(mm_hash, tensor)
    for mm_hash, (shape, seed) in (extra or {}).items():
        connector.save(mm_hash, big(shape, seed))
    conn.send(getattr(connector, "address", None))
    assert conn.recv() == "stop"
    connector.close()
    conn.send("closed")


def some_items_process(name: str, config: dict, picks, extra, conn) -> None:
    """`producer_process` with the pipe last (for starters that append it)."""
    producer_process(name, config, conn, picks, extra)


def big(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A reproducible float32 tensor of any size (cheap to make: no normal sampling)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**31), 2**31 - 1, shape, generator=gen, dtype=torch.int32).view(
        torch.float32
    )


def reader_process(
    config: dict, warm: str, mm_hash: str, shape: tuple[int, ...], seed: int, conn
) -> None:
    """A Mooncake encoder-cache consumer that loads `warm` (its session and Mooncake's
    handshake are then done), loads `mm_hash` (expected: `big(shape, seed)`) when told to,
    freezes itself (SIGSTOP) as soon as that read is in flight, and once resumed reports the
    load's outcome: ("ok", None) bit for bit, ("wrong", None), or ("failed", why)."""
    import os

    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    from kvxfer.ec import ECConnectorFactory

    connector = ECConnectorFactory.create("PoolECConnector", "consumer", config)
    connector.load(warm)
    conn.send("ready")
    assert conn.recv() == "go"
    handle = connector.start_load([mm_hash])
    while not connector.stats_snapshot()["reads_in_flight"] and not handle.done():
        time.sleep(0.0002)
    conn.send("reading" if not handle.done() else "finished before the freeze")
    os.kill(os.getpid(), signal.SIGSTOP)  # frozen mid-read
    loaded, failed = handle.results(timeout=60)
    if mm_hash in loaded:
        conn.send(("ok" if same_bits(loaded[mm_hash], big(shape, seed)) else "wrong", None))
    else:
        conn.send(("failed", failed[mm_hash]))
    assert conn.recv() == "stop"
    connector.close()
    conn.send("closed")


def holding_producer_process(config: dict, picks, fifo: str, conn) -> None:
    """A Mooncake producer of the items at `picks` that, told "hold", holds its main thread
    in an uninterruptible wait until someone opens `fifo` for writing (`hold_main_thread`),
    then serves on until told "stop"."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    from kvxfer.ec import ECConnectorFactory

    connector = ECConnectorFactory.create("PoolECConnector", "producer", config)
    for i, (mm_hash, tensor) in enumerate(items().items()):
        if i in picks:
            connector.save(mm_hash, tensor)
    conn.send(connector.address)
    while (command := conn.recv()) == "hold":
        hold_main_thread(fifo, lambda: conn.send("holding"))
    assert command == "stop"
    connector.close()
    conn.send("closed")


def hold_main_thread(fifo: str, ready: Callable[[], None]) -> None:
    """Hold the calling thread in an uninterruptible (killable only) sleep until `fifo` is
    opened for writing; the other threads run on, the GIL released. `ready()` is called just
    before: from then on, the thread's state "D" is that sleep.

    glibc's posix_spawn is a vfork: the parent thread waits in the kernel until the child
    execs, and the child first opens `fifo`, which blocks until a writer comes. A SIGSTOP
    cannot wake a thread in that wait, so the process cannot stop until it ends.
    """
    libc = ctypes.CDLL(None, use_errno=True)  # CDLL calls release the GIL
    actions = ctypes.create_string_buffer(256)  # posix_spawn_file_actions_t: 80 bytes
    assert libc.posix_spawn_file_actions_init(actions) == 0
    try:
        assert libc.posix_spawn_file_actions_addopen(actions, 0, fifo.encode(), os.O_RDONLY, 0) == 0
        true = (shutil.which("true") or "/bin/true").encode()
        argv = (ctypes.c_char_p * 2)(true, None)
        pid = ctypes.c_int()
        ready()
        assert libc.posix_spawn(ctypes.byref(pid), true, actions, None, argv, None) == 0
        os.waitpid(pid.value, 0)
    finally:
        libc.posix_spawn_file_actions_destroy(actions)
