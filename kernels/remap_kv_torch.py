"""Torch implementation of the cell copy behind gather, scatter and remap: the reference
semantics for the Triton kernels, and the CPU backend.

A "cell" is one (plane, token, head) vector of `head_dim` elements. Both sides are given as
canonical views `[plane, block, slot, head, head_dim]` (see `layout.canonical_kv_view`) plus,
per moved token, its block id and slot; heads `[head_offset, head_offset + num_heads)` move.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


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
    bytes.
    """
    if len(src_layers) != len(dst_layers):
        raise ValueError(
            f"dst_layers: {len(dst_layers)} layers, but src_layers has {len(src_layers)}"
        )
    if not (src_blocks.shape == src_slots.shape == dst_blocks.shape == dst_slots.shape):
        raise ValueError("src_blocks, src_slots, dst_blocks, dst_slots: must have equal shapes")
    src_heads = slice(src_head_offset, src_head_offset + num_heads)
    dst_heads = slice(dst_head_offset, dst_head_offset + num_heads)
    for src, dst in zip(src_layers, dst_layers, strict=True):
        if src.dtype != dst.dtype:
            raise ValueError(f"dst_layers: dtype {dst.dtype} differs from source {src.dtype}")
        dst[:, dst_blocks, dst_slots, dst_heads] = src[:, src_blocks, src_slots, src_heads]
