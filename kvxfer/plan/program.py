"""Transfer programs: the four strategies, as pack ops, byte segments and unpack ops.

Every strategy is "optional local cell copy on the source, byte segments over the wire, optional
local cell copy on the destination"; they differ only in the buffers the segments connect:

| strategy    | source side                  | segments                | destination side         |
|-------------|------------------------------|-------------------------|--------------------------|
| direct      | -                            | cache -> cache          | -                        |
| pack        | gather into a mirror of dst  | mirror -> cache         | -                        |
| unpack      | -                            | cache -> mirror of src  | scatter from the mirror  |
| pack+unpack | gather into the wire layout  | wire -> wire (one run)  | scatter from the wire    |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, cast

import numpy as np

from kvxfer.plan.heads import HeadRoute
from kvxfer.plan.layout import (
    BlockGeometry,
    PagedView,
    cache_view,
    moved_bytes,
    staging_mirror,
    wire_buffer,
)
from kvxfer.plan.segments import (
    LayerTemplate,
    Segments,
    count_segments,
    expand_layers,
    layer_template,
)
from kvxfer.spec import KVCacheSpec

Strategy = Literal["direct", "pack", "unpack", "pack+unpack"]
STRATEGIES: tuple[Strategy, ...] = ("direct", "pack", "unpack", "pack+unpack")


def check_strategy(name: str) -> Strategy:
    """Validate a strategy name."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; use one of {list(STRATEGIES)}")
    return cast(Strategy, name)


@dataclass(frozen=True)
class CellCopy:
    """A local copy of the moved cells between two buffers of one side (a kernel pass)."""

    src: PagedView
    dst: PagedView
    num_heads: int
    token_start: int
    token_end: int

    @property
    def nbytes(self) -> int:
        """Bytes copied per layer."""
        return moved_bytes(self.src.geometry, self.num_heads, self.token_end - self.token_start)


@dataclass(frozen=True)
class ProgramShape:
    """A strategy's buffers for one pair and token range, before segments are listed."""

    strategy: Strategy
    send_from: PagedView
    send_to: PagedView
    pack: CellCopy | None
    unpack: CellCopy | None

    @property
    def src_staging(self) -> BlockGeometry | None:
        """Geometry of the source-side staging buffer, if the strategy needs one."""
        return self.send_from.geometry if self.send_from.region == "staging" else None

    @property
    def dst_staging(self) -> BlockGeometry | None:
        """Geometry of the destination-side staging buffer, if the strategy needs one."""
        return self.send_to.geometry if self.send_to.region == "staging" else None


@dataclass(frozen=True)
class TransferProgram:
    """Everything needed to move one pair's cells for one token range."""

    route: HeadRoute
    strategy: Strategy
    token_start: int
    token_end: int
    num_layers: int
    pack: CellCopy | None
    segments: Segments
    unpack: CellCopy | None
    src_staging: BlockGeometry | None
    dst_staging: BlockGeometry | None

    @property
    def nbytes(self) -> int:
        """Bytes written over the transport."""
        return self.segments.nbytes


def program_shape(
    strategy: Strategy,
    route: HeadRoute,
    src_spec: KVCacheSpec,
    dst_spec: KVCacheSpec,
    src_block_ids: np.ndarray,
    dst_block_ids: np.ndarray,
    token_start: int,
    token_end: int,
) -> ProgramShape:
    """Lay out the buffers of `strategy` for one pair and token range."""
    n = route.num_heads
    src_cache = cache_view(src_spec, src_block_ids, route.src_head_offset)
    dst_cache = cache_view(dst_spec, dst_block_ids, route.dst_head_offset)
    pack = unpack = None
    send_from, send_to = src_cache, dst_cache
    if strategy == "pack":
        send_from = staging_mirror(dst_cache.geometry, n, token_start, token_end)
        pack = CellCopy(src_cache, send_from, n, token_start, token_end)
    elif strategy == "unpack":
        send_to = staging_mirror(src_cache.geometry, n, token_start, token_end)
        unpack = CellCopy(send_to, dst_cache, n, token_start, token_end)
    elif strategy == "pack+unpack":
        send_from = wire_buffer(src_cache.geometry, n, token_start, token_end)
        send_to = wire_buffer(src_cache.geometry, n, token_start, token_end)
        pack = CellCopy(src_cache, send_from, n, token_start, token_end)
        unpack = CellCopy(send_to, dst_cache, n, token_start, token_end)
    return ProgramShape(strategy, send_from, send_to, pack, unpack)


def shape_template(shape: ProgramShape, route: HeadRoute, start: int, end: int) -> LayerTemplate:
    """One layer's segments of a program shape."""
    return layer_template(shape.send_from, shape.send_to, route.num_heads, start, end)


def build_program(
    route: HeadRoute,
    strategy: Strategy,
    src_spec: KVCacheSpec,
    dst_spec: KVCacheSpec,
    src_block_ids: np.ndarray,
    dst_block_ids: np.ndarray,
    token_start: int,
    token_end: int,
) -> TransferProgram:
    """The transfer program of one pair for tokens `[token_start, token_end)`.

    Args:
        route: the heads this pair moves.
        strategy: one of `STRATEGIES`.
        src_spec, dst_spec: the two ranks' geometry.
        src_block_ids, dst_block_ids: each side's block table for the request (int64).
        token_start, token_end: the token range to move.
    """
    shape = program_shape(
        strategy,
        route,
        src_spec,
        dst_spec,
        src_block_ids,
        dst_block_ids,
        token_start,
        token_end,
    )
    template = shape_template(shape, route, token_start, token_end)
    segments = expand_layers(template, shape.send_from, shape.send_to, src_spec.num_layers)
    return TransferProgram(
        route=route,
        strategy=strategy,
        token_start=token_start,
        token_end=token_end,
        num_layers=src_spec.num_layers,
        pack=shape.pack,
        segments=segments,
        unpack=shape.unpack,
        src_staging=shape.src_staging,
        dst_staging=shape.dst_staging,
    )


def count_program_segments(
    shape: ProgramShape, route: HeadRoute, start: int, end: int, num_layers: int
) -> int:
    """Segments a program shape would list over `num_layers` layers, without listing them."""
    template = shape_template(shape, route, start, end)
    return count_segments(template, shape.send_from, shape.send_to, num_layers)
