"""Transfer programs: the four strategies, as pack ops, byte segments and unpack ops.

Every strategy is "optional local cell copy on the source, byte segments over the wire, optional
local cell copy on the destination"; they differ only in the buffers the segments connect:

| strategy    | source side                  | segments                | destination side         |
|-------------|------------------------------|-------------------------|--------------------------|
| direct      | -                            | cache -> cache          | -                        |
| pack        | gather into a mirror of dst  | mirror -> cache         | -                        |
| unpack      | -                            | cache -> mirror of src  | scatter from the mirror  |
| pack+unpack | gather into the wire layout  | wire -> wire (one run)  | scatter from the wire    |

`TRAITS` holds this table as values (`StrategyTraits`): what each strategy's segments leave from
and arrive in, and which side converts; every rule about a strategy (its staging views, the
strategies a pair allows, `sizing.py`'s chunk sizes) reads it rather than naming strategies.

Between two KV dtypes (`check_dtypes`) the bytes change on the way, so `direct` is out; the
conversion runs in a cell copy: `pack` converts on the source (its mirror holds the
destination's dtype), `unpack` on the destination (its mirror holds the source's), and
`pack+unpack` where the wire carries fewer bytes: on the source when the destination's dtype is
the narrower, else on the destination (a 16-bit source and an fp8 destination: fp8 on the wire).
A converting `CellCopy` carries the fp8 side's scales for its layers.

A program moves its route's layers only (`HeadRoute`): the cache views start at each side's
local index of the route's first layer, staging holds the route's layers alone.

Connectors build *landing* programs (`landing=True`): the bytes of every strategy land in the
destination's staging, never in its cache, and the destination copies them into the cache
itself once the transfer is complete and confirmed (docs/connectors.md, "No late bytes"). Then
`direct` and `pack` land in a mirror of the destination's blocks and copy it over:

| strategy (landing) | source side          | segments                 | destination side          |
|--------------------|----------------------|--------------------------|---------------------------|
| direct             | -                    | cache -> mirror of dst   | copy the mirror's runs    |
| pack               | gather, mirror of dst| mirror -> mirror         | copy the mirror's runs    |
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Literal, cast

import numpy as np

from kvxfer.layout import is_cpu_placement
from kvxfer.plan.heads import HeadRoute
from kvxfer.plan.paged import (
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
from kvxfer.spec import FP8_DTYPES, KVCacheSpec

Strategy = Literal["direct", "pack", "unpack", "pack+unpack"]
STRATEGIES: tuple[Strategy, ...] = ("direct", "pack", "unpack", "pack+unpack")


def check_strategy(name: str) -> Strategy:
    """Validate a strategy name."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; use one of {list(STRATEGIES)}")
    return cast(Strategy, name)


Buffer = Literal["cache", "mirror_of_source", "mirror_of_destination", "wire"]


@dataclass(frozen=True)
class StrategyTraits:
    """A strategy as values: the buffers its segments join (the module docstring's first
    table) and the side that converts between two dtypes.

    Attributes:
        send_from: what the segments leave from on the source: its cache, a mirror of the
            destination's blocks (gathered into), or the wire buffer.
        send_to: what they arrive in on the destination, outside landing programs: its cache,
            a mirror of the source's blocks (scattered from), or the wire buffer. A landing
            program lands "cache" in a mirror of the destination's blocks instead.
        converts_on: "source", "destination", or "narrower": the wire holds the narrower
            dtype, so the side with the wider one converts (`conversion_side`).
    """

    send_from: Buffer
    send_to: Buffer
    converts_on: Literal["source", "destination", "narrower"]


TRAITS: dict[Strategy, StrategyTraits] = {
    "direct": StrategyTraits("cache", "cache", "destination"),
    "pack": StrategyTraits("mirror_of_destination", "cache", "source"),
    "unpack": StrategyTraits("cache", "mirror_of_source", "destination"),
    "pack+unpack": StrategyTraits("wire", "wire", "narrower"),
}
"""Every strategy's traits: the one place that says what a strategy does."""

# The strategies whose byte segments address the source's or the destination's cache itself.
_SEGMENTS_FROM_SOURCE_CACHE = frozenset(s for s, t in TRAITS.items() if t.send_from == "cache")
_SEGMENTS_INTO_DESTINATION_CACHE = frozenset(s for s, t in TRAITS.items() if t.send_to == "cache")


def landed_in(strategy: Strategy, landing: bool) -> Buffer:
    """What `strategy`'s segments arrive in on the destination: a landing program lands what
    would go into the cache in a mirror of the destination's blocks."""
    send_to = TRAITS[strategy].send_to
    return "mirror_of_destination" if landing and send_to == "cache" else send_to


def staged_block_size(buffer: Buffer, src: KVCacheSpec, dst: KVCacheSpec) -> int:
    """The tokens a chunk's staging of `buffer` holds whole: a mirror holds whole blocks of the
    side it mirrors, the wire buffer one row per token (1); the cache stages nothing (1)."""
    if buffer == "mirror_of_source":
        return src.block_size
    if buffer == "mirror_of_destination":
        return dst.block_size
    return 1


def strategies_for(src_spec: KVCacheSpec, dst_spec: KVCacheSpec) -> tuple[Strategy, ...]:
    """The strategies that can move KV between these two caches, simplest first.

    Every strategy, except where a side is in a CPU attention placement (`k_transposed`,
    `amx_tiles`): its cells are not contiguous rows, so byte segments never address that
    cache; only a cell copy on its own side (the torch backend) reads or writes it. Such a
    source then needs a pack, such a destination an unpack (landing: `direct` and `pack`
    would land in a mirror of the destination's blocks, which the segments cannot address
    either). Between two
    dtypes `direct` is out: only a cell copy converts; and `pack` too where the destination's
    fp8 write truncates (`KVCacheSpec.fp8_rounding`): that conversion runs on its own side.
    """
    excluded: set[Strategy] = set()
    if src_spec.dtype != dst_spec.dtype:
        # no cell copy on either side to convert in
        excluded |= _SEGMENTS_FROM_SOURCE_CACHE & _SEGMENTS_INTO_DESTINATION_CACHE
        if dst_spec.fp8_rounding == "toward_zero":  # converts on its own side only
            excluded |= {s for s, t in TRAITS.items() if t.converts_on == "source"}
    if _cpu_placement(src_spec):
        excluded |= _SEGMENTS_FROM_SOURCE_CACHE
    if _cpu_placement(dst_spec):
        excluded |= _SEGMENTS_INTO_DESTINATION_CACHE
    return tuple(s for s in STRATEGIES if s not in excluded)


def check_strategy_for(strategy: Strategy, src_spec: KVCacheSpec, dst_spec: KVCacheSpec) -> None:
    """Refuse a forced strategy that cannot move KV between these caches (`strategies_for`).

    Raises:
        ValueError: naming the strategy, the side at fault and the strategies that work.
    """
    allowed = strategies_for(src_spec, dst_spec)
    if strategy in allowed:
        return
    if strategy == "direct" and src_spec.dtype != dst_spec.dtype:
        raise ValueError(
            f"strategy 'direct' cannot move KV here: it copies bytes, and the source's "
            f"{src_spec.dtype} must become the destination's {dst_spec.dtype}; use one of "
            f"{list(allowed)} (a cell copy converts), or let the cost model choose (strategy=None)"
        )
    if not (_cpu_placement(src_spec) or _cpu_placement(dst_spec)):  # then pack's rounding
        raise ValueError(
            f"strategy 'pack' cannot move KV here: it converts on the source, and the "
            f"destination's fp8 write rounds {dst_spec.fp8_rounding!r} (vLLM CPU attention), "
            f"which only its own side reproduces; use one of {list(allowed)}, or let the cost "
            "model choose (strategy=None)"
        )
    side, spec = ("source", src_spec) if _cpu_placement(src_spec) else ("destination", dst_spec)
    raise ValueError(
        f"strategy {strategy!r} cannot move KV here: the {side} cache is "
        f"{spec.kv_placement!r} (vLLM CPU attention), whose cells byte segments cannot "
        f"address; use one of {list(allowed)}, or let the cost model choose (strategy=None)"
    )


def conversion_side(
    strategy: Strategy, src: KVCacheSpec | BlockGeometry, dst: KVCacheSpec | BlockGeometry
) -> Literal["source", "destination"] | None:
    """Which side's cell copy converts between the two KV dtypes under `strategy` (the module
    docstring), or None between equal dtypes: `pack+unpack`'s wire buffer takes the narrower
    dtype, the destination's only when it is narrower (`_staging_views` builds it so) and the
    destination's fp8 write is one both backends reproduce: one that truncates (vLLM CPU
    attention) converts on its own side, with the torch backend."""
    if src.dtype == dst.dtype:
        return None
    converts_on = TRAITS[strategy].converts_on
    if converts_on != "narrower":
        return converts_on
    narrower = dst.itemsize < src.itemsize
    return "source" if narrower and dst.fp8_rounding != "toward_zero" else "destination"


def _cpu_placement(spec: KVCacheSpec) -> bool:
    return is_cpu_placement(spec.kv_placement, spec.mla)


@dataclass(frozen=True)
class CellCopy:
    """A local copy of the moved cells between two buffers of one side (a kernel pass).

    It copies `num_layers` layers: a cache's from its view's `layer_offset` on, a staging
    buffer's from its first; None copies every layer of the tensors it is given. Between two
    dtypes it converts, with `scales` (float32 `[layers, planes]`: the fp8 side's, for the
    copy's layers) where one side is fp8.
    """

    src: PagedView
    dst: PagedView
    num_heads: int
    token_start: int
    token_end: int
    num_layers: int | None = None
    scales: np.ndarray | None = None

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
    num_layers: int  # the route's layers

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
    num_layers: int  # the route's layers (staging holds these only)
    pack: CellCopy | None
    segments: Segments
    unpack: CellCopy | None
    src_staging: BlockGeometry | None
    dst_staging: BlockGeometry | None

    @property
    def nbytes(self) -> int:
        """Bytes written over the transport."""
        return self.segments.nbytes


def _staging_views(
    strategy: Strategy,
    src_geometry: BlockGeometry,
    dst_geometry: BlockGeometry,
    num_heads: int,
    token_start: int,
    token_end: int,
    landing: bool = False,
) -> tuple[PagedView | None, PagedView | None]:
    """The (source-side, destination-side) staging buffers of a strategy, if any; with
    `landing`, the destination side always has one.

    Where both sides stage in the same layout (pack+unpack's wire buffer, a landing pack's
    mirror of the destination's blocks), both get the same view: the segments between them
    are then planned without enumerating cells (`segments.staging_copy_template`).
    """
    n, t0, t1 = num_heads, token_start, token_end

    def view(buffer: Buffer) -> PagedView | None:
        if buffer == "mirror_of_destination":
            return staging_mirror(dst_geometry, n, t0, t1)
        if buffer == "mirror_of_source":
            return staging_mirror(src_geometry, n, t0, t1)
        if buffer == "wire":  # in the dtype of the side that does not convert
            source_converts = conversion_side(strategy, src_geometry, dst_geometry) == "source"
            return wire_buffer(dst_geometry if source_converts else src_geometry, n, t0, t1)
        return None  # the cache

    send_from, lands_in = TRAITS[strategy].send_from, landed_in(strategy, landing)
    source = view(send_from)
    return source, source if lands_in == send_from else view(lands_in)


@dataclass(frozen=True)
class PairChunk:
    """One rank pair's tokens `[token_start, token_end)` under one strategy: what every program
    and cell copy of the pair is built from. A whole request is the chunk of all its tokens.

    Its methods take the chunk's blocks on each side: the block ids from the one holding
    `token_start` to the one holding the last token (`source_blocks` and `destination_blocks`
    cut them from a whole table, a view), so their work and memory are O(the chunk), never
    O(the request). `landing`: a connector's program (the module docstring).
    """

    route: HeadRoute
    strategy: Strategy
    src_spec: KVCacheSpec
    dst_spec: KVCacheSpec
    token_start: int
    token_end: int
    landing: bool = False

    def source_blocks(self, table: np.ndarray) -> np.ndarray:
        """The chunk's part of the source's whole block table (a view)."""
        return chunk_blocks(table, self.src_spec.block_size, self.token_start, self.token_end)

    def destination_blocks(self, table: np.ndarray) -> np.ndarray:
        """The chunk's part of the destination's whole block table (a view)."""
        return chunk_blocks(table, self.dst_spec.block_size, self.token_start, self.token_end)

    def shape(self, src_blocks: np.ndarray, dst_blocks: np.ndarray) -> ProgramShape:
        """The strategy's buffers for the chunk, before segments are listed."""
        src_cache, dst_cache = self._source_cache(src_blocks), self._destination_cache(dst_blocks)
        src_staging, dst_staging = self._staging(src_cache.geometry, dst_cache.geometry)
        pack = self._copy(src_cache, src_staging) if src_staging else None
        unpack = self._copy(dst_staging, dst_cache) if dst_staging else None
        send_from, send_to = src_staging or src_cache, dst_staging or dst_cache
        layers, _, _ = self._span
        return ProgramShape(self.strategy, send_from, send_to, pack, unpack, layers)

    def program(self, src_blocks: np.ndarray, dst_blocks: np.ndarray) -> TransferProgram:
        """The chunk's transfer program: pack, byte segments, unpack."""
        shape = self.shape(src_blocks, dst_blocks)
        t0, t1 = self.token_start, self.token_end
        template = layer_template(shape.send_from, shape.send_to, self.route.num_heads, t0, t1)
        return TransferProgram(
            route=self.route,
            strategy=self.strategy,
            token_start=t0,
            token_end=t1,
            num_layers=shape.num_layers,
            pack=shape.pack,
            segments=expand_layers(template, shape.send_from, shape.send_to, shape.num_layers),
            unpack=shape.unpack,
            src_staging=shape.src_staging,
            dst_staging=shape.dst_staging,
        )

    def pack(self, src_blocks: np.ndarray) -> CellCopy | None:
        """The source's part alone (what a producer runs into its staging before a consumer
        reads the chunk), or None when the strategy sends from the cache."""
        src_cache = self._source_cache(src_blocks)
        src_staging, _ = self._staging(src_cache.geometry, BlockGeometry.of_spec(self.dst_spec))
        return None if src_staging is None else self._copy(src_cache, src_staging)

    def unpack(self, dst_blocks: np.ndarray) -> CellCopy | None:
        """The destination's part alone (what a consumer runs once the chunk landed in its
        staging), or None when the strategy writes the cache directly."""
        dst_cache = self._destination_cache(dst_blocks)
        _, dst_staging = self._staging(BlockGeometry.of_spec(self.src_spec), dst_cache.geometry)
        return None if dst_staging is None else self._copy(dst_staging, dst_cache)

    @functools.cached_property
    def _span(self) -> tuple[int, int, int]:
        """The route's (layers, first local layer on the source, on the destination)."""
        return self.route.layer_span(self.src_spec, self.dst_spec)

    def _source_cache(self, blocks: np.ndarray) -> PagedView:
        _, layer, _ = self._span
        view = cache_view(self.src_spec, blocks, self.route.src_head_offset, layer)
        return _from_chunk_start(view, self.token_start)

    def _destination_cache(self, blocks: np.ndarray) -> PagedView:
        _, _, layer = self._span
        view = cache_view(self.dst_spec, blocks, self.route.dst_head_offset, layer)
        return _from_chunk_start(view, self.token_start)

    def _staging(
        self, src: BlockGeometry, dst: BlockGeometry
    ) -> tuple[PagedView | None, PagedView | None]:
        n, t0, t1 = self.route.num_heads, self.token_start, self.token_end
        return _staging_views(self.strategy, src, dst, n, t0, t1, self.landing)

    def _copy(self, src: PagedView, dst: PagedView) -> CellCopy:
        specs = (self.src_spec, self.dst_spec)
        return _cell_copy(src, dst, self.route, specs, self.token_start, self.token_end)


def _from_chunk_start(view: PagedView, token_start: int) -> PagedView:
    """A cache view over the chunk's blocks alone: its block table starts at the block holding
    `token_start` (the token shift of that block's first token)."""
    bs = view.geometry.block_size
    return replace(view, token_shift=token_start // bs * bs)


def _cell_copy(
    src: PagedView,
    dst: PagedView,
    route: HeadRoute,
    specs: tuple[KVCacheSpec, KVCacheSpec],
    token_start: int,
    token_end: int,
) -> CellCopy:
    """The cell copy from `src` to `dst` (one side's cache and staging, or the reverse) of
    the route's layers, with the scales a conversion between them needs. `specs`: the
    pair's (source, destination)."""
    src_spec, dst_spec = specs
    layers, src_layer, dst_layer = route.layer_span(src_spec, dst_spec)
    scales = None
    a, b = src.geometry.dtype, dst.geometry.dtype
    if a != b and (a in FP8_DTYPES or b in FP8_DTYPES):  # the fp8 side's, for these layers
        fp8_source = src_spec.dtype in FP8_DTYPES
        fp8_spec, first = (src_spec, src_layer) if fp8_source else (dst_spec, dst_layer)
        scales = fp8_spec.layer_scales(first, layers)
    return CellCopy(src, dst, route.num_heads, token_start, token_end, layers, scales)


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
    landing: bool = False,
) -> TransferProgram:
    """The transfer program of one pair for tokens `[token_start, token_end)` of a request:
    the `PairChunk` of those tokens, over the request's whole block tables.

    Args:
        route: the heads and layers this pair moves.
        strategy: one of `STRATEGIES`.
        src_spec: the source rank's geometry.
        dst_spec: the destination rank's geometry.
        src_block_ids: the source's block table for the request (int64).
        dst_block_ids: the destination's block table for the request (int64).
        token_start: the first token to move.
        token_end: one past the last token to move.
        landing: a connector's program: every strategy lands in the destination's staging.
    """
    chunk = PairChunk(route, strategy, src_spec, dst_spec, token_start, token_end, landing)
    return chunk.program(
        chunk.source_blocks(src_block_ids), chunk.destination_blocks(dst_block_ids)
    )


def count_program_segments(
    shape: ProgramShape, route: HeadRoute, start: int, end: int, num_layers: int
) -> int:
    """Segments a program shape would list over `num_layers` layers, without listing them."""
    template = shape_template(shape, route, start, end)
    return count_segments(template, shape.send_from, shape.send_to, num_layers)


def chunk_blocks(
    block_ids: np.ndarray, block_size: int, token_start: int, token_end: int
) -> np.ndarray:
    """The part of a block table that holds tokens `[token_start, token_end)`: the ids from
    block `token_start // block_size` to the one holding the last token (a view, O(1)). A
    chunk's programs need no more of a request's table (`PairChunk`)."""
    return block_ids[token_start // block_size : (token_end - 1) // block_size + 1]


def chunk_block_count(block_size: int, token_start: int, token_end: int) -> int:
    """How many blocks of `block_size` tokens hold tokens `[token_start, token_end)`."""
    return (token_end - 1) // block_size - token_start // block_size + 1
