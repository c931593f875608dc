"""`kvxfer bench`: hetero-TP transfer throughput through Mooncake, against two baselines measured
in the same run through the same engines:

- contiguous: each rank pair's bytes as one contiguous write (the transport's best case);
- naive: one descriptor per (token, layer, K/V), as a per-token-slice path sends them.

All ranks live in this process, each with its own Mooncake engine, talking over TCP loopback
(or RDMA with `--protocol rdma`); ranks of a side transfer concurrently, as in serving.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch
from tqdm import tqdm

from kvxfer.connector import KVConsumer, KVProducer
from kvxfer.plan import DEFAULT_STAGING_SLOTS, CostModel, Segments, route_heads
from kvxfer.spec import KVCacheSpec, allocate_kv_caches
from kvxfer.transport import Peer


@dataclass(frozen=True)
class BenchConfig:
    """One row of the benchmark."""

    src_tp: int
    dst_tp: int
    kv_heads: int = 8
    layers: int = 8
    tokens: int = 2048
    head_dim: int = 128
    block_size: int = 16
    dst_block_size: int = 32
    protocol: str = "tcp"
    staging_bytes: int = 64 << 20
    staging_slots: int = DEFAULT_STAGING_SLOTS
    strategy: str | None = None
    repeat: int = 3
    decode_dtype: str = "bfloat16"  # the prefill's is bfloat16; another one converts

    @property
    def pair(self) -> str:
        """The row's name."""
        return f"{self.src_tp}->{self.dst_tp}"


def _side(cfg: BenchConfig, tp: int, block_size: int, dtype: str = "bfloat16") -> list[KVCacheSpec]:
    blocks = 2 * -(-cfg.tokens // block_size)
    return KVCacheSpec(
        num_layers=cfg.layers,
        num_kv_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        dtype=dtype,  # type: ignore[arg-type]
        tp_size=tp,
        tp_rank=0,
        block_size=block_size,
        num_blocks=blocks,
        layout="NHD",
    ).engine_ranks()


def _table(spec: KVCacheSpec, tokens: int, seed: int) -> np.ndarray:
    needed = -(-tokens // spec.block_size)
    return np.random.default_rng(seed).permutation(spec.num_blocks)[:needed].astype(np.int64)


Progress = Callable[[str, int], None]
"""`progress(now, steps)`: `steps` more steps of the row are done, and `now` is running."""


def _no_progress(now: str, steps: int) -> None:
    pass


def _median_seconds(
    run: Callable[[], None], repeat: int, progress: Progress = _no_progress, what: str = ""
) -> tuple[float, float]:
    """Median wall seconds and median CPU seconds of `repeat` runs. CPU time is the whole
    process's, every thread (both sides and their Mooncake engines live here): what the run
    costs the machine, not only how long it takes."""
    times, cpu = [], []
    progress(what, 0)
    for _ in range(repeat):
        began, began_cpu = time.perf_counter(), time.process_time()
        run()
        times.append(time.perf_counter() - began)
        cpu.append(time.process_time() - began_cpu)
        progress(what, 1)
    return statistics.median(times), statistics.median(cpu)


def bench_row(cfg: BenchConfig, progress: Progress | None = None) -> dict[str, Any]:
    """Measure kvxfer, contiguous and naive writes for one configuration.

    `progress(now, steps)` follows the row's `row_steps(cfg)` steps: set-up, warm-up, every
    timed kvxfer run, every timed contiguous write, the naive write (then "closing").
    """
    progress = progress or _no_progress
    progress("set-up", 0)
    src_specs = _side(cfg, cfg.src_tp, cfg.block_size)
    dst_specs = _side(cfg, cfg.dst_tp, cfg.dst_block_size, cfg.decode_dtype)
    src_caches = [allocate_kv_caches(s) for s in src_specs]
    for caches in src_caches:
        for t in caches:
            t.view(torch.int16).random_()
    dst_caches = [allocate_kv_caches(s) for s in dst_specs]
    src_ids = [_table(s, cfg.tokens, 1 + s.tp_rank) for s in src_specs]
    dst_ids = [_table(s, cfg.tokens, 100 + s.tp_rank) for s in dst_specs]
    staging_bytes, slots = cfg.staging_bytes, cfg.staging_slots
    producers = [
        KVProducer(
            s, c, "prefill", protocol=cfg.protocol, staging_bytes=staging_bytes, staging_slots=slots
        )
        for s, c in zip(src_specs, src_caches, strict=True)
    ]
    model = CostModel() if cfg.protocol == "rdma" else CostModel.tcp_loopback()
    consumers = [
        KVConsumer(
            s,
            c,
            "decode",
            protocol=cfg.protocol,
            cost_model=model,
            strategy=cfg.strategy,
            staging_bytes=staging_bytes,
            staging_slots=slots,
        )
        for s, c in zip(dst_specs, dst_caches, strict=True)
    ]
    try:
        plans = [c.connect([p.address for p in producers]) for c in consumers]
        progress("warm-up", 1)
        counter = iter(range(1 << 30))
        nbytes = 0

        def kvxfer_once() -> None:
            nonlocal nbytes
            rid = f"bench-{next(counter)}"
            for p, ids in zip(producers, src_ids, strict=True):
                p.publish(rid, ids, cfg.tokens)
            handles = [
                c.fetch(rid, ids, cfg.tokens, timeout=600)
                for c, ids in zip(consumers, dst_ids, strict=True)
            ]
            results = [h.wait() for h in handles]
            failed = [r.errors for r in results if not r.ok]
            if failed:
                raise RuntimeError(f"benchmark transfer failed: {failed}")
            nbytes = sum(r.bytes for r in results)

        kvxfer_once()  # warm-up: connections, staging pools, page faults
        progress("kvxfer", 1)
        kvxfer_s, kvxfer_cpu_s = _median_seconds(kvxfer_once, cfg.repeat, progress, "kvxfer")
        strategies = sorted({p.strategy for ps in plans for p in ps})
        chunking = [c for consumer in consumers for c in consumer.chunking().values()]
        (contiguous_s, contiguous_cpu_s), naive_s, naive_ops, source_bytes = _baselines(
            cfg, producers, consumers, src_specs, dst_specs, progress
        )
    finally:
        progress("closing", 0)  # about a second per engine
        for c in consumers:
            c.close()
        for p in producers:
            p.close()
    # `source_bytes`: what every pair moves in the prefill's dtype (what the baselines write);
    # between two dtypes the wire carries another amount (`bytes`).
    return {
        "pair": cfg.pair,
        "bytes": nbytes,
        "decode_dtype": cfg.decode_dtype,
        "source_bytes": source_bytes,
        "kvxfer_source_gbps": source_bytes / kvxfer_s / 1e9,
        "tokens": cfg.tokens,
        "layers": cfg.layers,
        "kv_heads": cfg.kv_heads,
        "strategies": strategies,
        "chunk_tokens": sorted({min(c.tokens, cfg.tokens) for c in chunking}),
        "chunks_in_flight": sorted({c.depth for c in chunking}),
        "protocol": cfg.protocol,
        "kvxfer_gbps": nbytes / kvxfer_s / 1e9,
        "contiguous_gbps": source_bytes / contiguous_s / 1e9,
        "naive_gbps": source_bytes / naive_s / 1e9,
        "naive_ops": naive_ops,
        "kvxfer_cpu_s_per_gb": kvxfer_cpu_s / (nbytes / 1e9),
        "contiguous_cpu_s_per_gb": contiguous_cpu_s / (source_bytes / 1e9),
        "ratio_to_contiguous": contiguous_s / kvxfer_s,
        "speedup_over_naive": naive_s / kvxfer_s,
    }


def _baselines(
    cfg: BenchConfig,
    producers: Sequence[KVProducer],
    consumers: Sequence[KVConsumer],
    src_specs: Sequence[KVCacheSpec],
    dst_specs: Sequence[KVCacheSpec],
    progress: Progress = _no_progress,
) -> tuple[tuple[float, float], float, int, int]:
    """((contiguous seconds, its CPU seconds), naive seconds, naive ops, bytes), through the
    connectors' own engines, writing every pair's bytes in the prefill's dtype. The contiguous
    writes of every pair are in flight at once and complete by polling, as kvxfer's transfers
    do (a fair baseline)."""
    routes = route_heads(cfg.kv_heads, cfg.src_tp, cfg.dst_tp)
    row = lambda spec, n: spec.head_dim * spec.itemsize * n  # noqa: E731 (bytes of n heads)
    pair_bytes = [cfg.layers * 2 * cfg.tokens * row(src_specs[0], r.num_heads) for r in routes]
    # One registered buffer per source rank and per destination rank, as large as the pairs.
    src_buf = {
        p.spec.tp_rank: torch.empty(
            max(b for r, b in zip(routes, pair_bytes, strict=True) if r.src_rank == p.spec.tp_rank),
            dtype=torch.uint8,
        ).fill_(7)
        for p in producers
        if any(r.src_rank == p.spec.tp_rank for r in routes)
    }
    dst_buf = {
        c.spec.tp_rank: torch.empty(
            sum(b for r, b in zip(routes, pair_bytes, strict=True) if r.dst_rank == c.spec.tp_rank),
            dtype=torch.uint8,
        )
        for c in consumers
    }
    src_reg = {r: producers[r].transport.register(t) for r, t in src_buf.items()}
    dst_reg = {r: consumers[r].transport.register(t) for r, t in dst_buf.items()}
    peers = {r: Peer(consumers[r].transport.endpoint, {0: reg}) for r, reg in dst_reg.items()}
    contiguous, naive = [], []
    dst_used: dict[int, int] = {}
    for route, nbytes in zip(routes, pair_bytes, strict=True):
        s, d = route.src_rank, route.dst_rank
        base = dst_used.get(d, 0)
        dst_used[d] = base + nbytes
        one = np.asarray([nbytes], dtype=np.int64)
        contiguous.append(
            (
                s,
                d,
                Segments(
                    np.zeros(1, np.int64) + src_reg[s].region_id,
                    np.zeros(1, np.int64),
                    np.zeros(1, np.int64),
                    np.asarray([base], np.int64),
                    one,
                ),
            )
        )
        piece = row(src_specs[0], route.num_heads)  # one token's heads of one layer and plane
        count = nbytes // piece
        offsets = np.arange(count, dtype=np.int64) * piece
        naive.append(
            (
                s,
                d,
                Segments(
                    np.full(count, src_reg[s].region_id),
                    offsets,
                    np.zeros(count, np.int64),
                    base + offsets,
                    np.full(count, piece, np.int64),
                ),
            )
        )

    def run(plan: list[tuple[int, int, Segments]]) -> Callable[[], None]:
        def go() -> None:
            futures: list[Future[None]] = [
                producers[s].transport.submit(segs, peers[d]) for s, d, segs in plan
            ]
            for future in futures:
                future.result()

        return go

    try:
        contiguous_timing = _median_seconds(run(contiguous), cfg.repeat, progress, "contiguous")
        naive_s, _ = _median_seconds(run(naive), 1, progress, "naive")  # slow: once is enough
    finally:
        for r, reg in src_reg.items():
            producers[r].transport.unregister(reg)
        for r, reg in dst_reg.items():
            consumers[r].transport.unregister(reg)
    return contiguous_timing, naive_s, sum(len(segs) for _, _, segs in naive), sum(pair_bytes)


def row_steps(cfg: BenchConfig) -> int:
    """Progress steps of one row (see `bench_row`'s `progress`)."""
    return 2 * cfg.repeat + 3


def run(args: argparse.Namespace) -> int:
    """Run the benchmark rows (`kvxfer bench`, parsed by kvxfer.cli) and print them.

    Quiet by default: Mooncake logs errors only and its known-harmless lines are dropped
    (`kvxfer.cli.native_logs`); `--verbose` shows everything it says. On a terminal (stdout and
    stderr both TTYs, no `--json`) a progress bar on stderr follows each row's steps; otherwise
    nothing but the rows is printed.
    """
    from kvxfer.cli.native_logs import filtered_stderr, set_mooncake_log_level

    verbose = bool(getattr(args, "verbose", False))
    set_mooncake_log_level(verbose)  # before the first engine starts
    if verbose:
        return _run(args, sys.stderr)
    with filtered_stderr() as console:
        return _run(args, console)


def _run(args: argparse.Namespace, console: TextIO) -> int:
    """The rows; `console` is the real stderr (the progress bar's stream)."""
    # All ranks share this process; several ops each spawning a full intra-op thread pool
    # oversubscribe the cores (kvxfer 0.33 -> 0.42-0.48 of contiguous on 2 cores with 1).
    torch.set_num_threads(args.torch_threads)
    configs = [
        BenchConfig(
            src_tp,
            dst_tp,
            kv_heads=args.kv_heads,
            layers=args.layers,
            tokens=args.tokens,
            head_dim=args.head_dim,
            protocol=args.protocol,
            staging_bytes=args.staging_bytes,
            staging_slots=args.staging_slots,
            strategy=args.strategy,
            repeat=args.repeat,
            decode_dtype=args.decode_dtype or "bfloat16",
        )
        for src_tp, dst_tp in args.pairs
    ]
    show = not args.json and sys.stdout.isatty() and console.isatty()
    bar = tqdm(
        total=sum(row_steps(cfg) for cfg in configs),
        desc="bench",
        file=console,
        bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} steps "
        "[{elapsed}{postfix}]",
        disable=not show,
        leave=False,
        dynamic_ncols=True,
    )

    def step(now: str, steps: int) -> None:
        bar.set_postfix_str(now, refresh=False)
        bar.update(steps)
        bar.refresh()

    rows = []
    try:
        for cfg in configs:
            bar.set_description(f"bench {cfg.pair}", refresh=False)
            try:
                rows.append(bench_row(cfg, progress=step))
            except ValueError as exc:  # a configuration the connectors refuse
                bar.close()
                print(f"kvxfer bench: error: {' '.join(str(exc).split())}", file=sys.stderr)
                return 2
            if not args.json:
                line = format_row(rows[-1])
                bar.clear()  # the bar is on stderr, the row goes to stdout: same terminal
                print(line, flush=True)
                bar.refresh()
    finally:
        bar.close()
    if args.json:
        print(json.dumps({"rows": rows}, indent=2))
    if getattr(args, "record", None) is not None:
        from kvxfer.testing.results import Benchmark

        Benchmark(
            "bench", BENCH_TITLE, "MC_LOG_LEVEL=ERROR .venv/bin/kvxfer", Path("benchmarks/results")
        ).record(args.record, None, {"rows": rows}, figure)
    return 0


BENCH_TITLE = "`kvxfer bench`: hetero-TP pairs against a contiguous read of the same bytes"
BENCH_TARGET = 0.6  # of the contiguous read, every pair (issue 23)


def figure(report: dict[str, Any]) -> tuple[str, str]:
    """The results page's figure and targets: each pair against the contiguous read."""
    rows = report["rows"]
    text = ", ".join(f"{r['pair']} **{r['ratio_to_contiguous']:.2f}**" for r in rows)
    cpu = sorted(r["kvxfer_cpu_s_per_gb"] for r in rows)
    text += f" of the contiguous read; {cpu[0]:.2f}-{cpu[-1]:.2f} CPU s/GB"
    from kvxfer.testing.results import verdict

    missed = [r["pair"] for r in rows if r["ratio_to_contiguous"] < BENCH_TARGET]
    return text, f"{BENCH_TARGET} of the contiguous read ({verdict(missed)})"


def format_row(r: dict[str, Any]) -> str:
    """One row of `kvxfer bench`, as text."""
    converted = ""
    if r["bytes"] != r["source_bytes"]:
        converted = (
            f"-> {r['decode_dtype']}: {r['source_bytes'] / 1e6:.1f} MB of bf16 as "
            f"{r['kvxfer_source_gbps']:.3f} GB/s  "
        )
    return (
        f"{r['pair']:>6}  {r['bytes'] / 1e6:8.1f} MB  {converted}"
        f"kvxfer {r['kvxfer_gbps']:6.3f} GB/s "
        f"({','.join(r['strategies'])}; chunks of {_listing(r['chunk_tokens'])} tokens, "
        f"{_listing(r['chunks_in_flight'])} in flight)  "
        f"contiguous {r['contiguous_gbps']:6.3f} GB/s  "
        f"naive {r['naive_gbps']:6.3f} GB/s ({r['naive_ops']} ops)  "
        f"x contiguous {r['ratio_to_contiguous']:.2f}  "
        f"x naive {r['speedup_over_naive']:.1f}  "
        f"cpu s/GB {r['kvxfer_cpu_s_per_gb']:.2f} (contiguous {r['contiguous_cpu_s_per_gb']:.2f})"
    )


def _listing(values: list[int]) -> str:
    return "/".join(str(v) for v in values)
