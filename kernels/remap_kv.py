"""remap_kv: paged cache to paged cache in one pass (moves within one process or GPU), across
any two layouts, placements, block sizes and head offsets.

MLA caches (`mla=True` buffers) take the same call: one latent plane, one head.
"""

from __future__ import annotations

import functools

from kvxfer.kernels.buffers import KVBuffer
from kvxfer.kernels.named_ops import NamedCopy


def _check(src: KVBuffer, dst: KVBuffer) -> None:
    if not (src.paged and dst.paged):
        raise ValueError("src, dst: remap joins two paged caches; pass both block tables")


remap_kv = NamedCopy("remap_kv", _check)
"""Copy tokens `[token_start, token_end)` and `num_heads` heads of every layer from one paged
cache to another, with one Triton launch (a `NamedCopy`: `remap_kv(src, dst, token_start,
token_end, num_heads, scales=None, *, backend="triton")`)."""

remap_kv_torch = functools.partial(remap_kv, backend="torch")
"""`remap_kv` with torch ops (the reference, and the CPU backend)."""
