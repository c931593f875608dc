"""gather_kv: a paged cache's cells into a dense staging buffer (the wire layout
`[layers, 2, tokens, heads, head_dim]`, or a mirror of the destination's blocks).

MLA caches (`mla=True` buffers) take the same call: one latent plane, one head.
"""

from __future__ import annotations

import torch

from kvxfer.kernels.buffers import KVBuffer
from kvxfer.kernels.copy_cells import copy_cells
from kvxfer.kernels.copy_cells_torch import copy_cells_torch


def _check(cache: KVBuffer, out: KVBuffer) -> None:
    if not cache.paged:
        raise ValueError("cache: gather reads a paged cache; pass its block_ids")
    if out.paged:
        raise ValueError("out: gather writes a dense staging buffer; pass block_ids=None")


def gather_kv(
    cache: KVBuffer,
    out: KVBuffer,
    token_start: int,
    token_end: int,
    num_heads: int,
    scales: torch.Tensor | None = None,
) -> None:
    """Gather tokens `[token_start, token_end)` and heads `[cache.head_offset, +num_heads)` of
    every layer of `cache` into `out`, with one Triton launch.
    Between two dtypes it converts, with the fp8 side's `scales` (see `copy_cells`)."""
    _check(cache, out)
    copy_cells(cache, out, token_start, token_end, num_heads, scales=scales)


def gather_kv_torch(
    cache: KVBuffer,
    out: KVBuffer,
    token_start: int,
    token_end: int,
    num_heads: int,
    scales: torch.Tensor | None = None,
) -> None:
    """`gather_kv` with torch ops (the reference, and the CPU backend)."""
    _check(cache, out)
    copy_cells_torch(cache, out, token_start, token_end, num_heads, scales)
