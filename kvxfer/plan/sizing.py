"""Chunk sizing: how many tokens a chunk's staging holds on each side, and where chunks end.

A chunk lands in a staging slot on each side that stages (`TRAITS`: a mirror of one side's
blocks, or the wire buffer), so its size is bounded by each slot and, for a mirror, is a whole
number of that side's blocks: chunks end at multiples of that size (`chunk_bounds`), so an
aligned chunk touches no more blocks than it has tokens' worth. Used by the cost model's
estimates (`cost.py`) and by the fitting of a pair to its slots (`fitting.py`), which both
import it.
"""

from __future__ import annotations

from math import lcm

from kvxfer.plan.heads import HeadRoute
from kvxfer.plan.program import TRAITS, Buffer, Strategy, landed_in, staged_block_size
from kvxfer.spec import KVCacheSpec


def max_chunk_tokens(
    strategy: Strategy,
    route: HeadRoute,
    src_spec: KVCacheSpec,
    dst_spec: KVCacheSpec,
    src_slot_bytes: int,
    dst_slot_bytes: int,
    landing: bool = False,
) -> int | None:
    """The most tokens one chunk may carry so that its staging fits each side's slot; None
    when the strategy uses no staging (never with `landing`).

    Chunks must end at multiples of the returned size (`chunk_bounds`): a mirror of blocks of
    `bs` tokens holds whole blocks, so the size is a multiple of `bs`. A wire buffer needs one
    row per token.
    """
    planes = 1 if src_spec.mla else 2
    layers, _, _ = route.layer_span(src_spec, dst_spec)
    itemsize = max(src_spec.itemsize, dst_spec.itemsize)  # staging of either dtype fits
    row = layers * planes * route.num_heads * src_spec.head_dim * itemsize
    limits = [
        _whole_blocks(slot // row, staged_block_size(buffer, src_spec, dst_spec))
        for slot, buffer in _staged(strategy, src_slot_bytes, dst_slot_bytes, landing)
    ]
    return min(limits) if limits else None


def chunk_alignment(
    strategy: Strategy, src_spec: KVCacheSpec, dst_spec: KVCacheSpec, landing: bool = False
) -> int:
    """The multiple of tokens a chunk size must be for `strategy`'s staging to hold whole
    blocks (see `max_chunk_tokens`, whose sizes are such multiples): the destination's block
    size for a (landing) mirror of its blocks, the source's for unpack, 1 for the wire buffer."""
    sizes = [
        staged_block_size(buffer, src_spec, dst_spec)
        for _, buffer in _staged(strategy, 0, 0, landing)
    ]
    return lcm(*sizes) if sizes else 1


def preferred_chunk_unit(
    strategy: Strategy, src_spec: KVCacheSpec, dst_spec: KVCacheSpec, max_tokens: int
) -> int:
    """The step of chunk sizes worth trying: a whole number of blocks on both sides when a
    chunk of that many tokens fits (then no block is shared by two chunks, so a failed chunk
    lists no neighbour's blocks), else the alignment the strategy needs."""
    both = lcm(src_spec.block_size, dst_spec.block_size)
    if both <= max_tokens:
        return both
    return chunk_alignment(strategy, src_spec, dst_spec, landing=True)


def chunk_bounds(start: int, end: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """Cut tokens `[start, end)` into chunks that end at multiples of `chunk_tokens` (the first
    may be shorter), as `max_chunk_tokens` requires."""
    bounds, lo = [], start
    while lo < end:
        hi = min(end, (lo // chunk_tokens + 1) * chunk_tokens)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def _staged(
    strategy: Strategy, src_slot_bytes: int, dst_slot_bytes: int, landing: bool
) -> list[tuple[int, Buffer]]:
    """(slot bytes, buffer) of each side that stages a chunk under `strategy`."""
    send_from, lands_in = TRAITS[strategy].send_from, landed_in(strategy, landing)
    staged: list[tuple[int, Buffer]] = [(src_slot_bytes, send_from)] if send_from != "cache" else []
    if lands_in != "cache":
        staged.append((dst_slot_bytes, lands_in))
    return staged


def _whole_blocks(rows: int, block_size: int) -> int:
    return rows // block_size * block_size
