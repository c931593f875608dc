"""Checks of user input (caches, block tables, token ranges) with errors that say the fix."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvxfer.spec import KVCacheSpec


def check_caches(spec: KVCacheSpec, caches: Sequence[torch.Tensor], who: str) -> None:
    """Check that `caches` are the layer tensors `spec` describes.

    Raises:
        ValueError: naming the rank, the layer and what differs.
    """
    if len(caches) != spec.num_layers:
        raise ValueError(
            f"{who}: {len(caches)} cache tensors for num_layers={spec.num_layers}; "
            "pass one tensor per layer"
        )
    for layer, tensor in enumerate(caches):
        if tuple(tensor.shape) != spec.layer_shape:
            raise ValueError(
                f"{who}: layer {layer} has shape {tuple(tensor.shape)}, but the spec's layout "
                f"needs {spec.layer_shape}; allocate with kvxfer.allocate_kv_caches(spec)"
            )
        if tensor.dtype != spec.torch_dtype:
            raise ValueError(
                f"{who}: layer {layer} has dtype {tensor.dtype}, the spec says {spec.dtype}"
            )
        if not tensor.is_contiguous():
            raise ValueError(f"{who}: layer {layer} is not contiguous; pass contiguous tensors")


def check_token_range(num_tokens: int, start_token: int) -> None:
    """Check `0 <= start_token <= num_tokens` and `num_tokens > 0`."""
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens <= 0:
        raise ValueError(f"num_tokens: must be a positive integer, got {num_tokens!r}")
    if isinstance(start_token, bool) or not isinstance(start_token, int):
        raise ValueError(f"start_token: must be an integer, got {start_token!r}")
    if not 0 <= start_token <= num_tokens:
        raise ValueError(
            f"start_token: {start_token} is outside [0, num_tokens={num_tokens}]; pass the "
            "number of prefix tokens the destination already holds"
        )


def check_block_ids(
    spec: KVCacheSpec, block_ids: Sequence[int] | np.ndarray, num_tokens: int, who: str
) -> np.ndarray:
    """Check a request's block table on one rank and return the ids it uses as int64.

    Raises:
        ValueError: too few ids for `num_tokens`, an id out of `[0, num_blocks)`, or an id
            used twice (two token ranges would share one block).
    """
    ids = np.asarray(block_ids)
    if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise ValueError(f"{who}: block_ids must be a flat list of integers")
    needed = -(-num_tokens // spec.block_size)
    if ids.size < needed:
        raise ValueError(
            f"{who}: too few block ids: {ids.size} for {num_tokens} tokens at block_size "
            f"{spec.block_size}; pass at least {needed}"
        )
    used = ids[:needed].astype(np.int64)
    bad = np.flatnonzero((used < 0) | (used >= spec.num_blocks))
    if bad.size:
        raise ValueError(
            f"{who}: block id {int(used[bad[0]])} (position {int(bad[0])}) is out of range "
            f"[0, num_blocks={spec.num_blocks})"
        )
    unique, counts = np.unique(used, return_counts=True)
    if (counts > 1).any():
        raise ValueError(
            f"{who}: block id(s) {unique[counts > 1].tolist()} appear more than once; "
            "each block holds one range of tokens"
        )
    return used
