"""The constants of `CostModel.tcp_loopback()`, measured on this machine: what the cost model
chooses strategies and chunks with (`kvxfer.plan.cost`).

    MC_LOG_LEVEL=ERROR .venv/bin/python benchmarks/chunk_costs.py            # a table
    MC_LOG_LEVEL=ERROR .venv/bin/python benchmarks/chunk_costs.py --json     # one JSON object

Through kvxfer's own Mooncake transport over TCP loopback (polled, never spinning), medians:

- `seconds_per_op`: a read of 4,096 descriptors of 1 KiB, per descriptor;
- `link_bytes_per_second`: one 16 MiB read at a time (one stream);
- `memory_bytes_per_second`: the torch backend's one-pass pack into the wire buffer and unpack
  out of it (`kvxfer.execute.run_cell_copy`, one thread), for a pair of `kvxfer bench`'s 2->4
  row (3 heads of 128 bf16, 8 layers, blocks of 16 -> 32, 1,024 tokens); a pass reads and
  writes every byte, so this is twice the payload rate;
- `seconds_per_chunk`: the fixed cost of one chunk of a connector's fetch (two side-channel
  round trips and both sides' host work), measured as follows.

One prefill rank and one decode rank (TP 1 -> 1, 16-token blocks -> 32-token blocks, bf16), each
with its own Mooncake engine in this process, over TCP loopback, torch backend, pack+unpack. The
same request is fetched with chunks of `--chunks` tokens (`KVConsumer(chunk_tokens=...)`), one
chunk at a time (one staging slot: pack, read, copy, then the next is asked for), so a fetch
takes `chunks x fixed + bytes x per_byte`: a least-squares line through the medians gives the
fixed cost per chunk (wall and CPU seconds). The same chunk sizes are then run with `--slots`
chunks in flight, which is what the cost model's choice is for. Runs alternate between sizes
(so a noisy neighbour hits all alike), after one warm-up each; every fetch is checked bit for
bit against the first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvxfer.cli.bench import BenchConfig, _side, _table
from kvxfer.connector import KVConsumer, KVProducer
from kvxfer.plan import CostModel
from kvxfer.plan.cost import choose_chunking
from kvxfer.plan.sizing import max_chunk_tokens
from kvxfer.spec import allocate_kv_caches
from kvxfer.testing.results import Benchmark
from kvxfer.testing.timing import median_seconds

BENCHMARK = Benchmark(
    name="chunk_costs",
    title="the cost model's constants",
    command="MC_LOG_LEVEL=ERROR .venv/bin/python benchmarks/chunk_costs.py",
    results_dir=Path(__file__).resolve().parent / "results",
)


def constants() -> dict[str, float]:
    """Per-descriptor, per-byte and per-pass costs (see the module docstring)."""
    from kvxfer.execute import run_cell_copy
    from kvxfer.plan import Segments, plan_pairs
    from kvxfer.plan.program import PairChunk
    from kvxfer.transport import Peer
    from kvxfer.transport.mooncake import MooncakeTransport

    server, client = MooncakeTransport(), MooncakeTransport()
    src = torch.ones(16 << 20, dtype=torch.uint8)
    dst = torch.empty(16 << 20, dtype=torch.uint8)
    remote, local = server.register(src), client.register(dst)
    peer = Peer(server.endpoint, {remote.region_id: remote})

    def segments(length: int, count: int) -> Segments:
        offsets = np.arange(count, dtype=np.int64) * length
        return Segments(
            np.full(count, remote.region_id),
            offsets,
            np.full(count, local.region_id),
            offsets,
            np.full(count, length, dtype=np.int64),
        )

    small, large = segments(1024, 4096), segments(16 << 20, 1)
    per_op = median_seconds(lambda: client.read(small, peer).result(), 5) / 4096
    link = (16 << 20) / median_seconds(lambda: client.read(large, peer).result(), 7)
    client.close()
    server.close()
    cfg = BenchConfig(2, 4, kv_heads=12, tokens=1024)
    srcs, dsts = _side(cfg, 2, 16), _side(cfg, 4, 32)
    plan = plan_pairs(srcs, dsts, strategy="pack+unpack", landing=True)[0]
    s, d = srcs[plan.src_rank], dsts[plan.dst_rank]
    src_caches, dst_caches = allocate_kv_caches(s), allocate_kv_caches(d)
    for t in src_caches:
        t.view(torch.int16).random_()
    src_ids, dst_ids = _table(s, cfg.tokens, 1), _table(d, cfg.tokens, 2)
    t0, t1 = 0, cfg.tokens
    chunk = PairChunk(plan.route, "pack+unpack", s, d, t0, t1, landing=True)
    pack = chunk.pack(chunk.source_blocks(src_ids))
    unpack = chunk.unpack(chunk.destination_blocks(dst_ids))
    assert pack is not None and unpack is not None
    wire = torch.empty(cfg.layers * pack.dst.geometry.layer_elements, dtype=src_caches[0].dtype)
    nbytes = wire.numel() * wire.element_size()
    passes = [
        median_seconds(lambda: run_cell_copy(pack, src_caches, [wire], "torch"), 11),
        median_seconds(lambda: run_cell_copy(unpack, [wire], dst_caches, "torch"), 11),
    ]
    return {
        "seconds_per_op": per_op,
        "link_bytes_per_second": link,
        "memory_bytes_per_second": 2 * nbytes / statistics.mean(passes),
        "pack_payload_gbps": nbytes / passes[0] / 1e9,
        "unpack_payload_gbps": nbytes / passes[1] / 1e9,
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    measured = constants()
    cfg = BenchConfig(
        1, 1, kv_heads=args.kv_heads, layers=args.layers, tokens=args.tokens, head_dim=128
    )
    (src,), (dst,) = _side(cfg, 1, 16), _side(cfg, 1, 32)
    src_caches = allocate_kv_caches(src)
    for t in src_caches:
        t.view(torch.int16).random_()
    src_ids, dst_ids = _table(src, cfg.tokens, 1), _table(dst, cfg.tokens, 100)
    row = cfg.layers * 2 * cfg.kv_heads * cfg.head_dim * 2  # bytes per token
    slot = row * max(args.chunks)
    modes = {"serial": 1, "pipelined": args.slots}
    seconds: dict[tuple[str, int], list[float]] = {}
    cpu: dict[tuple[str, int], list[float]] = {}
    reference: list[torch.Tensor] = []
    identical = True
    rigs: dict[str, tuple[KVProducer, dict[int, KVConsumer]]] = {}
    try:
        for mode, slots in modes.items():
            staging = {"staging_bytes": slot * slots, "staging_slots": slots}
            producer = KVProducer(src, src_caches, "prefill", backend="torch", **staging)
            rigs[mode] = (producer, {})
            for chunk in args.chunks:
                caches = allocate_kv_caches(dst)
                for t in caches:
                    t.zero_()  # the same bytes outside the request on every consumer
                consumer = KVConsumer(
                    dst,
                    caches,
                    "decode",
                    backend="torch",
                    strategy="pack+unpack",
                    chunk_tokens=chunk,
                    timeout_s=600,
                    **staging,
                )
                rigs[mode][1][chunk] = consumer
                consumer.connect([producer.address])
                seconds[mode, chunk], cpu[mode, chunk] = [], []
        runs = 0
        for rep in range(args.repeat + 1):  # the first round warms up
            for mode, (producer, consumers) in rigs.items():
                for chunk, consumer in consumers.items():
                    rid = f"r{runs}"
                    runs += 1
                    began, began_cpu = time.perf_counter(), time.process_time()
                    producer.publish(rid, src_ids, cfg.tokens)
                    result = consumer.fetch(rid, dst_ids, cfg.tokens).wait()
                    wall, used = time.perf_counter() - began, time.process_time() - began_cpu
                    if not result.ok:
                        raise RuntimeError(f"fetch failed: {result.errors}")
                    if not reference:
                        reference = [t.clone() for t in consumer.caches]
                    identical &= all(
                        torch.equal(a.view(torch.int16), b.view(torch.int16))
                        for a, b in zip(reference, consumer.caches, strict=True)
                    )
                    if rep:
                        seconds[mode, chunk].append(wall)
                        cpu[mode, chunk].append(used)
    finally:
        for producer, consumers in rigs.values():
            for consumer in consumers.values():
                consumer.close()
            producer.close()
    nbytes = cfg.tokens * row
    rows = []
    for mode in modes:
        for chunk in args.chunks:
            rows.append(
                {
                    "mode": mode,
                    "slots": modes[mode],
                    "chunk_tokens": chunk,
                    "chunks": -(-cfg.tokens // chunk),
                    "seconds": statistics.median(seconds[mode, chunk]),
                    "cpu_seconds": statistics.median(cpu[mode, chunk]),
                    "gbps": nbytes / statistics.median(seconds[mode, chunk]) / 1e9,
                }
            )
    serial = [r for r in rows if r["mode"] == "serial"]
    n = np.array([r["chunks"] for r in serial], dtype=float)
    fit = {}
    for key in ("seconds", "cpu_seconds"):
        y = np.array([r[key] for r in serial])
        per_chunk, rest = np.polyfit(n, y, 1)
        fit[key] = {"per_chunk": float(per_chunk), "per_gb": float(rest / (nbytes / 1e9))}
    model = CostModel.tcp_loopback()
    from kvxfer.plan import plan_pairs

    (plan,) = plan_pairs([src], [dst], cost_model=model, strategy="pack+unpack", landing=True)
    cap = max_chunk_tokens("pack+unpack", plan.route, src, dst, 8 << 20, 8 << 20, landing=True)
    assert cap is not None
    chosen = choose_chunking("pack+unpack", plan.route, src, dst, model, cap, args.slots)
    return {
        "constants": {**measured, "seconds_per_chunk": fit["seconds"]["per_chunk"]},
        "tokens": cfg.tokens,
        "layers": cfg.layers,
        "kv_heads": cfg.kv_heads,
        "bytes": nbytes,
        "repeat": args.repeat,
        "rows": rows,
        "fit_serial": fit,
        "tcp_loopback_choice": {"tokens": chosen.tokens, "depth": chosen.depth, "slot_mib": 8},
        "identical": identical,
    }


def format_result(r: dict[str, Any]) -> str:
    k = r["constants"]
    lines = [
        f"seconds_per_op {k['seconds_per_op'] * 1e6:.1f} us, link_bytes_per_second "
        f"{k['link_bytes_per_second'] / 1e9:.2f} GB/s, memory_bytes_per_second "
        f"{k['memory_bytes_per_second'] / 1e9:.1f} GB/s (pack {k['pack_payload_gbps']:.2f}, "
        f"unpack {k['unpack_payload_gbps']:.2f} GB/s of payload), seconds_per_chunk "
        f"{k['seconds_per_chunk'] * 1e3:.2f} ms",
        f"{r['tokens']} tokens, {r['bytes'] / 1e6:.1f} MB, pack+unpack, TCP loopback, "
        f"median of {r['repeat']}",
        f"{'mode':>9} {'slots':>5} {'chunk':>6} {'chunks':>6} {'ms':>8} {'cpu ms':>8} {'GB/s':>6}",
    ]
    for row in r["rows"]:
        lines.append(
            f"{row['mode']:>9} {row['slots']:>5} {row['chunk_tokens']:>6} {row['chunks']:>6} "
            f"{row['seconds'] * 1e3:8.1f} {row['cpu_seconds'] * 1e3:8.1f} {row['gbps']:6.2f}"
        )
    f = r["fit_serial"]
    lines.append(
        f"one chunk at a time: {f['seconds']['per_chunk'] * 1e6:.0f} us wall and "
        f"{f['cpu_seconds']['per_chunk'] * 1e6:.0f} us CPU per chunk, "
        f"{f['seconds']['per_gb']:.3f} s and {f['cpu_seconds']['per_gb']:.3f} CPU s per GB"
    )
    c = r["tcp_loopback_choice"]
    lines.append(
        f"CostModel.tcp_loopback() chooses {c['tokens']} tokens, {c['depth']} in flight "
        f"(8 MiB slots); caches {'identical' if r['identical'] else 'DIFFER'}"
    )
    return "\n".join(lines)


def figure(r: dict[str, Any]) -> tuple[str, str]:
    """The page's figure: the constants `CostModel.tcp_loopback()` is set from (no target)."""
    k, c = r["constants"], r["tcp_loopback_choice"]
    text = (
        f"{k['seconds_per_op'] * 1e6:.0f} µs per descriptor with many in flight, one stream "
        f"{k['link_bytes_per_second'] / 1e9:.2f} GB/s, {k['seconds_per_chunk'] * 1e3:.2f} ms "
        f"per chunk; `CostModel.tcp_loopback()` then chooses chunks of {c['tokens']} tokens, "
        f"{c['depth']} in flight"
    )
    return text, "none"


def main(argv: list[str] | None = None) -> int:
    """Measure; print a table or one JSON object; 1 if the caches differ."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument(
        "--chunks",
        type=lambda text: [int(x) for x in text.split(",")],
        default=[128, 256, 512, 1024, 2048, 4096],
        help="chunk sizes in tokens, comma-separated",
    )
    parser.add_argument("--slots", type=int, default=4, help="chunks in flight when pipelined")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    BENCHMARK.add_record_flag(parser)
    args = parser.parse_args(argv)

    from kvxfer.cli.native_logs import filtered_stderr, set_mooncake_log_level

    set_mooncake_log_level(False)
    with filtered_stderr():
        result = measure(args)
    print(json.dumps(result, indent=2) if args.json else format_result(result))
    if not result["identical"]:
        return 1
    BENCHMARK.record(args.record, argv, result, figure)
    return 0


if __name__ == "__main__":
    sys.exit(main())
