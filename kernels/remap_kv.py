"""remap_kv: paged cache to paged cache in one pass (moves within one process or GPU), across
any two layouts, placements, block sizes and head offsets.

MLA caches (`mla=True` buffers) take the same call: one latent plane, one head.
"""

from __future__ import annotations

import torch

from kvxfer.kernels.buffers import KVBuffer
from kvxfer.kernels.copy_cells import copy_cells
from kvxfer.kernels.copy_cells_torch import copy_cells_torch


def _check(src: KVBuffer, dst: KVBuffer) -> None:
    if not (src.paged and dst.paged):
        raise ValueError("src, dst: remap joins two paged caches; pass both block tables")


def remap_kv(
    src: KVBuffer,
    dst: KVBuffer,
    token_start: int,
    token_end: int,
    num_heads: int,
    scales: torch.Tensor | None = None,
) -> None:
    """Copy tokens `[token_start, token_end)` and `num_heads` heads of every layer from one
    paged cache to another, with one Triton launch.
    Between two dtypes it converts, with the fp8 side's `scales` (see `copy_cells`)."""
    _check(src, dst)
    copy_cells(src, dst, token_start, token_end, num_heads, scales=scales)


def remap_kv_torch(
    src: KVBuffer,
    dst: KVBuffer,
    token_start: int,
    token_end: int,
    num_heads: int,
    scales: torch.Tensor | None = None,
) -> None:
    """`remap_kv` with torch ops (the reference, and the CPU backend)."""
    _check(src, dst)
    copy_cells_torch(src, dst, token_start, token_end, num_heads, scales)
