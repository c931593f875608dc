"""Geometries shared by the benchmarks."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from kvxfer import KVCacheSpec, allocate_kv_caches
from kvxfer.plan import build_program
from kvxfer.plan.program import PairChunk
from kvxfer.plan.sizing import chunk_bounds, max_chunk_tokens
from kvxfer.reference import random_global_kv, write_rank_cells
from kvxfer.testing.geometry import Geometry


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
    geometry = Geometry(
        tp=tp, heads=heads, block_size=block_size, layout=layout, layers=num_layers,
        head_dim=head_dim,
    )  # fmt: skip
    return replace(geometry, num_blocks=2 * geometry.blocks_for(num_tokens)).specs()


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


def plan_request(src, dst, pairs, num_tokens, src_ids, dst_ids, landing=False):
    """Every pair's transfer program for tokens `[0, num_tokens)`."""
    return [
        build_program(
            p.route,
            p.strategy,
            src[p.src_rank],
            dst[p.dst_rank],
            src_ids[p.src_rank],
            dst_ids[p.dst_rank],
            0,
            num_tokens,
            landing=landing,
        )
        for p in pairs
    ]


def connector_request(src, dst, pairs, num_tokens, src_ids, dst_ids):
    """The planning of one request sent in one chunk, as the connectors plan it: the producer's
    pack and the consumer's landing program, for every pair."""
    return connector_chunks(src, dst, pairs, num_tokens, src_ids, dst_ids, None)


def connector_chunks(src, dst, pairs, num_tokens, src_ids, dst_ids, slot_bytes):
    """The planning of one request cut into the chunks that fit `slot_bytes` on both sides
    (None: one chunk), as the connectors plan it: each chunk from its own blocks
    (`PairChunk`), the producer's pack and the consumer's landing program."""
    programs = []
    for p in pairs:
        s, d = src[p.src_rank], dst[p.dst_rank]
        chunk_tokens = num_tokens
        if slot_bytes is not None:
            fits = max_chunk_tokens(p.strategy, p.route, s, d, slot_bytes, slot_bytes, True)
            chunk_tokens = fits or num_tokens
        for lo, hi in chunk_bounds(0, num_tokens, chunk_tokens):
            chunk = PairChunk(p.route, p.strategy, s, d, lo, hi, landing=True)
            src_blocks = chunk.source_blocks(src_ids[p.src_rank])
            chunk.pack(src_blocks)
            programs.append(
                chunk.program(src_blocks, chunk.destination_blocks(dst_ids[p.dst_rank]))
            )
    return programs
