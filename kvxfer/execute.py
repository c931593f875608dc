"""Runs a program's local parts (pack and unpack cell copies) on tensors, with a chosen backend.

This is the bridge from the pure plan (numpy views) to the kernels (torch tensors); both the
in-process `reshard` and the connectors use it. A pack is a gather (cache -> dense staging),
an unpack a scatter (dense staging -> cache).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Literal, cast

import numpy as np
import torch

from kvxfer.kernels import (
    KVBuffer,
    StackedLayers,
    check_launchable,
    gather_kv,
    scatter_kv,
)
from kvxfer.plan.paged import PagedView
from kvxfer.plan.program import CellCopy
from kvxfer.spec import TORCH_DTYPES

Backend = Literal["torch", "triton"]
BACKENDS = ("auto", "torch", "triton")


def resolve_backend(backend: str, device: torch.device) -> Backend:
    """Turn "auto" into "triton" on CUDA and "torch" elsewhere; validate explicit names."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: unknown backend {backend!r}; use one of {list(BACKENDS)}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "triton":
        check_launchable(device)
    return cast(Backend, backend)


def kv_buffer(
    view: PagedView, tensors: Sequence[torch.Tensor], num_layers: int | None = None
) -> KVBuffer:
    """The kernels' view of a plan buffer: a cache passes its layer tensors (paged), a staging
    buffer its one flat tensor (dense: staging blocks are numbered in token order).

    `num_layers` layers are used (None: every layer given): a cache's from its view's
    `layer_offset` on, a staging buffer's from its start.
    """
    g = view.geometry
    block_ids = None
    if view.region == "staging":
        if not np.array_equal(view.block_ids, np.arange(len(view.block_ids))):
            raise ValueError("view: a staging buffer's blocks must be numbered in token order")
        (flat,) = tensors
        flat = as_dtype(flat, g.dtype)
        count = flat.numel() // g.layer_elements if num_layers is None else num_layers
        layers: Sequence[torch.Tensor] = StackedLayers(flat, count, g.shape)
    else:
        layers = _cache_layers(view, tensors, num_layers)
        block_ids = device_block_ids(view.block_ids, layers[0].device)
    return KVBuffer(
        layers,
        g.layout,
        g.kv_placement,
        g.mla,
        block_ids,
        view.token_shift,
        view.head_offset,
        g.fp8_rounding,
    )


def as_dtype(flat: torch.Tensor, dtype: str) -> torch.Tensor:
    """A flat staging tensor's memory as `dtype` (a `KVCacheSpec.dtype` name; "" keeps it):
    between two KV dtypes a staging buffer holds one side's, whatever the tensor says."""
    wanted = TORCH_DTYPES[dtype] if dtype else flat.dtype
    if flat.dtype == wanted:
        return flat
    if flat.numel() * flat.element_size() % wanted.itemsize:
        raise ValueError(
            f"staging: {flat.numel() * flat.element_size()} bytes do not hold whole {dtype} "
            "elements; size staging in whole elements of both dtypes"
        )
    return flat.view(torch.uint8).view(wanted)


_SCALES: dict[tuple[bytes, torch.device], torch.Tensor] = {}
_SCALES_MAX = 256


def device_scales(scales: np.ndarray | None, device: torch.device) -> torch.Tensor | None:
    """A converting copy's scales (`CellCopy.scales`) as a float32 tensor on `device`, made
    once per set of values (a request reuses its pair's: no tensor is made per launch)."""
    if scales is None:
        return None
    key = (scales.tobytes() + bytes(str(scales.shape), "ascii"), device)
    tensor = _SCALES.get(key)
    if tensor is None:
        if len(_SCALES) >= _SCALES_MAX:
            _SCALES.clear()
        host = torch.from_numpy(np.ascontiguousarray(scales, dtype=np.float32))
        tensor = _SCALES.setdefault(key, host.to(device))
    return tensor


def _cache_layers(
    view: PagedView, tensors: Sequence[torch.Tensor], num_layers: int | None
) -> Sequence[torch.Tensor]:
    """The layer tensors a copy touches: `num_layers` from `view.layer_offset` (a route's
    layers on a pipeline stage's rank); all of them, as given, when the copy takes them all."""
    first = view.layer_offset
    count = len(tensors) - first if num_layers is None else num_layers
    if first == 0 and count == len(tensors):
        return tensors
    if first < 0 or count < 1 or first + count > len(tensors):
        raise ValueError(
            f"tensors: layers [{first}, {first + count}) of the copy are not among the "
            f"{len(tensors)} layer tensors given; pass the rank's every layer tensor"
        )
    return tensors[first : first + count]


def device_block_ids(block_ids: np.ndarray, device: torch.device) -> torch.Tensor:
    """A block table on `device`: on CUDA through pinned memory and an asynchronous copy, so
    a launch never waits for the host (the caching host allocator keeps the pinned buffer
    alive until the copy has run)."""
    host = torch.from_numpy(np.ascontiguousarray(block_ids, dtype=np.int64))
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def run_cell_copy(
    copy: CellCopy,
    src_tensors: Sequence[torch.Tensor],
    dst_tensors: Sequence[torch.Tensor],
    backend: Backend,
) -> None:
    """Execute one pack (cache -> staging) or unpack (staging -> cache), over the copy's
    layers (`CellCopy.num_layers`; a cache's from its view's `layer_offset` on)."""
    src = kv_buffer(copy.src, src_tensors, copy.num_layers)
    dst = kv_buffer(copy.dst, dst_tensors, copy.num_layers)
    op = gather_kv if src.paged else scatter_kv
    scales = device_scales(copy.scales, src.layers[0].device)
    op(src, dst, copy.token_start, copy.token_end, copy.num_heads, scales, backend=backend)


def warm_up(copy: CellCopy, dtype: torch.dtype, device: torch.device, backend: Backend) -> None:
    """Compile the kernel variant of a pack or unpack ahead of the first request.

    Runs `scratch_copy(copy)` on scratch buffers, so the caches are never touched; nothing to
    do for the torch backend.
    """
    if backend != "triton":
        return
    one, src, dst = scratch_copy(copy, dtype, device)
    run_cell_copy(one, src, dst, backend)


def scratch_copy(
    copy: CellCopy, dtype: torch.dtype, device: torch.device
) -> tuple[CellCopy, list[torch.Tensor], list[torch.Tensor]]:
    """The same copy for one token and one layer (layer 0 of each buffer), on fresh buffers of
    the same geometry.

    It compiles the variant every request of `copy`'s geometry uses: the kernel's variants
    depend on the layouts, block sizes, head counts and widths and on alignment (fresh
    buffers are aligned, as caches and staging are), never on token ranges, block ids,
    strides or addresses (tests/kernels/test_kernel_variants.py compares Triton's keys).
    """
    scales = None if copy.scales is None else copy.scales[:1]
    one = CellCopy(
        _scratch_view(copy.src),
        _scratch_view(copy.dst),
        copy.num_heads,
        copy.token_start,
        copy.token_start + 1,
        num_layers=1,
        scales=scales,
    )
    return one, _scratch_tensors(one.src, dtype, device), _scratch_tensors(one.dst, dtype, device)


def _scratch_view(view: PagedView) -> PagedView:
    """The same buffer geometry with room for exactly one block of one layer."""
    g = view.geometry
    blocks = max(1, len(view.block_ids)) if view.region == "staging" else 1
    geometry = replace(g, num_blocks=blocks)
    ids = np.arange(blocks) if view.region == "staging" else np.zeros_like(view.block_ids)
    return replace(view, geometry=geometry, block_ids=ids, layer_offset=0)


def _scratch_tensors(
    view: PagedView, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    g = view.geometry
    dtype = TORCH_DTYPES[g.dtype] if g.dtype else dtype  # the view's own, between two dtypes
    if view.region == "staging":
        return [torch.zeros(g.layer_elements, dtype=dtype, device=device)]
    return [torch.zeros(g.shape, dtype=dtype, device=device)]
