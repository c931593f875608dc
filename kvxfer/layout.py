"""The layout contract of DESIGN.md in one place: how one layer of a paged KV cache sits in memory.

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

The spec, the planner, the kernels, the vLLM tensor reader and the test cluster derive their
layouts from here. `kvxfer/reference.py` does not, on purpose: it indexes each layout of
DESIGN.md's table itself, so that it stays an independent oracle for the tests.
"""

from __future__ import annotations

from typing import Literal

import torch

Layout = Literal["NHD", "HND"]
KVPlacement = Literal["kv_first", "blocks_first", "kv_inner"]

LAYOUTS: tuple[str, ...] = ("NHD", "HND")
KV_PLACEMENTS: tuple[str, ...] = ("kv_first", "blocks_first", "kv_inner")

PLANE, BLOCK, SLOT, HEAD, DIM, CELL = "plane", "block", "slot", "head", "dim", "cell"
CANONICAL_AXES: tuple[str, ...] = (PLANE, BLOCK, SLOT, HEAD, DIM)

# DESIGN.md's table (kv_inner: README's extension, vLLM 0.33's LBNHC and LBHNC), outermost first.
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
        ValueError: an unknown layout or placement.
    """
    if mla:
        return _MLA_MEMORY_AXES
    axes = _KV_MEMORY_AXES.get((layout, kv_placement))
    if axes is None:
        raise ValueError(
            f"layout {layout!r} with kv_placement {kv_placement!r} is not in the layout "
            f"contract; use a layout of {list(LAYOUTS)} and a placement of {list(KV_PLACEMENTS)}"
        )
    return axes


def layer_axes(layout: str, kv_placement: str, mla: bool) -> tuple[str, ...]:
    """The axes of a layer tensor, in the tensor's order (kv_inner merges `plane, dim` into
    `cell`)."""
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
    """The per-layer tensor shape (DESIGN.md's table); `num_heads` is the buffer's own heads
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
        ValueError: `tensor` has the wrong number of axes (or an odd kv_inner row), or the
            layout is unknown.
    """
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
