"""Torch implementation of the cell copy behind gather, scatter and remap: the reference
semantics for the Triton kernels, and the CPU backend.

A "cell" is one (plane, token, head) vector of `head_dim` contiguous elements. Both sides are
given as canonical views `[plane, block, slot, head, head_dim]` (see `layout.canonical_kv_view`)
plus, per moved token, its block id and slot; heads `[head_offset, head_offset + num_heads)`
move. Cells are addressed as rows of `head_dim` elements of the underlying memory, so one layer
is one `index_select` and one `index_copy_` (several times faster on CPU than advanced indexing
into the permuted 5-D views; see benchmarks/RESULTS.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def cell_rows(
    view: torch.Tensor,  # [planes, blocks, slots, heads, head_dim], head_dim contiguous
    blocks: torch.Tensor,  # [tokens] int64
    slots: torch.Tensor,  # [tokens] int64
    head_offset: int,
    num_heads: int,
) -> torch.Tensor:
    """Row index (in units of `head_dim` elements from the view's first element) of every moved
    cell, in (plane, token, head) order."""
    if view.dim() != 5 or view.stride(4) != 1:
        raise ValueError(
            f"view: expected [planes, blocks, slots, heads, head_dim] with head_dim contiguous, "
            f"got shape {tuple(view.shape)} strides {view.stride()}"
        )
    s_plane, s_block, s_slot, s_head, _ = view.stride()
    device = blocks.device
    planes = torch.arange(view.shape[0], device=device)[:, None, None] * s_plane
    tokens = (blocks * s_block + slots * s_slot)[None, :, None]
    heads = (head_offset + torch.arange(num_heads, device=device))[None, None, :] * s_head
    return ((planes + tokens + heads) // view.shape[4]).reshape(-1)


_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def as_rows(view: torch.Tensor) -> torch.Tensor:
    """The memory under a canonical view as `[rows, words]`, one row per `head_dim` elements.

    The view permutes a contiguous tensor, so its elements fill one dense range. Rows are
    reinterpreted as the widest integer word that divides them: copies move bits, and 8-byte
    words index about 1.8x faster than bf16 elements on CPU (65536 rows of 256 B, 2 cores).
    """
    d = view.shape[4]
    rows = view.as_strided((view.numel() // d, d), (d, 1))
    row_bytes, offset_bytes = d * view.element_size(), view.storage_offset() * view.element_size()
    word, dtype = next((w, t) for w, t in _WORDS if row_bytes % w == 0 and offset_bytes % w == 0)
    return rows.view(torch.uint8).view(dtype) if word != view.element_size() else rows


def remap_kv_torch(
    src_layers: Sequence[torch.Tensor],  # each [planes, blocks, slots, heads, head_dim]
    src_blocks: torch.Tensor,  # [tokens] int64
    src_slots: torch.Tensor,  # [tokens] int64
    src_head_offset: int,
    dst_layers: Sequence[torch.Tensor],  # each [planes, blocks, slots, heads, head_dim]
    dst_blocks: torch.Tensor,  # [tokens] int64
    dst_slots: torch.Tensor,  # [tokens] int64
    dst_head_offset: int,
    num_heads: int,
) -> None:
    """Copy every layer's cells of the listed tokens and heads from `src_layers` to `dst_layers`.

    Bit-exact: elements are copied, never converted. Cells of other tokens and heads keep their
    bytes. All layers of one side must share one layout (their strides).
    """
    if len(src_layers) != len(dst_layers):
        raise ValueError(
            f"dst_layers: {len(dst_layers)} layers, but src_layers has {len(src_layers)}"
        )
    if not (src_blocks.shape == src_slots.shape == dst_blocks.shape == dst_slots.shape):
        raise ValueError("src_blocks, src_slots, dst_blocks, dst_slots: must have equal shapes")
    if not src_layers:
        return
    src_rows = cell_rows(src_layers[0], src_blocks, src_slots, src_head_offset, num_heads)
    dst_rows = cell_rows(dst_layers[0], dst_blocks, dst_slots, dst_head_offset, num_heads)
    for src, dst in zip(src_layers, dst_layers, strict=True):
        if src.dtype != dst.dtype:
            raise ValueError(f"dst_layers: dtype {dst.dtype} differs from source {src.dtype}")
        if src.stride() != src_layers[0].stride() or dst.stride() != dst_layers[0].stride():
            raise ValueError("src_layers, dst_layers: every layer of a side needs equal strides")
        as_rows(dst).index_copy_(0, dst_rows, as_rows(src).index_select(0, src_rows))
