"""The layout contract (docs/design.md) in one place: how one layer of a paged KV cache sits
in memory.

A layer tensor's axes are named by their role:

| axis | role |
|---|---|
| `plane` | K (0) or V (1); an MLA latent cache has none |
| `block` | the block (page) |
| `slot` | a token's position in its block |
| `head` | a KV head among those the buffer holds; an MLA latent cache has none |
| `dim` | a head's elements: always innermost, contiguous |
| `cell` | a `kv_inner` row: K then V, `plane` and `dim` merged (`2 * head_dim` elements) |

`memory_axes` orders them outermost first for every (layout, kv_placement, mla): the contract.
The rest follows from it: the tensor's shape (`layer_shape`), the canonical view
`[plane, block, slot, head, head_dim]` every kernel reads (`canonical_view`) and the element
strides of that view on a contiguous layer (`canonical_strides`, pure integers for the planner).

One engine layout has no single axis order: vLLM's CPU attention (`k_transposed`, HND only).
Its layer tensor is registered as `[blocks, heads, block_size, 2 * head_dim]`, the shape and
strides of HND `kv_inner`, but inside each (block, head) the `2 * block_size * head_dim`
elements hold K dim-major, `[head_dim, block_size]`, then V slot-major, `[block_size,
head_dim]` (vLLM's `cpu_attn_reshape_and_cache`, docs/engine-layouts.md). K's elements of one
token are then `block_size` apart, so no `head_dim` row of K is contiguous: such a layer has a
view per plane (`plane_views`), no canonical view, and is read and written only by the torch
cell copy, never by byte segments or the Triton kernels (`kvxfer.plan.program.strategies_for`).
The same holds for CPU attention's other layout, `amx_tiles` (bf16 and fp8 caches on CPUs with
AMX tiles, vLLM's `amx` ISA, `csrc/cpu/cpu_attn_amx.hpp`): each (block, head) holds K in groups
of 16 slots, a pair of dims side by side per slot, `K[s, d]` at `(s // 16) * 16 * head_dim +
(d // 2) * 32 + (s % 16) * 2 + d % 2`, then V in groups of 16 dims, a pair of slots side by
side per dim, `V[s, d]` at `block_size * head_dim + (d // 16) * 16 * block_size + (s // 2) *
32 + (d % 16) * 2 + s % 2`. Neither plane has a `[block, slot, head, head_dim]` view; both have
a `[block, slot // g, slot % g, head, dim // e, dim % e]` one (`cell_planes`).

The element dtypes (`DType`, their torch dtypes and sizes) and how an engine rounds into fp8
(`FP8Rounding`) are the contract's too. The spec, the planner, the kernels, the vLLM tensor
reader and the test cluster derive their layouts from here. `kvxfer/reference.py` does not,
on purpose: it indexes each layout of docs/design.md's table itself, so that it stays an
independent oracle for the tests.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

Layout = Literal["NHD", "HND"]
KVPlacement = Literal["kv_first", "blocks_first", "kv_inner", "k_transposed", "amx_tiles"]

LAYOUTS: tuple[str, ...] = ("NHD", "HND")
# Placements whose every (plane, token, head) cell is `head_dim` contiguous elements: every
# strategy, both backends and every kernel move them.
KV_PLACEMENTS: tuple[str, ...] = ("kv_first", "blocks_first", "kv_inner")
# vLLM CPU attention's layout (the module docstring): K dim-major, V slot-major inside each
# (block, head); HND only, torch backend only, never addressed by byte segments.
K_TRANSPOSED = "k_transposed"
# vLLM CPU attention's AMX layout (the module docstring): the same rules, and blocks and
# head_dim multiples of 16 (its tile groups).
AMX_TILES = "amx_tiles"
AMX_GROUP = 16
# The CPU attention placements: registered in HND kv_inner's shape, moved element by element.
CPU_PLACEMENTS: tuple[str, ...] = (K_TRANSPOSED, AMX_TILES)
ALL_KV_PLACEMENTS: tuple[str, ...] = (*KV_PLACEMENTS, *CPU_PLACEMENTS)

# fp8 caches (vLLM's kv_cache_dtype "fp8", "fp8_e4m3", "fp8_e5m2") are moved as bytes between
# equal dtypes; between a 16- or 32-bit float and fp8 the copy kernels convert, with the fp8
# side's scales (`k_scales`, `v_scales`; kvxfer.kernels.convert).
DType = Literal["float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2"]

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
# How an engine's own cache write rounds values into its fp8 cache (`KVCacheSpec.fp8_rounding`).
FP8Rounding = Literal["nearest_even", "toward_zero", "torch_cast"]
FP8_ROUNDINGS: tuple[str, ...] = ("nearest_even", "toward_zero", "torch_cast")
DTYPE_ITEMSIZE: dict[str, int] = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}

PLANE, BLOCK, SLOT, HEAD, DIM, CELL = "plane", "block", "slot", "head", "dim", "cell"
CANONICAL_AXES: tuple[str, ...] = (PLANE, BLOCK, SLOT, HEAD, DIM)

# docs/design.md's table (kv_inner: docs/kernels-and-layouts.md, "Layout contract", vLLM 0.33's
# LBNHC and LBHNC), outermost first.
_KV_MEMORY_AXES: dict[tuple[str, str], tuple[str, ...]] = {
    ("NHD", "kv_first"): (PLANE, BLOCK, SLOT, HEAD, DIM),
    ("HND", "kv_first"): (PLANE, BLOCK, HEAD, SLOT, DIM),
    ("NHD", "blocks_first"): (BLOCK, PLANE, SLOT, HEAD, DIM),
    ("HND", "blocks_first"): (BLOCK, PLANE, HEAD, SLOT, DIM),
    ("NHD", "kv_inner"): (BLOCK, SLOT, HEAD, PLANE, DIM),
    ("HND", "kv_inner"): (BLOCK, HEAD, SLOT, PLANE, DIM),
}
_MLA_MEMORY_AXES: tuple[str, ...] = (BLOCK, SLOT, DIM)


def memory_axes(layout: str, kv_placement: str, mla: bool) -> tuple[str, ...]:
    """The axes of a layer in memory order, outermost first, with `plane` and `dim` apart.

    `layout` and `kv_placement` are ignored when `mla`.

    Raises:
        ValueError: an unknown layout or placement, or a CPU attention placement, which has no
            single order (its planes differ: `cell_planes`).
    """
    if mla:
        return _MLA_MEMORY_AXES
    if kv_placement in CPU_PLACEMENTS:
        raise ValueError(
            f"kv_placement {kv_placement!r} (vLLM CPU attention) keeps K and V in orders of "
            "their own: no single axis order describes it; use kvxfer.layout.cell_planes, "
            "or a strategy that copies it with the torch backend (strategies_for)"
        )
    axes = _KV_MEMORY_AXES.get((layout, kv_placement))
    if axes is None:
        raise ValueError(
            f"layout {layout!r} with kv_placement {kv_placement!r} is not in the layout "
            f"contract; use a layout of {list(LAYOUTS)} and a placement of {list(KV_PLACEMENTS)}"
        )
    return axes


def layer_axes(layout: str, kv_placement: str, mla: bool) -> tuple[str, ...]:
    """The axes of a layer tensor, in the tensor's order (kv_inner merges `plane, dim` into
    `cell`; a `k_transposed` layer is registered in HND kv_inner's shape)."""
    if is_cpu_placement(kv_placement, mla):
        _check_cpu_placement_layout(layout, kv_placement)
        return (BLOCK, HEAD, SLOT, CELL)
    axes = memory_axes(layout, kv_placement, mla)
    if axes[-2:] == (PLANE, DIM):
        return (*axes[:-2], CELL)
    return axes


def _axis_sizes(num_blocks: int, block_size: int, num_heads: int, head_dim: int) -> dict[str, int]:
    return {
        PLANE: 2,
        BLOCK: num_blocks,
        SLOT: block_size,
        HEAD: num_heads,
        DIM: head_dim,
        CELL: 2 * head_dim,
    }


def layer_shape(
    num_blocks: int,
    block_size: int,
    num_heads: int,
    head_dim: int,
    layout: str,
    kv_placement: str,
    mla: bool,
) -> tuple[int, ...]:
    """The per-layer tensor shape (docs/design.md's table); `num_heads` is the buffer's own heads
    (`h`), ignored when `mla`."""
    sizes = _axis_sizes(num_blocks, block_size, num_heads, head_dim)
    return tuple(sizes[axis] for axis in layer_axes(layout, kv_placement, mla))


def canonical_strides(
    num_blocks: int,
    block_size: int,
    num_heads: int,
    head_dim: int,
    layout: str,
    kv_placement: str,
    mla: bool,
    block_stride: int = 0,
) -> tuple[int, int, int, int]:
    """Element strides of the canonical axes (plane, block, slot, head) of a contiguous layer,
    or of one whose blocks sit `block_stride` elements apart (blocks outermost; 0: dense).

    `dim` has stride 1 in every layout. The axes an MLA layer lacks (`plane`, `head`) have
    stride 0, as in `canonical_view`: only their index 0 exists. Pure integer arithmetic,
    for the planner's hot paths; equal to `canonical_view(tensor).stride()[:4]` of a
    contiguous `tensor`.
    """
    sizes = _axis_sizes(num_blocks, block_size, num_heads, head_dim)
    strides = {PLANE: 0, HEAD: 0}
    step = 1
    for axis in reversed(memory_axes(layout, kv_placement, mla)):
        strides[axis] = step
        step *= sizes[axis]
    if block_stride:
        strides[BLOCK] = block_stride
    return strides[PLANE], strides[BLOCK], strides[SLOT], strides[HEAD]


def canonical_view(tensor: torch.Tensor, layout: str, kv_placement: str, mla: bool) -> torch.Tensor:
    """View one layer's tensor as `[plane, block, slot, head, head_dim]`, without copying.

    Args:
        tensor: a layer tensor in the layout contract's shape (any strides: the view permutes
            them, so it works on slices and staging buffers as well).
        layout: "NHD" or "HND" (ignored when `mla`).
        kv_placement: "kv_first", "blocks_first" or "kv_inner" (ignored when `mla`).
        mla: `tensor` is `[block, slot, head_dim]`; it gets a plane and a head axis of size 1
            and stride 0.

    Raises:
        ValueError: `tensor` has the wrong number of axes (or an odd kv_inner row), the
            layout is unknown, or it is a CPU attention placement (no canonical view:
            `cell_planes`).
    """
    if is_cpu_placement(kv_placement, mla):
        memory_axes(layout, kv_placement, mla)  # raises, naming cell_planes
    axes = layer_axes(layout, kv_placement, mla)
    if tensor.dim() != len(axes):
        kind = "an MLA" if mla else f"a {layout}/{kv_placement}"
        raise ValueError(
            f"tensor: {kind} layer is {len(axes)}-D {list(axes)}, got shape {tuple(tensor.shape)}"
        )
    if mla:
        (blocks, slots, dim), (s_block, s_slot, s_dim) = tensor.shape, tensor.stride()
        return tensor.as_strided(
            (1, blocks, slots, 1, dim), (0, s_block, s_slot, 0, s_dim), tensor.storage_offset()
        )
    if axes[-1] == CELL:
        if tensor.shape[-1] % 2:
            raise ValueError(
                f"tensor: a kv_inner layer's rows hold K then V (an even last axis), got shape "
                f"{tuple(tensor.shape)}"
            )
        tensor = tensor.unflatten(-1, (2, tensor.shape[-1] // 2))
    order = memory_axes(layout, kv_placement, mla)
    return tensor.permute([order.index(axis) for axis in CANONICAL_AXES])


def is_cpu_placement(kv_placement: str, mla: bool) -> bool:
    """Whether a layer is one of vLLM CPU attention's placements, `k_transposed` or
    `amx_tiles`: no canonical view, moved element by element (an MLA latent never is one:
    `kv_placement` is ignored there)."""
    return kv_placement in CPU_PLACEMENTS and not mla


def _check_cpu_placement_layout(layout: str, kv_placement: str) -> None:
    if layout != "HND":
        raise ValueError(
            f"kv_placement {kv_placement!r} (vLLM CPU attention) is an HND layout, got layout "
            f"{layout!r}; pass layout='HND'"
        )


def canonical_shape(
    tensor: torch.Tensor, layout: str, kv_placement: str, mla: bool
) -> tuple[int, int, int, int, int]:
    """`(planes, blocks, block_size, heads, head_dim)` of one layer's tensor, for every
    placement (the CPU attention ones included, which have no `canonical_view`).

    Raises:
        ValueError: as `canonical_view`, or as `cell_planes` for a CPU attention placement.
    """
    if is_cpu_placement(kv_placement, mla):
        return 2, *cell_planes(tensor, layout, kv_placement, mla)[0].cell_shape
    p, b, s, h, d = canonical_view(tensor, layout, kv_placement, mla).shape
    return p, b, s, h, d


def plane_views(
    tensor: torch.Tensor, layout: str, kv_placement: str, mla: bool
) -> list[torch.Tensor]:
    """One view per plane (K, V; one for an MLA latent) of one layer's tensor, each
    `[block, slot, head, head_dim]`, without copying: the canonical view's planes for the
    layouts that have one, and the two differently strided planes of a `k_transposed` layer
    (K's `head_dim` axis then has stride `block_size`, its slots stride 1).

    Args:
        tensor: a layer tensor in the layout contract's shape; for `k_transposed`,
            `[blocks, heads, block_size, 2 * head_dim]` whose last two axes are dense (each
            (block, head) one run of `2 * block_size * head_dim` elements).

    Raises:
        ValueError: the tensor does not have the layout's shape, a `k_transposed` layer's
            (block, head) planes are not dense, or an `amx_tiles` layer (no such view:
            `cell_planes`).
    """
    if kv_placement == AMX_TILES and not mla:
        raise ValueError(
            "kv_placement 'amx_tiles' (vLLM CPU attention's AMX layout) has no [block, slot, "
            "head, head_dim] view of a plane; use kvxfer.layout.cell_planes"
        )
    if not is_cpu_placement(kv_placement, mla):
        view = canonical_view(tensor, layout, kv_placement, mla)
        return [view[p] for p in range(view.shape[0])]
    blocks, heads, slots, dim, (s_block, s_head) = _cpu_layer(tensor, kv_placement)
    shape = (blocks, slots, heads, dim)
    offset = tensor.storage_offset()
    k = tensor.as_strided(shape, (s_block, 1, s_head, slots), offset)
    v = tensor.as_strided(shape, (s_block, dim, s_head, 1), offset + slots * dim)
    return [k, v]


class CellPlane(NamedTuple):
    """One plane of a layer as `[block, slot // slot_group, slot % slot_group, head, dim //
    dim_group, dim % dim_group]`, a view of the layer's memory: every placement has one
    (`cell_planes`), where not every one has a `[block, slot, head, head_dim]` view."""

    view: torch.Tensor
    slot_group: int

    @property
    def shape(self) -> torch.Size:
        """The view's six axes."""
        return self.view.shape

    @property
    def cell_shape(self) -> tuple[int, int, int, int]:
        """`(blocks, block_size, heads, head_dim)` of the layer: the view's axes with each
        split one joined again."""
        blocks, slot_groups, slots, heads, dim_groups, dims = self.view.shape
        return blocks, slot_groups * slots, heads, dim_groups * dims

    def as_bits(self, dtype: torch.dtype) -> CellPlane:
        """The same plane seen as `dtype` (an integer type of the element's width)."""
        return CellPlane(self.view.view(dtype), self.slot_group)

    def read(self, blocks: torch.Tensor, slots: torch.Tensor, heads: slice) -> torch.Tensor:
        """The cells of tokens at (`blocks`, `slots`) and `heads`: `[tokens, heads, dim]`."""
        g = self.slot_group
        cells = self.view[blocks, slots // g, slots % g, heads]
        return cells.reshape(*cells.shape[:2], -1)

    def write(
        self, blocks: torch.Tensor, slots: torch.Tensor, heads: slice, cells: torch.Tensor
    ) -> None:
        """Store `cells` (`[tokens, heads, dim]`) at (`blocks`, `slots`) and `heads`."""
        g = self.slot_group
        shaped = cells.reshape(*cells.shape[:2], *self.view.shape[4:])
        self.view[blocks, slots // g, slots % g, heads] = shaped


def cell_planes(tensor: torch.Tensor, layout: str, kv_placement: str, mla: bool) -> list[CellPlane]:
    """One `CellPlane` per plane of one layer's tensor, without copying: for `amx_tiles`
    (the module docstring) K's slots in groups of 16 and dims in pairs, V's slots in pairs
    and dims in groups of 16; for every other placement the planes of `plane_views`, with
    groups of one.

    Raises:
        ValueError: as `plane_views`; an `amx_tiles` layer whose block size or head_dim is not
            a multiple of 16, or whose (block, head) planes are not dense.
    """
    if kv_placement != AMX_TILES or mla:
        return [
            CellPlane(plane[:, :, None, :, :, None], 1)
            for plane in plane_views(tensor, layout, kv_placement, mla)
        ]
    blocks, heads, slots, dim, (s_block, s_head) = _cpu_layer(tensor, kv_placement)
    if slots % AMX_GROUP or dim % AMX_GROUP:
        raise ValueError(
            f"tensor: an amx_tiles layer packs slots and dims in groups of {AMX_GROUP}, got "
            f"block_size {slots} and head_dim {dim}"
        )
    g = AMX_GROUP
    offset = tensor.storage_offset()
    k = tensor.as_strided(
        (blocks, slots // g, g, heads, dim // 2, 2), (s_block, g * dim, 2, s_head, 2 * g, 1), offset
    )
    v = tensor.as_strided(
        (blocks, slots // 2, 2, heads, dim // g, g),
        (s_block, 2 * g, 1, s_head, g * slots, 2),
        offset + slots * dim,
    )
    return [CellPlane(k, g), CellPlane(v, 2)]


def _cpu_layer(
    tensor: torch.Tensor, kv_placement: str
) -> tuple[int, int, int, int, tuple[int, int]]:
    """A CPU attention layer's blocks, heads, block size, head_dim and (block, head) strides.

    Raises:
        ValueError: not `[blocks, heads, block_size, 2 * head_dim]`, or (block, head) planes
            that are not dense.
    """
    if tensor.dim() != 4 or tensor.shape[-1] % 2:
        raise ValueError(
            f"tensor: a {kv_placement} layer is [blocks, heads, block_size, 2 * head_dim], got "
            f"shape {tuple(tensor.shape)}"
        )
    blocks, heads, slots, cell = tensor.shape
    s_block, s_head, s_slot, s_cell = tensor.stride()
    if (slots > 1 and s_slot != cell) or (cell > 1 and s_cell != 1):
        raise ValueError(
            f"tensor: a {kv_placement} layer keeps each (block, head) as one dense run of "
            f"block_size * 2 * head_dim elements, got strides {tensor.stride()} for shape "
            f"{tuple(tensor.shape)}; pass the engine's own cache tensor (not a slice of it)"
        )
    return blocks, heads, slots, cell // 2, (s_block, s_head)
