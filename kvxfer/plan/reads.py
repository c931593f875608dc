"""Read programs: what a consumer reads for one chunk, from the chunk's own blocks alone.

A producer answers a consumer's ask for a chunk with where to read it: its staging slot, for
the strategies that pack (the chunk was packed there), or else the ids of its cache blocks that
hold the chunk's tokens. The consumer checks that answer against the chunk (O(the chunk), never
O(the request): a 128k-token request's chunks cost what a short one's do) and builds the
chunk's landing program: the segments it reads into its own staging slot and the copy that
unpacks the slot into its cache (`PairChunk.program`). Pure numpy: the connector maps the program's
region keys onto registered memory.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

from kvxfer.plan.heads import HeadRoute
from kvxfer.plan.program import (
    TRAITS,
    PairChunk,
    Strategy,
    TransferProgram,
    chunk_block_count,
)
from kvxfer.spec import KVCacheSpec


def reads_from_staging(strategy: Strategy) -> bool:
    """Whether a chunk of `strategy` is read from the producer's staging slot (it packs),
    rather than from the producer's cache blocks."""
    return TRAITS[strategy].send_from != "cache"


def chunk_source_blocks(
    spec: KVCacheSpec, block_ids: Sequence[int], token_start: int, token_end: int
) -> np.ndarray:
    """A producer's block ids for the tokens of one chunk, checked (O(the chunk)): one per
    block the chunk touches, each inside its cache, none twice.

    Raises:
        ValueError: another count, an id out of range or repeated.
    """
    expected = chunk_block_count(spec.block_size, token_start, token_end)
    if len(block_ids) != expected:
        raise ValueError(
            f"it sent {len(block_ids)} block ids for tokens [{token_start}, {token_end}); "
            f"blocks of {spec.block_size} tokens need {expected}"
        )
    ids = np.asarray(block_ids, dtype=np.int64)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= spec.num_blocks):
        raise ValueError(f"it sent a block id outside its {spec.num_blocks} blocks")
    if np.unique(ids).size != ids.size:
        raise ValueError("it sent a block id twice for one chunk")
    return ids


def chunk_read_program(
    route: HeadRoute,
    strategy: Strategy,
    producer: KVCacheSpec,
    consumer: KVCacheSpec,
    dst_block_ids: np.ndarray,
    token_start: int,
    token_end: int,
    src_block_ids: Sequence[int] | None,
) -> TransferProgram:
    """The landing program of chunk `[token_start, token_end)` of one pair.

    Args:
        route: the heads and layers the chunk moves (the pair's route, or a streamed chunk's
            layers of it: `FittedPair.route_of`).
        strategy: the pair's strategy.
        producer: the producer rank's spec.
        consumer: the consumer rank's spec.
        dst_block_ids: the consumer's whole block table of the request (only the chunk's part
            is used).
        token_start: the chunk's first token.
        token_end: one past its last token.
        src_block_ids: the producer's blocks of the chunk, as it sent them; None when it
            offered its staging slot (the source is then the slot: block ids play no part).

    Returns:
        The program; a staged chunk's shares its segments and pack with every chunk of its
        shape (their arrays are read-only): treat it as read-only.

    Raises:
        ValueError: the producer's answer does not fit the chunk or its strategy.
    """
    staged = reads_from_staging(strategy)
    if staged != (src_block_ids is None):
        where = "its staging" if src_block_ids is None else "its cache"
        raise ValueError(f"it offered {where} for a chunk of strategy {strategy}")
    chunk = PairChunk(route, strategy, producer, consumer, token_start, token_end, landing=True)
    dst_ids = chunk.destination_blocks(dst_block_ids)
    if src_block_ids is None:
        # Staging to staging: the segments do not depend on any block id, only the unpack does
        # (the reads of a 16-token chunk were a quarter of its consumer's host work).
        shared = _staged_program(route, strategy, producer, consumer, token_start, token_end)
        return dataclasses.replace(shared, unpack=chunk.unpack(dst_ids))
    src_ids = chunk_source_blocks(producer, src_block_ids, token_start, token_end)
    return chunk.program(src_ids, dst_ids)


@functools.lru_cache(maxsize=1024)
def _staged_program(
    route: HeadRoute,
    strategy: Strategy,
    producer: KVCacheSpec,
    consumer: KVCacheSpec,
    token_start: int,
    token_end: int,
) -> TransferProgram:
    """The landing program of a staged chunk but for its unpack (made for block 0s), shared by
    every chunk of that shape: its arrays are made read-only."""
    src_ids = np.zeros(chunk_block_count(producer.block_size, token_start, token_end), np.int64)
    dst_ids = np.zeros(chunk_block_count(consumer.block_size, token_start, token_end), np.int64)
    chunk = PairChunk(route, strategy, producer, consumer, token_start, token_end, landing=True)
    program = chunk.program(src_ids, dst_ids)
    arrays = [getattr(program.segments, f.name) for f in dataclasses.fields(program.segments)]
    if program.pack is not None:
        arrays += [program.pack.src.block_ids, program.pack.dst.block_ids, program.pack.scales]
    for array in arrays:
        if isinstance(array, np.ndarray):
            array.flags.writeable = False
    return program


def landing_bytes(program: TransferProgram, num_layers: int) -> int:
    """Bytes of staging a landing program needs (its destination is the staging region alone,
    from offset 0): what its reads write, and what its unpack views, whole layers of its
    wire geometry (a mirror's reads may stop short of its last block), for a cache of
    `num_layers` layers."""
    segments, unpack = program.segments, program.unpack
    written = int((segments.dst_offset + segments.length).max()) if len(segments) else 0
    if unpack is None:
        return written
    viewed = (unpack.num_layers or num_layers) * unpack.src.geometry.layer_bytes
    return max(written, viewed)
