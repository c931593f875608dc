"""In-process reshard of one request between two shardings, checked bit for bit.

Run with `python -m kvxfer.examples.reshard_demo` (what `make demo` runs until the networked
demo lands). Prefill: TP 3, blocks of 16, NHD, kv_first. Decode: TP 4, blocks of 48, HND,
blocks_first. 24 KV heads, so neither TP size divides the other.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import numpy as np
import torch

from kvxfer import KVCacheSpec, allocate_kv_caches, reshard
from kvxfer.reference import random_global_kv, write_rank_cells


def _side(
    tp: int, block_size: int, layout: str, placement: str, num_blocks: int
) -> list[KVCacheSpec]:
    return KVCacheSpec(
        num_layers=4,
        num_kv_heads=24,
        head_dim=64,
        dtype="bfloat16",
        tp_size=tp,
        tp_rank=0,
        block_size=block_size,
        num_blocks=num_blocks,
        layout=layout,  # type: ignore[arg-type]
        kv_placement=placement,  # type: ignore[arg-type]
    ).engine_ranks()


def main(argv: Sequence[str] | None = None) -> int:
    """Reshard a random request, verify every destination rank, print a summary."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--start-token", type=int, default=0)
    parser.add_argument("--strategy", default=None)
    args = parser.parse_args(argv)

    rng = np.random.default_rng(0)
    src_specs = _side(3, 16, "NHD", "kv_first", num_blocks=64)
    dst_specs = _side(4, 48, "HND", "blocks_first", num_blocks=32)
    kv = random_global_kv(src_specs[0], args.tokens, seed=1)

    src = []
    for spec in src_specs:
        caches = allocate_kv_caches(spec)
        for t in caches:
            t.copy_(torch.randn(t.shape))  # noise outside the request's cells
        ids = rng.permutation(spec.num_blocks)[: -(-args.tokens // spec.block_size)]
        write_rank_cells(spec, caches, ids, kv, 0, args.tokens)
        src.append((spec, caches, ids))
    dst = []
    for spec in dst_specs:
        caches = allocate_kv_caches(spec)
        for t in caches:
            t.view(torch.uint8).fill_(0xA5)  # poison: an unwritten cell shows
        ids = rng.permutation(spec.num_blocks)[: -(-args.tokens // spec.block_size)]
        dst.append((spec, caches, ids))
    expected = [[t.clone() for t in caches] for _, caches, _ in dst]
    for (spec, _, ids), exp in zip(dst, expected, strict=True):
        write_rank_cells(spec, exp, ids, kv, args.start_token, args.tokens)

    began = time.perf_counter()
    result = reshard(src, dst, args.tokens, args.start_token, strategy=args.strategy)
    seconds = time.perf_counter() - began

    print("prefill TP 3, bs 16, NHD/kv_first  ->  decode TP 4, bs 48, HND/blocks_first")
    print(f"{args.tokens} tokens from token {args.start_token}, 4 layers, 24 KV heads, bf16")
    for p in result.pairs:
        print(
            f"  {p.src_rank} -> {p.dst_rank}  heads [{p.heads.start},{p.heads.stop})  "
            f"{p.strategy:<12} {p.num_segments:>5} segments  {p.nbytes:>9,} bytes"
        )
    match = all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        for (_, caches, _), exp in zip(dst, expected, strict=True)
        for a, b in zip(caches, exp, strict=True)
    )
    print(
        f"moved {result.nbytes:,} bytes in {result.num_segments} segments, "
        f"{seconds * 1e3:.1f} ms ({result.backend} backend)"
    )
    print("MATCH" if match else "MISMATCH")
    return 0 if match else 1


if __name__ == "__main__":
    sys.exit(main())
