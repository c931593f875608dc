"""gather_kv: a paged cache's cells into a dense staging buffer (the wire layout
`[layers, 2, tokens, heads, head_dim]`, or a mirror of the destination's blocks).

MLA caches (`mla=True` buffers) take the same call: one latent plane, one head.
"""

from __future__ import annotations

import functools

from kvxfer.kernels.buffers import KVBuffer
from kvxfer.kernels.named_ops import NamedCopy


def _check(cache: KVBuffer, out: KVBuffer) -> None:
    if not cache.paged:
        raise ValueError("cache: gather reads a paged cache; pass its block_ids")
    if out.paged:
        raise ValueError("out: gather writes a dense staging buffer; pass block_ids=None")


gather_kv = NamedCopy("gather_kv", _check)
"""Gather tokens `[token_start, token_end)` and heads `[cache.head_offset, +num_heads)` of every
layer of a paged cache (`src`) into a dense buffer (`dst`), with one Triton launch (a
`NamedCopy`: `gather_kv(cache, out, token_start, token_end, num_heads, scales=None, *,
backend="triton")`)."""

gather_kv_torch = functools.partial(gather_kv, backend="torch")
"""`gather_kv` with torch ops (the reference, and the CPU backend)."""
