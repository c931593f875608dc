"""Where a (plane, token, head) cell lives in a paged KV buffer, as pure index arithmetic.

Every buffer kvxfer touches, a rank's cache or a staging buffer, is described the same way: a
`BlockGeometry` (how one layer is laid out) and a `PagedView` (which block holds which token,
and where the transferred heads start). Canonical axis order is `(plane, block, slot, head)`,
with `head_dim` elements contiguous inside a cell; plane 0 is K and plane 1 is V.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from kvxfer.layout import canonical_strides, layer_shape
from kvxfer.spec import KVCacheSpec

RegionKind = Literal["cache", "staging"]

_GEOMETRIES: dict[int, tuple[KVCacheSpec, BlockGeometry]] = {}  # BlockGeometry.of_spec's memo
_GEOMETRIES_MAX = 256


@dataclass(frozen=True)
class BlockGeometry:
    """The memory layout of one layer of a paged KV buffer."""

    layout: str  # "NHD" | "HND"
    kv_placement: str  # "kv_first" | "blocks_first" | "kv_inner"
    mla: bool
    num_blocks: int
    block_size: int
    num_heads: int  # heads held in this buffer
    head_dim: int
    itemsize: int
    block_stride: int = 0  # elements between blocks; 0: dense (KVCacheSpec.block_stride)
    dtype: str = ""  # KVCacheSpec.dtype; "" where only the element size matters
    fp8_rounding: str = "nearest_even"  # KVCacheSpec.fp8_rounding: how values are written

    @classmethod
    def of_spec(cls, spec: KVCacheSpec) -> BlockGeometry:
        """The geometry of a rank's cache (memoized per spec object: planning a request asks
        for it several times per pair, and building it costs about 1 us)."""
        cached = _GEOMETRIES.get(id(spec))
        if cached is not None and cached[0] is spec:
            return cached[1]
        geometry = cls(
            layout=spec.layout,
            kv_placement=spec.kv_placement,
            mla=spec.mla,
            num_blocks=spec.num_blocks,
            block_size=spec.block_size,
            num_heads=spec.heads_per_rank,
            head_dim=spec.head_dim,
            itemsize=spec.itemsize,
            block_stride=spec.block_stride,
            dtype=spec.dtype,
            fp8_rounding=spec.fp8_rounding,
        )
        if len(_GEOMETRIES) >= _GEOMETRIES_MAX:
            _GEOMETRIES.clear()
        # Keyed by identity, holding the spec itself: its id cannot be reused while it is here,
        # and specs are frozen.
        _GEOMETRIES[id(spec)] = (spec, geometry)
        return geometry

    @property
    def num_planes(self) -> int:
        """2 (K and V), or 1 for an MLA latent."""
        return 1 if self.mla else 2

    @property
    def shape(self) -> tuple[int, ...]:
        """The per-layer tensor shape (the layout contract, `kvxfer.layout`)."""
        return layer_shape(*self._layout_contract_args)

    @property
    def layer_elements(self) -> int:
        """Elements of one layer."""
        return self.num_planes * self.num_blocks * self.block_size * self.num_heads * self.head_dim

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer."""
        return self.layer_elements * self.itemsize

    @property
    def strides(self) -> tuple[int, int, int, int]:
        """Element strides of the canonical axes (plane, block, slot, head); 0 for the axes an
        MLA latent lacks (plane, head). See `kvxfer.layout.canonical_strides`."""
        return canonical_strides(*self._layout_contract_args, self.block_stride)

    @property
    def _layout_contract_args(self) -> tuple[int, int, int, int, str, str, bool]:
        """The leading arguments of `kvxfer.layout`'s `layer_shape` and `canonical_strides`."""
        return (
            self.num_blocks, self.block_size, self.num_heads, self.head_dim,
            self.layout, self.kv_placement, self.mla,
        )  # fmt: skip


def blocks_of_tokens(
    block_ids: Sequence[int] | np.ndarray, block_size: int, token_start: int, token_end: int
) -> list[int]:
    """The blocks of a block table that hold tokens `[token_start, token_end)`."""
    if token_end <= token_start:
        return []
    first, last = token_start // block_size, (token_end - 1) // block_size
    return [int(b) for b in block_ids[first : last + 1]]


def moved_bytes(geometry: BlockGeometry, num_heads: int, num_tokens: int) -> int:
    """Bytes of one layer's cells for `num_tokens` tokens and `num_heads` heads."""
    cells = geometry.num_planes * num_tokens * num_heads
    return cells * geometry.head_dim * geometry.itemsize


@dataclass(frozen=True)
class PagedView:
    """One side of a cell copy: a buffer, its block table and the offset of the moved heads.

    Token `t` sits at position `p = t - token_shift`, in block `block_ids[p // block_size]` and
    slot `p % block_size`. Caches use `token_shift=0` and the request's block ids; staging buffers
    number their blocks from 0 and shift tokens so that they start in the first block.

    Layer `i` of a copy is the buffer's layer `layer_offset + i`: a cache's local layer (a
    pipeline stage's rank holds some of the model's layers, and a route moves some of those);
    staging holds exactly the moved layers, so its offset is 0.
    """

    geometry: BlockGeometry
    block_ids: np.ndarray  # int64, one per logical block
    token_shift: int
    head_offset: int  # index of the first moved head among the buffer's heads
    region: RegionKind
    layer_offset: int = 0  # the buffer's layer of a copy's first layer

    def token_cells(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(block id, slot) of each token."""
        pos = tokens - self.token_shift
        bs = self.geometry.block_size
        return self.block_ids[pos // bs], pos % bs

    def layer_base(self, layer: int) -> tuple[int, int]:
        """(region key, byte offset of the layer inside that region) for a copy's layer
        `layer`.

        A cache registers one region per local layer (key = its local layer, `layer_offset +
        layer`); a staging buffer is one region (key `STAGING_REGION`) holding the moved layers
        back to back.
        """
        if self.region == "cache":
            return self.layer_offset + layer, 0
        return STAGING_REGION, layer * self.geometry.layer_bytes


STAGING_REGION = -1


def cache_view(
    spec: KVCacheSpec, block_ids: np.ndarray, head_offset: int, layer_offset: int = 0
) -> PagedView:
    """A rank's cache seen through a request's block table, from its local layer
    `layer_offset` on."""
    return PagedView(BlockGeometry.of_spec(spec), block_ids, 0, head_offset, "cache", layer_offset)


def staging_mirror(
    like: BlockGeometry, num_heads: int, token_start: int, token_end: int
) -> PagedView:
    """A staging buffer laid out as `like`'s blocks, holding only the moved heads and blocks.

    Its cells sit at the same slots as in the mirrored buffer, so runs that are contiguous
    there are contiguous here too.
    """
    bs = like.block_size
    first, last = token_start // bs, (token_end - 1) // bs
    geometry = BlockGeometry(
        layout=like.layout,
        kv_placement=like.kv_placement,
        mla=like.mla,
        num_blocks=last - first + 1,
        block_size=bs,
        num_heads=num_heads,
        head_dim=like.head_dim,
        itemsize=like.itemsize,
        dtype=like.dtype,
        fp8_rounding=like.fp8_rounding,  # a source-side conversion writes it as `like` does
    )
    return PagedView(geometry, np.arange(last - first + 1), first * bs, 0, "staging")


def wire_buffer(like: BlockGeometry, num_heads: int, token_start: int, token_end: int) -> PagedView:
    """The compact wire layout `[layers, 2, tokens, heads, head_dim]` (MLA: no plane axis), in
    `like`'s dtype.

    That is an NHD, kv_first buffer with one block of `tokens` slots.
    """
    geometry = BlockGeometry(
        layout="NHD",
        kv_placement="kv_first",
        mla=like.mla,
        num_blocks=1,
        block_size=token_end - token_start,
        num_heads=num_heads,
        head_dim=like.head_dim,
        itemsize=like.itemsize,
        dtype=like.dtype,
        fp8_rounding=like.fp8_rounding,  # a source-side conversion writes it as `like` does
    )
    return PagedView(geometry, np.zeros(1, dtype=np.int64), token_start, 0, "staging")
