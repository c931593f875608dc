"""The cell-copy kernel's launch choices, apart from the op (`copy_cells.py`): each side's
geometry as the kernel sees it, the word width its elements move in, the tile of tokens and
heads a program owns, and the warps per program. Pure host arithmetic on shapes and
alignments; `prepare_cell_copy` checks its inputs first and turns these choices into the
kernel's arguments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvxfer.kernels.buffers import KVBuffer, canonical_kv_view
from kvxfer.kernels.layer_sets import VECTOR_BYTES, LayerSet

# Bytes per program: 32 KiB keeps every configuration of benchmarks/kernel_codegen.py at or
# under 96 registers without spills on sm_90 (16 tokens x 8 heads x 128 bf16 = 32 KiB).
TILE_BYTES = 32 * 1024
MAX_TILE_TOKENS = 64


@dataclass(frozen=True)
class SideGeometry:
    """One side's canonical strides (elements), block size and how positions map to slots."""

    shape: tuple[int, int, int, int, int]  # plane, block, slot, head, head_dim
    strides: tuple[int, int, int, int]  # plane, block, slot, head
    itemsize: int
    linear: bool  # position p sits at p * slot stride: no block arithmetic needed

    @classmethod
    def of(cls, buf: KVBuffer) -> SideGeometry:
        """The geometry of `buf`'s first layer (every layer shares it).

        Raises:
            ValueError: head_dim is not the contiguous axis.
        """
        first = buf.layers[0]
        view = canonical_kv_view(first, buf.layout, buf.kv_placement, buf.mla)
        planes, blocks, block_size, heads, head_dim = view.shape
        if view.stride(4) != 1:
            raise ValueError("layers: head_dim must be the contiguous axis (stride 1)")
        sp, sb, ss, sh, _ = view.stride()
        linear = buf.block_ids is None and sb == block_size * ss
        shape = (planes, blocks, block_size, heads, head_dim)
        return cls(shape, (sp, sb, ss, sh), first.element_size(), linear)

    @property
    def planes(self) -> int:
        """1 for an MLA latent, else 2 (K and V)."""
        return self.shape[0]

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self.shape[2]

    @property
    def head_dim(self) -> int:
        """Elements per head."""
        return self.shape[4]


@dataclass(frozen=True)
class Words:
    """The integer words elements move in, per side, and whether every row start on both sides
    is 16-byte aligned (then the kernel is told so and the compiler emits 16-byte accesses)."""

    src: int
    dst: int
    aligned: bool


@dataclass(frozen=True)
class Tiling:
    """A program's tile: `block_t` tokens by `block_h` heads by `block_w` words, `head_words`
    of them real, and the bytes of one token's row of the tile."""

    block_t: int
    block_h: int
    block_w: int
    head_words: int
    row_bytes: int

    @property
    def num_warps(self) -> int:
        """Warps per program for this tile (`warps_for`)."""
        return warps_for(self.block_t * self.row_bytes)


def copy_words(
    src: tuple[SideGeometry, LayerSet], dst: tuple[SideGeometry, LayerSet], converting: bool
) -> Words:
    """The words of a copy: between equal dtypes the widest word (up to 16 bytes) dividing
    every row start, stride and row length, moved as 4-byte words when that is 16; between two
    dtypes each element its own word, of its side's width."""
    head_dim = src[0].head_dim
    if converting:
        aligned = all(
            _word_bytes(side[0].itemsize, head_dim, [side]) == VECTOR_BYTES for side in (src, dst)
        )
        return Words(src[0].itemsize, dst[0].itemsize, aligned)
    word = _word_bytes(src[0].itemsize, head_dim, [src, dst])
    aligned = word == VECTOR_BYTES
    return Words(4 if aligned else word, 4 if aligned else word, aligned)


def choose_tiling(
    src: SideGeometry, dst: SideGeometry, words: Words, num_heads: int, block_t: int | None
) -> Tiling:
    """A program's tile for this copy: every head moved, a whole head's words wide, and
    `block_t` tokens (default: `tile_tokens`).

    Raises:
        ValueError: a forced `block_t` that does not divide both sides' block sizes.
    """
    head_words = src.head_dim * src.itemsize // words.src  # the same count on both sides
    block_h, block_w = next_power_of_2(num_heads), next_power_of_2(head_words)
    row_bytes = block_h * block_w * max(words.src, words.dst)
    sizes = [g.block_size for g in (src, dst) if not g.linear]
    block_t = block_t or tile_tokens(sizes, row_bytes)
    if any(bs % block_t for bs in sizes):
        raise ValueError(f"block_t: {block_t} must divide the block sizes {sizes}")
    return Tiling(block_t, block_h, block_w, head_words, row_bytes)


def tile_tokens(block_sizes: list[int], row_bytes: int) -> int:
    """Tokens per program: a power of two that divides every given block size (so a tile
    never straddles a block on either side), with at most `TILE_BYTES` per program.

    Measured on one H200 with the previous kernel (benchmarks/history/2026-11-30.md): 4 KiB
    tiles moved 2,275 GB/s and 16 KiB tiles 1,322, because each thread then walked a whole
    column; this kernel spreads a tile over every thread (benchmarks/kernel_codegen.py: no
    spills), so the tile is sized by the bytes a program should move, 32 KiB at most.
    """
    tokens = MAX_TILE_TOKENS
    for bs in block_sizes:
        tokens = math.gcd(tokens, bs & -bs)  # the largest power of two dividing bs
    while tokens > 1 and tokens * row_bytes > TILE_BYTES:
        tokens //= 2
    return tokens


def warps_for(tile_bytes: int) -> int:
    """Warps per program: one per 4 KiB of tile, 1 to 8 (16 words of 4 bytes per thread at
    most in flight: the registers stay under 96 without spills on sm_90)."""
    return max(1, min(8, tile_bytes // 4096))


def next_power_of_2(n: int) -> int:
    """The smallest power of two at least `n` (n >= 1)."""
    return 1 << (n - 1).bit_length()  # triton.next_power_of_2 costs 2 us per call


def _word_bytes(itemsize: int, head_dim: int, sides: list[tuple[SideGeometry, LayerSet]]) -> int:
    """The widest word (up to 16 bytes) dividing every row start, stride and row length."""
    granule = VECTOR_BYTES
    granule = math.gcd(granule, head_dim * itemsize)
    for geometry, layers in sides:
        granule = math.gcd(granule, layers.alignment, layers.layer_stride_bytes or granule)
        for stride in geometry.strides:
            granule = math.gcd(granule, stride * itemsize)
    return granule
