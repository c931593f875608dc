"""scatter_kv: a dense staging buffer's cells (wire layout or a mirror of the source's blocks)
into a paged cache, at the cache's `head_offset`.

MLA caches (`mla=True` buffers) take the same call: one latent plane, one head.
"""

from __future__ import annotations

import functools

from kvxfer.kernels.buffers import KVBuffer
from kvxfer.kernels.named_ops import NamedCopy


def _check(staged: KVBuffer, cache: KVBuffer) -> None:
    if staged.paged:
        raise ValueError("staged: scatter reads a dense staging buffer; pass block_ids=None")
    if not cache.paged:
        raise ValueError("cache: scatter writes a paged cache; pass its block_ids")


scatter_kv = NamedCopy("scatter_kv", _check)
"""Scatter tokens `[token_start, token_end)` of a dense staging buffer (`src`) into heads
`[cache.head_offset, +num_heads)` of every layer of a paged cache (`dst`), with one Triton
launch (a `NamedCopy`: `scatter_kv(staged, cache, token_start, token_end, num_heads,
scales=None, *, backend="triton")`)."""

scatter_kv_torch = functools.partial(scatter_kv, backend="torch")
"""`scatter_kv` with torch ops (the reference, and the CPU backend)."""
