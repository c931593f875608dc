"""Host work per chunk of a fetch, against the request's length: planned from the chunk's own
blocks (what the connectors do) and from the whole block table (what they did before).

    .venv/bin/python benchmarks/chunk_planning.py            # a table
    .venv/bin/python benchmarks/chunk_planning.py --json     # one JSON object

One pair of `kvxfer bench`'s 2->4 row (12 KV heads of 128 bf16, 8 layers, blocks of 16 -> 32,
scattered tables), a 512-token chunk at token 1,024 of requests of 2k, 32k and 128k tokens.
Per chunk, median of `--repeat` after a warm-up:

- consumer: check the producer's block ids and build the landing program
  (before: `check_block_ids` over the whole table, decoded from a list, and `build_program`;
  now: `chunk_source_blocks` over the chunk's ids when the chunk is read from the producer's
  cache, and `chunk_program`);
- producer: the pack and the `ChunkReady` message, encoded and decoded
  (before: `pack_copy` and the whole table's ids; now: `chunk_pack_copy` and the chunk's ids,
  none when it packs).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np
from scenarios import median_seconds

from kvxfer.cli.bench import BenchConfig, _side, _table
from kvxfer.connector.messages import ChunkReady, decode, encode
from kvxfer.plan import plan_pairs
from kvxfer.plan.program import (
    build_program,
    chunk_block_count,
    chunk_blocks,
    chunk_pack_copy,
    chunk_program,
    pack_copy,
)
from kvxfer.plan.reads import chunk_source_blocks
from kvxfer.validation import check_block_ids


def _ready(ids: list[int]) -> None:
    message = ChunkReady(request_id="r", chunk_id=1, generation=1, src_block_ids=ids, staging=None)
    decode(encode(message))


def _row(tokens: int, strategy: str, repeat: int) -> dict[str, Any]:
    lo, hi = 1024, 1536
    cfg = BenchConfig(2, 4, kv_heads=12, tokens=tokens)
    srcs, dsts = _side(cfg, 2, 16), _side(cfg, 4, 32)
    plan = plan_pairs(srcs, dsts, strategy=strategy, landing=True)[0]
    s, d, route = srcs[plan.src_rank], dsts[plan.dst_rank], plan.route
    src_ids, dst_ids = _table(s, tokens, 1), _table(d, tokens, 2)
    src_chunk = chunk_blocks(src_ids, s.block_size, lo, hi)
    dst_chunk = chunk_blocks(dst_ids, d.block_size, lo, hi)
    packs = strategy != "direct"
    whole_list, chunk_list = src_ids.tolist(), src_chunk.tolist()
    kind = plan.strategy

    def consumer_before() -> None:
        ids = check_block_ids(s, whole_list, tokens, "the producer's blocks")
        build_program(route, kind, s, d, ids, dst_ids, lo, hi, landing=True)

    def consumer_now() -> None:
        if packs:
            ids = np.zeros(chunk_block_count(s.block_size, lo, hi), np.int64)
        else:
            ids = chunk_source_blocks(s, chunk_list, lo, hi)
        chunk_program(route, kind, s, d, ids, dst_chunk, lo, hi, landing=True)

    def producer_before() -> None:
        pack_copy(kind, route, s, d, src_ids, lo, hi)
        _ready(src_ids.tolist())

    def producer_now() -> None:
        blocks = chunk_blocks(src_ids, s.block_size, lo, hi)
        copy = chunk_pack_copy(kind, route, s, d, blocks, lo, hi)
        _ready([] if copy is not None else blocks.tolist())

    return {
        "tokens": tokens,
        "strategy": strategy,
        "consumer_before_us": median_seconds(consumer_before, repeat) * 1e6,
        "consumer_now_us": median_seconds(consumer_now, repeat) * 1e6,
        "producer_before_us": median_seconds(producer_before, repeat) * 1e6,
        "producer_now_us": median_seconds(producer_now, repeat) * 1e6,
    }


def measure(repeat: int) -> list[dict[str, Any]]:
    return [
        _row(tokens, strategy, repeat)
        for tokens in (2048, 32768, 131072)
        for strategy in ("pack+unpack", "direct")
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=101)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    rows = measure(args.repeat)
    if args.json:
        print(json.dumps({"rows": rows}, indent=2))
        return 0
    print(f"{'tokens':>7} {'strategy':<12} {'consumer before':>16} {'now':>6}", end=" ")
    print(f"{'producer before':>16} {'now':>6}")
    for r in rows:
        print(
            f"{r['tokens']:>7} {r['strategy']:<12} {r['consumer_before_us']:>13.0f} us "
            f"{r['consumer_now_us']:>3.0f} us {r['producer_before_us']:>13.0f} us "
            f"{r['producer_now_us']:>3.0f} us"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
