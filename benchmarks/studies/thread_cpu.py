"""Where a fetch's CPU goes, thread by thread (Linux: `/proc/self/task`), in one process.

    MC_LOG_LEVEL=ERROR .venv/bin/python benchmarks/studies/thread_cpu.py pair
    MC_LOG_LEVEL=ERROR .venv/bin/python benchmarks/studies/thread_cpu.py pair --tokens 2048 \\
        --kv-heads 12 --dst-layout NHD --fetches 20 --time-copies
    MC_LOG_LEVEL=ERROR .venv/bin/python benchmarks/studies/thread_cpu.py bench --pairs 2:4

`pair`: one producer rank (of a TP-2 prefill engine, blocks of 16, NHD) and one consumer rank (of
a TP-4 decode engine, blocks of 32, HND by default; 8 layers, heads of 128, bf16: the geometry of
`benchmarks/latency.py`), over Mooncake TCP on 127.0.0.1, one fetch after another, each of a
freshly published request; prints the median fetch time, the process's CPU per fetch, and each
thread's CPU per fetch. `--time-copies` then times the last fetch's pack and unpack alone, 20
times each on their own arguments.

`bench`: `kvxfer bench` for the given pairs, printing each thread's CPU per timed run around
the kvxfer and the contiguous runs.

Threads are named for the OS when they start (kvxfer's own by their Python names; Mooncake's
C++ threads keep the process's name, "python"). Nothing is asserted: it prints what it saw.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

_PR_SET_NAME = 15


def _name_os_threads() -> None:
    """Give every Python thread started from now on its name in `/proc` (the last 15 bytes)."""
    libc = ctypes.CDLL(None)
    run = threading.Thread.run

    def named(self: threading.Thread) -> None:
        libc.prctl(_PR_SET_NAME, self.name[-15:].encode(), 0, 0, 0)
        run(self)

    threading.Thread.run = named  # type: ignore[method-assign]


def _thread_ticks() -> dict[str, tuple[str, int]]:
    """CPU clock ticks (user + system) of every thread of this process, by thread id."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # ended meanwhile
            continue
        name = "main" if int(tid) == os.getpid() else stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[tid] = (name, int(fields[11]) + int(fields[12]))
    return out


def _per_thread_ms(before: dict[str, tuple[str, int]], runs: int) -> dict[str, float]:
    """Each thread name's CPU milliseconds per run since `before`."""
    ticks = collections.Counter[str]()
    for tid, (name, now) in _thread_ticks().items():
        ticks[name] += now - before.get(tid, (name, 0))[1]
    per_tick_ms = 1000 / os.sysconf("SC_CLK_TCK")
    return {name: round(t * per_tick_ms / runs, 3) for name, t in ticks.most_common() if t}


def run_pair(args: argparse.Namespace) -> None:
    import numpy as np
    import torch

    import kvxfer.connector.consumer.copies as copies_mod
    import kvxfer.connector.producer.packing as producer_mod
    from kvxfer.connector import KVConsumer, KVProducer
    from kvxfer.spec import allocate_kv_caches
    from kvxfer.testing.geometry import Geometry

    torch.set_num_threads(1)
    copies: dict[str, tuple[Callable[..., None], tuple[Any, ...]]] = {}
    for module, kind in ((producer_mod, "pack"), (copies_mod, "unpack")):
        real = module.run_cell_copy

        def kept(*a: Any, _real: Callable[..., None] = real, _kind: str = kind) -> None:
            copies[_kind] = (_real, a)
            _real(*a)

        module.run_cell_copy = kept  # type: ignore[attr-defined]
    tokens, heads = args.tokens, args.kv_heads
    src_blocks, dst_blocks = -(-tokens // 16), -(-tokens // 32)
    src_g = Geometry(tp=2, heads=heads, block_size=16, layout="NHD", layers=8, head_dim=128,
                     num_blocks=2 * src_blocks + 2)  # fmt: skip
    dst_g = Geometry(tp=4, heads=heads, block_size=32, layout=args.dst_layout, layers=8,
                     head_dim=128, num_blocks=2 * dst_blocks + 2)  # fmt: skip
    staging = {"staging_bytes": 64 << 20}
    producers = [KVProducer(src_g.spec(r), allocate_kv_caches(src_g.spec(r)), "prefill",
                            **staging) for r in range(2)]  # fmt: skip
    consumer = KVConsumer(dst_g.spec(0), allocate_kv_caches(dst_g.spec(0)), "decode", **staging)
    consumer.connect([p.address for p in producers])
    src_ids = np.arange(src_blocks) * 2  # scattered: every other block
    dst_ids = np.arange(dst_blocks) * 2 + 1

    def fetches(n: int, tag: str) -> list[float]:
        walls = []
        for i in range(n):
            request_id = f"{tag}{i}"
            producers[0].publish(request_id, src_ids, tokens)
            began = time.perf_counter()
            result = consumer.fetch(request_id, dst_ids, tokens).wait(60)
            walls.append(time.perf_counter() - began)
            if not result.ok:
                raise RuntimeError(f"fetch failed: {result.errors}")
        return walls

    fetches(args.warmup, "warm")
    before, cpu = _thread_ticks(), time.process_time()
    walls = fetches(args.fetches, "timed")
    cpu_ms = (time.process_time() - cpu) / args.fetches * 1e3
    threads = _per_thread_ms(before, args.fetches)
    print(f"{tokens} tokens, {args.fetches} fetches: median {statistics.median(walls) * 1e3:.2f} "
          f"ms, CPU {cpu_ms:.2f} ms per fetch")  # fmt: skip
    for name, ms in threads.items():
        print(f"  {name:18s} {ms:8.3f} ms per fetch")
    if args.time_copies:
        for kind in ("pack", "unpack"):
            real, call = copies[kind]
            began = time.perf_counter()
            for _ in range(20):
                real(*call)
            print(f"  {kind} alone: {(time.perf_counter() - began) / 20 * 1e3:.2f} ms")
    consumer.close()
    for p in producers:
        p.close()


def run_bench(args: argparse.Namespace) -> int:
    import kvxfer.cli.bench as bench
    from kvxfer.cli import main

    timed = bench._median_seconds

    def with_threads(fn: Callable[[], None], repeat: int, *rest: Any) -> tuple[float, float]:
        before = _thread_ticks()
        result = timed(fn, repeat, *rest)
        print(f"{rest[-1]}: CPU ms per run by thread: {_per_thread_ms(before, repeat)}")
        return result

    bench._median_seconds = with_threads  # type: ignore[assignment]
    return main(["bench", "--pairs", args.pairs, "--repeat", str(args.repeat)])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    pair = sub.add_parser("pair", help="one producer, one consumer, fetch after fetch")
    pair.add_argument("--tokens", type=int, default=16)
    pair.add_argument("--kv-heads", type=int, default=8)
    pair.add_argument("--dst-layout", choices=["NHD", "HND"], default="HND")
    pair.add_argument("--fetches", type=int, default=2000)
    pair.add_argument("--warmup", type=int, default=200)
    pair.add_argument("--time-copies", action="store_true")
    b = sub.add_parser("bench", help="kvxfer bench with CPU per thread")
    b.add_argument("--pairs", default="2:4")
    b.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    _name_os_threads()
    if args.mode == "pair":
        run_pair(args)
        return 0
    return run_bench(args)


if __name__ == "__main__":
    sys.exit(main())
