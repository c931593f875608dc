"""Runs a program's local parts (pack and unpack cell copies) on tensors, with a chosen backend.

This is the bridge from the pure plan (numpy views) to the kernels (torch tensors); both the
in-process `reshard` and the connectors use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, cast

import numpy as np
import torch

from kvxfer.kernels import canonical_kv_view, remap_kv_torch
from kvxfer.plan.layout import PagedView
from kvxfer.plan.program import CellCopy

Backend = Literal["torch", "triton"]
BACKENDS = ("auto", "torch", "triton")


def resolve_backend(backend: str, device: torch.device) -> Backend:
    """Turn "auto" into "triton" on CUDA and "torch" elsewhere; validate explicit names."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: unknown backend {backend!r}; use one of {list(BACKENDS)}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "triton":
        raise NotImplementedError(
            "backend='triton': the Triton gather/scatter kernels are not built yet; "
            "use backend='torch'"
        )
    return cast(Backend, backend)


def layer_views(view: PagedView, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Canonical `[plane, block, slot, head, head_dim]` views of every layer of a buffer.

    A cache passes its layer tensors; a staging buffer passes its one flat tensor.
    """
    g = view.geometry
    if view.region == "staging":
        (flat,) = tensors
        n = g.layer_elements
        layers = [flat[i * n : (i + 1) * n].view(g.shape) for i in range(flat.numel() // n)]
    else:
        layers = list(tensors)
    return [canonical_kv_view(t, g.layout, g.kv_placement, g.mla) for t in layers]


def run_cell_copy(
    copy: CellCopy,
    src_tensors: Sequence[torch.Tensor],
    dst_tensors: Sequence[torch.Tensor],
    backend: Backend,
) -> None:
    """Execute one pack or unpack: copy the moved cells from `copy.src` to `copy.dst`."""
    if backend != "torch":
        raise NotImplementedError(f"backend={backend!r}: only the torch backend runs cell copies")
    device = src_tensors[0].device
    tokens = np.arange(copy.token_start, copy.token_end, dtype=np.int64)
    src_blocks, src_slots = (torch.from_numpy(a).to(device) for a in copy.src.token_cells(tokens))
    dst_blocks, dst_slots = (torch.from_numpy(a).to(device) for a in copy.dst.token_cells(tokens))
    remap_kv_torch(
        layer_views(copy.src, src_tensors),
        src_blocks,
        src_slots,
        copy.src.head_offset,
        layer_views(copy.dst, dst_tensors),
        dst_blocks,
        dst_slots,
        copy.dst.head_offset,
        copy.num_heads,
    )
