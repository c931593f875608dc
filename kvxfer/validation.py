"""Checks of user input (caches, block tables, token ranges, request ids, addresses) with errors
that say the fix."""

from __future__ import annotations

import ipaddress
import re
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


_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)\Z")


def _host_problem(host: str) -> str | None:
    """Why `host` is neither an IP literal nor a hostname, or None when it is fine.

    An IPv6 literal comes in brackets (`[::1]`), as in URLs and ZeroMQ endpoints.
    """
    if not host:
        return "the host is empty"
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return f"{host} is not a valid IPv6 address"
        return None
    if ":" in host:
        return f"{host} is an IPv6 address without brackets (write [{host}])"
    labels = host.split(".")
    if labels[-1].isdigit():  # all-numeric top label: only an IPv4 literal is meant
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return f"{host} is not a valid IPv4 address"
        return None
    if len(host) > 253 or not all(_LABEL.match(label) for label in labels):
        return f"{host!r} is not a valid hostname or IP address"
    return None


def check_host(host: object, where: str = "host") -> str:
    """Check a host: an IPv4 literal, a bracketed or bare IPv6 literal, or a hostname.

    Returns:
        The host, unchanged.

    Raises:
        ValueError: naming `where`, the problem and the fix.
    """
    if not isinstance(host, str):
        raise ValueError(
            f"{where}: must be a str like '127.0.0.1', got {host!r} of type "
            f"{type(host).__name__}; pass the address peers reach this machine at"
        )
    bare_v6 = ":" in host and not host.startswith("[")
    problem = _host_problem(f"[{host}]" if bare_v6 else host)
    if problem:
        raise ValueError(
            f"{where}: {problem}; pass an IP address or hostname of this machine, e.g. 127.0.0.1"
        )
    return host


def _split_host_port(text: str) -> tuple[str, str] | None:
    """`(host, port)` split at the last colon (after `]` for an IPv6 literal), or None."""
    if text.startswith("["):
        end = text.find("]")
        if end < 0 or text[end + 1 : end + 2] != ":":
            return None
        return text[: end + 1], text[end + 2 :]
    host, sep, port = text.rpartition(":")
    if not sep:
        return None
    return host, port  # an unbracketed IPv6 host is reported by _host_problem


def _port_problem(port: str) -> str | None:
    if not port.isascii() or not port.isdigit():
        return f"the port {port!r} is not a number"
    if not 1 <= int(port) <= 65535:
        return f"the port {int(port)} is outside 1..65535"
    return None


def _host_port_problems(host: str, port: str) -> str:
    """Every problem of a host and a port, joined ("" when both are fine)."""
    return " and ".join(p for p in (_host_problem(host), _port_problem(port)) if p)


def check_side_channel_address(address: object) -> str:
    """Check a producer's side-channel address: `"tcp://HOST:PORT"`.

    HOST is an IPv4 literal, a bracketed IPv6 literal (`tcp://[::1]:5700`) or a hostname; PORT
    is in 1..65535. This is the form `KVProducer.address` gives.

    Returns:
        The address, unchanged.

    Raises:
        ValueError: not a str, no `tcp://` scheme (the message shows the address with it),
            another scheme, a bind-only wildcard host, a bad host or port.
    """
    if not isinstance(address, str):
        raise ValueError(
            f"address: must be a str like 'tcp://127.0.0.1:5700', got {address!r} of type "
            f"{type(address).__name__}; pass the producer's .address"
        )
    if not address:
        raise ValueError(
            "address: is empty; pass the producer's .address, e.g. 'tcp://127.0.0.1:5700'"
        )
    if address != address.strip():
        raise ValueError(f"address: {address!r} has surrounding whitespace; pass it stripped")
    scheme, sep, rest = address.partition("://")
    if not sep:
        if _split_host_port(address) is not None:
            raise ValueError(
                f"address: {address!r} has no scheme; write tcp://{address} (the producer's "
                ".address has this form)"
            )
        raise ValueError(
            f"address: {address!r} is not a side-channel address; write tcp://HOST:PORT, e.g. "
            "tcp://127.0.0.1:5700 (the producer's .address)"
        )
    if scheme != "tcp":
        example = f"tcp://{rest}" if _split_host_port(rest) else "tcp://HOST:PORT"
        raise ValueError(
            f"address: scheme {scheme + '://'!r} in {address!r} is not supported; producers "
            f"listen on TCP only, write {example}"
        )
    parts = _split_host_port(rest)
    if parts is None:
        raise ValueError(
            f"address: {address!r} has no port; write tcp://HOST:PORT, e.g. tcp://127.0.0.1:5700"
        )
    host, port = parts
    if host == "*":
        raise ValueError(
            f"address: {address!r} is a bind address (any interface); connect to an address "
            f"the producer is reachable at, e.g. tcp://127.0.0.1:{port}"
        )
    problem = _host_port_problems(host, port)
    if problem:
        raise ValueError(
            f"address: {address!r}: {problem}; write tcp://HOST:PORT with a valid host and a "
            "port in 1..65535, e.g. tcp://127.0.0.1:5700"
        )
    return address


def check_transport_endpoint(endpoint: object) -> str:
    """Check a Mooncake transport endpoint: `"HOST:PORT"` (e.g. `"127.0.0.1:15321"`).

    HOST is an IPv4 literal, a bracketed IPv6 literal or a hostname; PORT is in 1..65535. No
    scheme: this is the engine's RPC endpoint, not a side-channel address.

    Returns:
        The endpoint, unchanged.

    Raises:
        ValueError: not a str, a scheme given, a bad host or port.
    """
    if not isinstance(endpoint, str):
        raise ValueError(
            f"endpoint: must be a str like '127.0.0.1:15321', got {endpoint!r} of type "
            f"{type(endpoint).__name__}; pass the transport's .endpoint"
        )
    if "://" in endpoint:
        raise ValueError(
            f"endpoint: {endpoint!r} has a scheme; a transport endpoint is HOST:PORT, e.g. "
            f"{endpoint.partition('://')[2]}"
        )
    parts = _split_host_port(endpoint)
    problem = "it is not HOST:PORT" if parts is None else _host_port_problems(*parts)
    if problem:
        raise ValueError(
            f"endpoint: {endpoint!r}: {problem}; a transport endpoint is HOST:PORT with a valid "
            "host and a port in 1..65535, e.g. 127.0.0.1:15321"
        )
    return endpoint
