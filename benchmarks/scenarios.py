"""Geometries shared by the benchmarks."""

from __future__ import annotations

import numpy as np
import torch

from kvxfer import KVCacheSpec, allocate_kv_caches
from kvxfer.reference import random_global_kv, write_rank_cells


def specs(
    tp: int,
    *,
    num_tokens: int,
    heads: int = 8,
    block_size: int = 16,
    layout: str = "NHD",
    num_layers: int = 32,
    head_dim: int = 128,
) -> list[KVCacheSpec]:
    """One engine's specs, with twice the blocks a request of `num_tokens` needs."""
    num_blocks = 2 * -(-num_tokens // block_size)
    return KVCacheSpec(
        num_layers=num_layers,
        num_kv_heads=heads,
        head_dim=head_dim,
        dtype="bfloat16",
        tp_size=tp,
        tp_rank=0,
        block_size=block_size,
        num_blocks=num_blocks,
        layout=layout,  # type: ignore[arg-type]
    ).engine_ranks()


def scattered_blocks(spec: KVCacheSpec, num_tokens: int, seed: int) -> np.ndarray:
    """A fragmented block table: a random choice of the rank's blocks."""
    needed = -(-num_tokens // spec.block_size)
    return np.random.default_rng(seed).permutation(spec.num_blocks)[:needed].astype(np.int64)


def filled_side(side: list[KVCacheSpec], num_tokens: int, kv: torch.Tensor | None, seed: int):
    """(spec, caches, block_ids) per rank; caches hold `kv` if given, else a poison pattern."""
    out = []
    for spec in side:
        caches = allocate_kv_caches(spec)
        ids = scattered_blocks(spec, num_tokens, seed + spec.tp_rank)
        if kv is None:
            for t in caches:
                t.view(torch.uint8).fill_(0xA5)
        else:
            write_rank_cells(spec, caches, ids, kv, 0, num_tokens)
        out.append((spec, caches, ids))
    return out


def request_kv(spec: KVCacheSpec, num_tokens: int) -> torch.Tensor:
    """Random KV of a whole request."""
    return random_global_kv(spec, num_tokens, seed=0)
