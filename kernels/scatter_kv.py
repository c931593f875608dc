"""scatter_kv: a dense staging buffer's cells (wire layout or a mirror of the source's blocks)
into a paged cache, at the cache's `head_offset`.

MLA caches (`mla=True` buffers) take the same call: one latent plane, one head.
"""

from __future__ import annotations

import torch

from kvxfer.kernels.buffers import KVBuffer
from kvxfer.kernels.copy_cells import copy_cells
from kvxfer.kernels.copy_cells_torch import copy_cells_torch


def _check(staged: KVBuffer, cache: KVBuffer) -> None:
    if staged.paged:
        raise ValueError("staged: scatter reads a dense staging buffer; pass block_ids=None")
    if not cache.paged:
        raise ValueError("cache: scatter writes a paged cache; pass its block_ids")


def scatter_kv(
    staged: KVBuffer,
    cache: KVBuffer,
    token_start: int,
    token_end: int,
    num_heads: int,
    scales: torch.Tensor | None = None,
) -> None:
    """Scatter tokens `[token_start, token_end)` of `staged` into heads
    `[cache.head_offset, +num_heads)` of every layer of `cache`, with one Triton launch.
    Between two dtypes it converts, with the fp8 side's `scales` (see `copy_cells`)."""
    _check(staged, cache)
    copy_cells(staged, cache, token_start, token_end, num_heads, scales=scales)


def scatter_kv_torch(
    staged: KVBuffer,
    cache: KVBuffer,
    token_start: int,
    token_end: int,
    num_heads: int,
    scales: torch.Tensor | None = None,
) -> None:
    """`scatter_kv` with torch ops (the reference, and the CPU backend)."""
    _check(staged, cache)
    copy_cells_torch(staged, cache, token_start, token_end, num_heads, scales)
