"""Host cost of the CPU backend's pack and unpack (`kvxfer.kernels.copy_cells_torch`): what one
chunk's local copies cost a short request on this machine, alone and with other threads
copying at once.

    .venv/bin/python benchmarks/torch_copy.py            # a table
    .venv/bin/python benchmarks/torch_copy.py --json     # one JSON object
    .venv/bin/python benchmarks/torch_copy.py --quick    # the test's small run
    .venv/bin/python benchmarks/torch_copy.py --record   # RESULTS.md's row

The pair of `benchmarks/latency.py`: a prefill rank of TP 2 (4 of 8 KV heads, blocks of 16,
NHD) packs 2 heads into the wire buffer; a decode rank of TP 4 (2 heads, blocks of 32, HND)
unpacks them; 8 layers, head_dim 128, bf16, one torch thread, each copy as the connectors make
it (its `KVBuffer`s built per call, the cache's layer tensors the same every call). Medians of
`--repeats` rounds of `--calls` calls:

- `alone_us`: one thread, one copy after another: the wall (and CPU) time of a copy;
- `threads_wall_us`, `threads_cpu_us`: `--threads` threads copying at once (each its own cache
  and wire buffer, as the ranks of one process do): wall time and CPU time of the process per
  copy. Python holds one lock (the GIL) that every torch call gives up and takes back, so
  threads that copy at once hand it to each other many times per copy.

Every size's pack and unpack are first checked bit for bit against plain indexing of the
canonical views. Speed is measured, never asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvxfer.kernels import KVBuffer, gather_kv_torch, scatter_kv_torch, wire_kv_buffer
from kvxfer.kernels.buffers import canonical_kv_view
from kvxfer.testing.results import Benchmark

LAYERS, HEADS, MOVED, HEAD_DIM = 8, 4, 2, 128  # the prefill rank's heads, the decode rank's
SRC_BLOCK, DST_BLOCK = 16, 32
BENCHMARK = Benchmark(
    name="torch_copy",
    title="CPU pack and unpack (torch backend)",
    command=".venv/bin/python benchmarks/torch_copy.py",
    results_dir=Path(__file__).resolve().parent / "results",
)
DEFAULT_TOKENS = (16, 256, 2048)


class _Pair:
    """One rank pair's buffers for `tokens` tokens: a prefill cache, the wire, a decode cache."""

    def __init__(self, tokens: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        src_blocks, dst_blocks = -(-tokens // SRC_BLOCK), -(-tokens // DST_BLOCK)
        shape = (2, 2 * src_blocks + 1, SRC_BLOCK, HEADS, HEAD_DIM)
        self.src = [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(LAYERS)]
        self.src_ids = torch.randperm(2 * src_blocks + 1, generator=gen)[:src_blocks]
        self.wire = torch.empty(LAYERS, 2, tokens, MOVED, HEAD_DIM, dtype=torch.bfloat16)
        shape = (2, 2 * dst_blocks + 1, MOVED, DST_BLOCK, HEAD_DIM)
        self.dst = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(LAYERS)]
        self.dst_ids = torch.randperm(2 * dst_blocks + 1, generator=gen)[:dst_blocks]
        self.tokens = tokens

    def pack(self) -> None:
        cache = KVBuffer(self.src, "NHD", "kv_first", False, self.src_ids, 0, MOVED)
        gather_kv_torch(cache, wire_kv_buffer(self.wire, 0), 0, self.tokens, MOVED)

    def unpack(self) -> None:
        cache = KVBuffer(self.dst, "HND", "kv_first", False, self.dst_ids, 0, 0)
        scatter_kv_torch(wire_kv_buffer(self.wire, 0), cache, 0, self.tokens, MOVED)

    def check(self) -> None:
        """Pack then unpack, each compared with plain indexing of the canonical views."""
        tokens = torch.arange(self.tokens)
        self.pack()
        self.unpack()
        for layer in range(LAYERS):
            src = canonical_kv_view(self.src[layer], "NHD", "kv_first", False)
            moved = src[:, self.src_ids[tokens // SRC_BLOCK], tokens % SRC_BLOCK, MOVED:]
            if not torch.equal(self.wire[layer].view(torch.int16), moved.view(torch.int16)):
                raise AssertionError(f"{self.tokens} tokens: the pack of layer {layer} differs")
            dst = canonical_kv_view(self.dst[layer], "HND", "kv_first", False)
            landed = dst[:, self.dst_ids[tokens // DST_BLOCK], tokens % DST_BLOCK]
            if not torch.equal(landed.view(torch.int16), moved.view(torch.int16)):
                raise AssertionError(f"{self.tokens} tokens: the unpack of layer {layer} differs")


def _alone(copy: Callable[[], None], calls: int) -> tuple[float, float]:
    began, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        copy()
    return (time.perf_counter() - began) / calls, (time.process_time() - cpu) / calls


def _together(copies: list[Callable[[], None]], calls: int) -> tuple[float, float]:
    start = threading.Barrier(len(copies) + 1)

    def run(copy: Callable[[], None]) -> None:
        start.wait()
        for _ in range(calls):
            copy()

    threads = [threading.Thread(target=run, args=(c,)) for c in copies]
    for t in threads:
        t.start()
    start.wait()
    began, cpu = time.perf_counter(), time.process_time()
    for t in threads:
        t.join()
    done = len(copies) * calls
    return (time.perf_counter() - began) / done, (time.process_time() - cpu) / done


def measure(tokens: list[int], threads: int, calls: int, repeats: int) -> dict[str, Any]:
    """The table's rows (see the module docstring)."""
    torch.set_num_threads(1)
    rows = []
    for n in tokens:
        pairs = [_Pair(n, seed) for seed in range(max(threads, 1))]
        for pair in pairs:
            pair.check()
        for direction in ("pack", "unpack"):
            copies = [getattr(p, direction) for p in pairs]
            for copy in copies:
                copy()  # warm
            alone = [_alone(copies[0], calls) for _ in range(repeats)]
            together = [_together(copies, calls) for _ in range(repeats)]
            rows.append(
                {
                    "tokens": n,
                    "direction": direction,
                    "bytes": pairs[0].wire.numel() * 2,
                    "alone_us": statistics.median(w for w, _ in alone) * 1e6,
                    "threads": threads,
                    "threads_wall_us": statistics.median(w for w, _ in together) * 1e6,
                    "threads_cpu_us": statistics.median(c for _, c in together) * 1e6,
                }
            )
    return {"rows": rows, "config": {"calls": calls, "repeats": repeats, "checked": True}}


def figure(result: dict[str, Any]) -> tuple[str, str]:
    """The page's figure: each size's pack and unpack, alone (no target)."""
    by_tokens: dict[int, dict[str, float]] = {}
    for row in result["rows"]:
        by_tokens.setdefault(row["tokens"], {})[row["direction"]] = row["alone_us"]
    parts = [
        f"{n:,} tokens: pack {d['pack']:.0f} µs, unpack {d['unpack']:.0f} µs alone"
        for n, d in sorted(by_tokens.items())
    ]
    return "; ".join(parts), "none"


def main(argv: list[str] | None = None) -> None:
    """Measure; print a table or one JSON object."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")],
                        default=list(DEFAULT_TOKENS))  # fmt: skip
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="16 tokens, 2 threads, a few calls")
    BENCHMARK.add_record_flag(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.threads, args.calls, args.repeats = [16], 2, 3, 1
    result = measure(args.tokens, args.threads, args.calls, args.repeats)
    BENCHMARK.record(args.record, argv, result, figure)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    x = f"x{args.threads}"
    print(
        f"{'tokens':>7} {'copy':>7} {'KiB':>7} {'alone us':>9} "
        f"{x + ' wall us':>12} {x + ' CPU us':>11}"
    )
    for r in result["rows"]:
        print(
            f"{r['tokens']:>7} {r['direction']:>7} {r['bytes'] / 1024:>7.0f} {r['alone_us']:>9.0f} "
            f"{r['threads_wall_us']:>12.0f} {r['threads_cpu_us']:>11.0f}"
        )


if __name__ == "__main__":
    main()
