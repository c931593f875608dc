"""The connector's pipeline on the CPU: one request moved with several chunks in flight per peer,
against the same chunks moved one at a time.

    .venv/bin/python benchmarks/pipeline_overlap.py                  # one line
    .venv/bin/python benchmarks/pipeline_overlap.py --json           # one JSON object

One prefill rank and one decode rank (TP 1 -> 1, 16-token blocks -> 32-token blocks, bf16),
each with its own Mooncake engine in this process, over TCP loopback (as `kvxfer bench`, whose
helpers this reuses), torch backend, strategy pack+unpack: every chunk is packed by the
producer, read by the consumer and copied into its cache. Two producer/consumer pairs are built
with the same slot size, hence the same chunks:

- pipelined: `--slots` staging slots on both sides (`staging_slots`): the producer packs the
  next chunks while earlier ones are read and copied into the cache;
- serialized: one slot: pack, read, copy into the cache, then the next chunk is asked for.

Runs alternate between the two (so a noisy neighbour hits both alike), after one warm-up each;
the median of `--repeat` is reported, with the ratio serialized / pipelined and whether both
destination caches came out bit-identical.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch

from kvxfer.cli.bench import BenchConfig, _side, _table
from kvxfer.connector import KVConsumer, KVProducer
from kvxfer.spec import KVCacheSpec, allocate_kv_caches

MiB = 1 << 20


class _Pair:
    """A producer and a consumer with `slots` staging slots of `slot_bytes` each, both sides."""

    def __init__(
        self,
        src: KVCacheSpec,
        src_caches: list[torch.Tensor],
        dst: KVCacheSpec,
        args: argparse.Namespace,
        slots: int,
    ) -> None:
        staging = {"staging_bytes": args.slot_mib * MiB * slots, "staging_slots": slots}
        self.slots = slots
        self.caches = allocate_kv_caches(dst)
        self.producer = KVProducer(
            src, src_caches, "prefill", protocol=args.protocol, backend="torch", **staging
        )
        self.consumer = KVConsumer(
            dst,
            self.caches,
            "decode",
            protocol=args.protocol,
            backend="torch",
            strategy=args.strategy,
            timeout_s=600,
            **staging,
        )
        self.consumer.connect([self.producer.address])
        self.runs = 0
        self.seconds: list[float] = []
        self.cpu_seconds: list[float] = []
        self.bytes = self.chunks = 0

    def move(self, src_ids: np.ndarray, dst_ids: np.ndarray, tokens: int, timed: bool) -> None:
        request_id = f"req-{self.runs}"
        self.runs += 1
        began, began_cpu = time.perf_counter(), time.process_time()
        self.producer.publish(request_id, src_ids, tokens)
        handle = self.consumer.fetch(request_id, dst_ids, tokens)
        result = handle.wait()
        seconds, cpu = time.perf_counter() - began, time.process_time() - began_cpu
        if not result.ok:
            raise RuntimeError(f"transfer failed: {result.errors}")
        self.bytes, self.chunks = result.bytes, handle.chunks_total
        if timed:
            self.seconds.append(seconds)
            self.cpu_seconds.append(cpu)

    def close(self) -> None:
        self.consumer.close()
        self.producer.close()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Both modes, alternating; one result dict."""
    torch.set_num_threads(args.torch_threads)
    cfg = BenchConfig(
        1,
        1,
        kv_heads=args.kv_heads,
        layers=args.layers,
        tokens=args.tokens,
        head_dim=args.head_dim,
        block_size=16,
        dst_block_size=32,
        protocol=args.protocol,
    )
    (src,), (dst,) = _side(cfg, 1, cfg.block_size), _side(cfg, 1, cfg.dst_block_size)
    src_caches = allocate_kv_caches(src)
    for t in src_caches:
        t.view(torch.int16).random_()
    src_ids, dst_ids = _table(src, cfg.tokens, 1), _table(dst, cfg.tokens, 100)
    pairs = {"pipelined": _Pair(src, src_caches, dst, args, args.slots)}
    try:
        pairs["serialized"] = _Pair(src, src_caches, dst, args, 1)
        for pair in pairs.values():  # warm-up: connections, staging pages, allocator
            pair.move(src_ids, dst_ids, cfg.tokens, timed=False)
        for _ in range(args.repeat):
            for pair in pairs.values():
                pair.move(src_ids, dst_ids, cfg.tokens, timed=True)
        pipelined, serialized = pairs["pipelined"], pairs["serialized"]
        identical = all(
            torch.equal(a.view(torch.int16), b.view(torch.int16))
            for a, b in zip(pipelined.caches, serialized.caches, strict=True)
        )
    finally:
        for pair in pairs.values():
            pair.close()
    p_s, s_s = statistics.median(pipelined.seconds), statistics.median(serialized.seconds)
    return {
        "tokens": cfg.tokens,
        "layers": cfg.layers,
        "kv_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "bytes": pipelined.bytes,
        "chunks": pipelined.chunks,
        "slot_bytes": args.slot_mib * MiB,
        "strategy": args.strategy,
        "protocol": args.protocol,
        "backend": "torch",
        "repeat": args.repeat,
        "pipelined_slots": pipelined.slots,
        "pipelined_s": p_s,
        "serialized_s": s_s,
        "pipelined_gbps": pipelined.bytes / p_s / 1e9,
        "serialized_gbps": serialized.bytes / s_s / 1e9,
        "pipelined_cpu_s": statistics.median(pipelined.cpu_seconds),
        "serialized_cpu_s": statistics.median(serialized.cpu_seconds),
        "speedup": s_s / p_s,
        "identical": identical,
    }


def format_result(r: dict[str, Any]) -> str:
    return (
        f"{r['tokens']} tokens, {r['bytes'] / 1e6:.1f} MB in {r['chunks']} chunks "
        f"({r['strategy']}, {r['protocol']}, {r['backend']}): "
        f"pipelined ({r['pipelined_slots']} slots) {r['pipelined_s'] * 1e3:.1f} ms "
        f"{r['pipelined_gbps']:.2f} GB/s, serialized (1 slot) {r['serialized_s'] * 1e3:.1f} ms "
        f"{r['serialized_gbps']:.2f} GB/s, x{r['speedup']:.2f}; "
        f"caches {'identical' if r['identical'] else 'DIFFER'}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--slots", type=int, default=4, help="slots per side when pipelined")
    parser.add_argument("--slot-mib", type=int, default=4, help="MiB per staging slot")
    parser.add_argument("--strategy", default="pack+unpack")
    parser.add_argument("--protocol", default="tcp", choices=("tcp", "rdma"))
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--verbose", action="store_true", help="Mooncake's own logs too")
    args = parser.parse_args(argv)

    from kvxfer.cli.native_logs import filtered_stderr, set_mooncake_log_level

    set_mooncake_log_level(args.verbose)
    if args.verbose:
        result = measure(args)
    else:
        with filtered_stderr():
            result = measure(args)
    print(json.dumps(result, indent=2) if args.json else format_result(result))
    return 0 if result["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
