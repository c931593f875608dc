"""Torch implementation of the cell copy behind gather, scatter and remap: the reference
semantics for the Triton kernels, and the CPU backend.

A "cell" is one (plane, token, head) vector of `head_dim` contiguous elements. Cells are
addressed as rows of the underlying memory, so one layer is one `index_select` and one
`index_copy_`: on CPU this is several times faster than advanced indexing into the permuted 5-D
views (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import torch

from kvxfer.kernels.layout import KVBuffer, check_cell_copy

_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


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


def copy_cells_torch(
    src: KVBuffer, dst: KVBuffer, token_start: int, token_end: int, num_heads: int
) -> None:
    """Copy every layer's cells of tokens `[token_start, token_end)` and `num_heads` heads from
    `src` to `dst`. Bit-exact; other cells keep their bytes."""
    check_cell_copy(src, dst, token_start, token_end, num_heads)
    device = src.layers[0].device
    tokens = torch.arange(token_start, token_end, device=device)
    src_layers, dst_layers = src.canonical_layers(), dst.canonical_layers()
    src_rows = cell_rows(src_layers[0], *src.token_cells(tokens), src.head_offset, num_heads)
    dst_rows = cell_rows(dst_layers[0], *dst.token_cells(tokens), dst.head_offset, num_heads)
    for s, d in zip(src_layers, dst_layers, strict=True):
        as_rows(d).index_copy_(0, dst_rows, as_rows(s).index_select(0, src_rows))
