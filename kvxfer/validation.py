"""Checks of user input (caches, block tables, token ranges, request ids, addresses) with errors
that say the fix."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

# The address checks need no torch (the bootstrap service imports them alone); re-exported.
from kvxfer.addresses import check_host as check_host
from kvxfer.addresses import check_side_channel_address as check_side_channel_address
from kvxfer.addresses import check_transport_endpoint as check_transport_endpoint
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
        if not spec.block_stride:
            if not tensor.is_contiguous():
                raise ValueError(f"{who}: layer {layer} is not contiguous; pass contiguous tensors")
        elif not _strides_match(tensor, spec.layer_strides):
            raise ValueError(
                f"{who}: layer {layer} has strides {tuple(tensor.stride())}, but the spec's "
                f"block_stride {spec.block_stride} needs {spec.layer_strides}"
            )


def _strides_match(tensor: torch.Tensor, strides: tuple[int, ...]) -> bool:
    """Whether `tensor` has these strides on every axis longer than 1 (an axis of one element
    may have any stride, as for `is_contiguous`)."""
    return all(
        n == 1 or have == want
        for n, have, want in zip(tensor.shape, tensor.stride(), strides, strict=True)
    )


def check_num_tokens(num_tokens: object, where: str = "num_tokens") -> int:
    """Check that `num_tokens` is an integer >= 1 and return it as an `int`.

    Python and numpy integers pass; bools, floats and everything else are refused.

    Raises:
        ValueError: naming `where`, the value given and the fix.
    """
    if isinstance(num_tokens, (bool, np.bool_)) or not isinstance(num_tokens, (int, np.integer)):
        raise ValueError(
            f"{where}: must be a positive integer, got {num_tokens!r} of type "
            f"{type(num_tokens).__name__}; pass the number of tokens in the request as an int"
        )
    if num_tokens <= 0:
        raise ValueError(
            f"{where}: must be a positive integer, got {num_tokens!r}; a request holds at least "
            "one token, pass num_tokens >= 1"
        )
    return int(num_tokens)


def check_token_range(num_tokens: object, start_token: object) -> tuple[int, int]:
    """Check `num_tokens >= 1` and `0 <= start_token <= num_tokens`.

    Returns:
        `(num_tokens, start_token)` as plain ints (numpy integers are accepted).

    Raises:
        ValueError: naming the argument and the fix.
    """
    tokens = check_num_tokens(num_tokens)
    if isinstance(start_token, (bool, np.bool_)) or not isinstance(start_token, (int, np.integer)):
        raise ValueError(
            f"start_token: must be an integer, got {start_token!r} of type "
            f"{type(start_token).__name__}; pass the number of prefix tokens as an int"
        )
    start = int(start_token)
    if not 0 <= start <= tokens:
        raise ValueError(
            f"start_token: {start} is outside [0, num_tokens={tokens}]; pass the "
            "number of prefix tokens the destination already holds"
        )
    return tokens, start


def covered_tokens(
    spec: KVCacheSpec, block_ids: Sequence[int] | np.ndarray, num_tokens: int
) -> int:
    """How many of a request's `num_tokens` tokens a (possibly partial) block table holds: a
    publication made while a chunked prefill still allocates its blocks
    (`KVProducer.publish(ready_tokens=...)`, then `KVProducer.extend`)."""
    return min(num_tokens, len(block_ids) * spec.block_size)


def check_published_table(
    spec: KVCacheSpec,
    block_ids: Sequence[int] | np.ndarray,
    num_tokens: int,
    who: str,
    first_token: int,
    ready_tokens: int | None,
) -> tuple[np.ndarray, int]:
    """A publication's block table, checked, and the tokens it holds: all `num_tokens` when the
    request is computed (`ready_tokens` None); while its prefill still runs, the blocks
    allocated so far, which must hold at least the computed tokens and one past `first_token`.

    Raises:
        ValueError: as `check_block_ids`, or a partial table that holds too few tokens.
    """
    covered = num_tokens
    if ready_tokens is not None:
        covered = covered_tokens(spec, block_ids, num_tokens)
        if ready_tokens > covered or covered <= first_token:
            raise ValueError(
                f"{who}: block_ids hold {covered} tokens, fewer than the {ready_tokens} computed "
                f"or none past first_token {first_token}; pass the blocks allocated so far"
            )
    return check_block_ids(spec, block_ids, covered, who, first_token), covered


def check_block_ids(
    spec: KVCacheSpec,
    block_ids: Sequence[int] | np.ndarray,
    num_tokens: int,
    who: str,
    first_token: int = 0,
) -> np.ndarray:
    """Check a request's block table on one rank and return the ids it uses as int64.

    Only the blocks of tokens `[first_token, num_tokens)` are checked: the entries before them
    are never read or written (a sliding-window group's dropped blocks, which vLLM replaces by
    its null block, the same id repeated) and come back as given.

    Raises:
        ValueError: `num_tokens` not an integer >= 1, too few ids for `num_tokens`, an id out
            of `[0, num_blocks)`, or an id used twice (two token ranges would share one block).
    """
    num_tokens = check_num_tokens(num_tokens, f"{who}: num_tokens")
    ids = np.asarray(block_ids)
    if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise ValueError(f"{who}: block_ids must be a flat list of integers")
    needed = -(-num_tokens // spec.block_size)
    if ids.size < needed:
        raise ValueError(
            f"{who}: too few block ids: {ids.size} for {num_tokens} tokens at block_size "
            f"{spec.block_size}; pass at least {needed}"
        )
    table = ids[:needed].astype(np.int64)
    first = first_token // spec.block_size
    used = table[first:]
    bad = np.flatnonzero((used < 0) | (used >= spec.num_blocks))
    if bad.size:
        raise ValueError(
            f"{who}: block id {int(used[bad[0]])} (position {first + int(bad[0])}) is out of "
            f"range [0, num_blocks={spec.num_blocks})"
        )
    unique, counts = np.unique(used, return_counts=True)
    if (counts > 1).any():
        raise ValueError(
            f"{who}: block id(s) {unique[counts > 1].tolist()} appear more than once; "
            "each block holds one range of tokens"
        )
    return table


MAX_REQUEST_ID_BYTES = 1024
"""The longest request id accepted, in UTF-8 bytes (vLLM's ids are well under 100)."""


def check_request_id(request_id: object, where: str) -> str:
    """Check a request id: a non-empty `str` of at most `MAX_REQUEST_ID_BYTES` UTF-8 bytes.

    Args:
        request_id: the id given by the caller.
        where: the call it was given to, for the message (e.g. "publish").

    Returns:
        The id, unchanged.

    Raises:
        ValueError: not a str (an int id, bytes, None), empty, too long, or not encodable as
            UTF-8; the message names the fix.
    """
    if not isinstance(request_id, str):
        raise ValueError(
            f"{where}: request_id must be a str, got {request_id!r} of type "
            f"{type(request_id).__name__}; pass the engine's request id as a string"
            + (f", e.g. str({request_id!r})" if isinstance(request_id, int) else "")
        )
    if not request_id:
        raise ValueError(f"{where}: request_id is empty; pass the engine's (non-empty) request id")
    try:
        size = len(request_id.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{where}: request_id {request_id!r} is not valid UTF-8 ({exc.reason}); pass an id "
            "without lone surrogates"
        ) from exc
    if size > MAX_REQUEST_ID_BYTES:
        raise ValueError(
            f"{where}: request_id is {size} bytes long, more than {MAX_REQUEST_ID_BYTES}; pass a "
            "shorter id (e.g. a hash of this one)"
        )
    return request_id


def check_first_token(first_token: object, num_tokens: int, where: str) -> int:
    """`first_token` (the first token whose KV a published request's blocks still hold) as an
    int in `[0, num_tokens)`."""
    if isinstance(first_token, bool) or not isinstance(first_token, (int, np.integer)):
        raise ValueError(f"{where}: first_token must be an int, got {first_token!r}")
    held_from = int(first_token)
    if not 0 <= held_from < num_tokens:
        raise ValueError(
            f"{where}: first_token {held_from} is outside [0, num_tokens={num_tokens}); pass "
            "the first token whose KV the blocks still hold (0 for all of them)"
        )
    return held_from


def check_ready_tokens(ready_tokens: object, num_tokens: int | None, where: str) -> int:
    """`ready_tokens` (how many of a request's first tokens are computed) as an int in
    `[0, num_tokens]` (no upper bound when None)."""
    if isinstance(ready_tokens, bool) or not isinstance(ready_tokens, (int, np.integer)):
        raise ValueError(f"{where}: ready_tokens must be an int, got {ready_tokens!r}")
    ready = int(ready_tokens)
    if ready < 0 or (num_tokens is not None and ready > num_tokens):
        raise ValueError(
            f"{where}: ready_tokens {ready} is outside [0, num_tokens={num_tokens}]; pass how "
            "many of the request's first tokens are computed"
        )
    return ready


def check_marked_layers(layers: object, num_layers: int, where: str) -> int:
    """`layers` (how many of a rank's layers, local and in order, wrote some tokens) as an
    int in `[0, num_layers]`."""
    if isinstance(layers, bool) or not isinstance(layers, (int, np.integer)):
        raise ValueError(f"{where}: layers must be an int or None, got {layers!r}")
    if not 0 <= int(layers) <= num_layers:
        raise ValueError(
            f"{where}: layers {layers} is outside [0, {num_layers}]; pass how many of this "
            "rank's layers (local, in order) have written the tokens"
        )
    return int(layers)
