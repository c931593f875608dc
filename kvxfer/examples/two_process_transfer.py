"""One request's KV cache from a prefill process to a decode process, over Mooncake TCP.

Run it with `python -m kvxfer.examples.two_process_transfer`. Two processes on 127.0.0.1:

- prefill: a TP 2 engine (blocks of 16 tokens, NHD). Each rank writes its heads of a random
  request into its paged cache (`kvxfer.reference` stands in for a forward pass), then a
  `KVProducer` per rank publishes the request and serves it;
- decode: a TP 4 engine (blocks of 32 tokens, HND). A `KVConsumer` per rank connects to every
  prefill rank (the side-channel addresses the prefill process printed), fetches the request
  into its own scattered blocks, and compares every byte of its cache with what
  `kvxfer.reference` says it must hold.

Each engine's ranks share one process here; in a serving engine each rank is its own process,
with the same calls. It prints the plan and the outcome per decode rank; exit code 0 only when
every byte matches and both prefill ranks released the request.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import sys
from contextlib import ExitStack
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import numpy as np
import torch

from kvxfer import KVCacheSpec, KVConsumer, KVProducer, allocate_kv_caches
from kvxfer.cli.native_logs import filtered_stderr, set_mooncake_log_level
from kvxfer.reference import random_global_kv, write_rank_cells

PREFILL = KVCacheSpec(  # rank 0 of the prefill engine; engine_ranks() gives every rank
    num_layers=2,
    num_kv_heads=8,
    head_dim=64,
    dtype="bfloat16",
    tp_size=2,
    tp_rank=0,
    block_size=16,
    num_blocks=64,
    layout="NHD",
)
# Rank 0 of the decode engine: the same model, sharded differently.
DECODE = msgspec.structs.replace(PREFILL, tp_size=4, block_size=32, num_blocks=32, layout="HND")
REQUEST = "req-0"
NUM_TOKENS = 300
SEED = 0  # both processes derive the request's KV from it: decode checks against it


def block_table(spec: KVCacheSpec, salt: int) -> np.ndarray:
    """Scattered block ids for the request on one rank, as a busy allocator hands them out."""
    needed = -(-NUM_TOKENS // spec.block_size)
    rng = np.random.default_rng([SEED, salt, spec.tp_rank])
    return rng.permutation(spec.num_blocks)[:needed]


def prefill_process(conn: Connection) -> None:
    """Every prefill rank: write the request's KV, publish it, serve until it is released."""
    kv = random_global_kv(PREFILL, NUM_TOKENS, seed=SEED)  # [layers, 2, tokens, heads, dim]
    released: queue.SimpleQueue[str] = queue.SimpleQueue()
    with ExitStack() as stack:
        producers = []
        for spec in PREFILL.engine_ranks():
            caches = allocate_kv_caches(spec)
            block_ids = block_table(spec, salt=1)
            write_rank_cells(spec, caches, block_ids, kv, 0, NUM_TOKENS)  # "prefill"
            # `release` runs once every decode rank is done with the request: free its blocks.
            producer = KVProducer(
                spec, caches, engine_id="prefill", release=lambda rid, _why: released.put(rid)
            )
            stack.enter_context(producer)
            producer.publish(REQUEST, block_ids, NUM_TOKENS)
            producers.append(producer)
        conn.send([p.address for p in producers])  # tcp://127.0.0.1:PORT, one per rank
        conn.send([released.get(timeout=120) for _ in producers])


def decode_process(addresses: list[str], conn: Connection) -> None:
    """Every decode rank: connect to the prefill ranks, fetch the request, check its bytes."""
    kv = random_global_kv(DECODE, NUM_TOKENS, seed=SEED)  # what the prefill side wrote
    with ExitStack() as stack:
        ranks = []
        for spec in DECODE.engine_ranks():
            caches = allocate_kv_caches(spec)
            for t in caches:
                t.view(torch.uint8).fill_(0xA5)  # poison: a byte that did not arrive shows
            consumer = stack.enter_context(KVConsumer(spec, caches, engine_id="decode"))
            plans = consumer.connect(addresses)  # handshake with every prefill rank, plan
            ranks.append((spec, caches, block_table(spec, salt=2), consumer, plans))
        # Start every rank's fetch, then wait for them: the ranks move their heads in parallel.
        handles = [c.fetch(REQUEST, ids, NUM_TOKENS, timeout=60) for _, _, ids, c, _ in ranks]
        report = []
        for (spec, caches, ids, _, plans), handle in zip(ranks, handles, strict=True):
            result = handle.wait()
            expected = allocate_kv_caches(spec)
            for t in expected:
                t.view(torch.uint8).fill_(0xA5)
            write_rank_cells(spec, expected, ids, kv, 0, NUM_TOKENS)
            exact = all(
                torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                for a, b in zip(caches, expected, strict=True)
            )
            report.append(
                {
                    "rank": spec.tp_rank,
                    "ok": result.ok,
                    "exact": exact,
                    "bytes": result.bytes,
                    "num_ops": result.num_ops,
                    "seconds": result.seconds,
                    "failed_block_ids": result.failed_block_ids,
                    "errors": result.errors,
                    "pairs": [
                        (p.src_rank, p.route.head_start, p.route.num_heads, p.strategy)
                        for p in plans
                    ],
                }
            )
    conn.send(report)


def _receive(conn: Connection, who: str, timeout: float = 180.0) -> Any:
    if not conn.poll(timeout):
        raise TimeoutError(f"the {who} process did not answer within {timeout:.0f} s")
    try:
        return conn.recv()
    except EOFError:
        raise RuntimeError(f"the {who} process failed (its traceback is above)") from None


def _side(spec: KVCacheSpec) -> str:
    return f"TP {spec.tp_size}, blocks of {spec.block_size}, {spec.layout}"


def format_report(report: list[dict[str, Any]], released: list[str]) -> tuple[str, bool]:
    """The summary to print, and whether everything matched."""
    lines = [
        f"prefill process ({_side(PREFILL)})  ->  decode process ({_side(DECODE)})",
        f"request {REQUEST!r}: {NUM_TOKENS} tokens, {PREFILL.num_layers} layers, "
        f"{PREFILL.num_kv_heads} KV heads of {PREFILL.head_dim}, {PREFILL.dtype}",
    ]
    for r in report:
        sources = ", ".join(
            f"prefill {src} heads [{start},{start + n}) {strategy}"
            for src, start, n, strategy in r["pairs"]
        )
        outcome = "bytes exact" if r["ok"] and r["exact"] else f"FAILED {r['errors']}"
        lines.append(
            f"  decode {r['rank']} <- {sources}: {r['bytes']:,} bytes, {r['num_ops']} ops, "
            f"{r['seconds'] * 1e3:.1f} ms, {outcome}"
        )
    lines.append(f"released on the prefill side: {released}")
    match = all(r["ok"] and r["exact"] for r in report) and released == [REQUEST] * len(
        PREFILL.engine_ranks()
    )
    lines.append("MATCH" if match else "MISMATCH")
    return "\n".join(lines), match


def main() -> int:
    """Start both processes, print what the decode side got."""
    set_mooncake_log_level()  # errors only, unless MC_LOG_LEVEL says otherwise
    ctx = mp.get_context("spawn")
    procs: list[Any] = []
    with filtered_stderr():  # drops Mooncake's known-harmless lines, in both processes
        try:
            prefill_end, child = ctx.Pipe()
            procs.append(ctx.Process(target=prefill_process, args=(child,), name="prefill"))
            procs[-1].start()
            child.close()
            addresses = _receive(prefill_end, "prefill")

            decode_end, child = ctx.Pipe()
            procs.append(ctx.Process(target=decode_process, args=(addresses, child), name="decode"))
            procs[-1].start()
            child.close()
            report = _receive(decode_end, "decode")
            released = _receive(prefill_end, "prefill")
        finally:
            for proc in procs:
                proc.join(30)
                if proc.is_alive():
                    proc.kill()
    text, match = format_report(report, released)
    print(text)
    return 0 if match else 1


if __name__ == "__main__":
    sys.exit(main())
