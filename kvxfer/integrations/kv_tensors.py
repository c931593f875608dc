"""Read a serving engine's per-layer KV cache tensors as kvxfer's layout contract.

Engines hand connectors one tensor per attention layer in the attention backend's *logical*
shape and apply the backend's preferred memory order through strides (vLLM allocates the
physical order and permutes it to the logical shape). kvxfer needs the *physical* order, so it
is read from the strides, never assumed: any layout on either side is accepted, which is what
lets a prefill engine on one backend feed a decode engine on another.

Logical shapes understood (vLLM's attention backends):
    `[2, num_blocks, block_size, heads, head_dim]`   K/V first (FlashAttention)
    `[num_blocks, 2, block_size, heads, head_dim]`   blocks first (FlashInfer, Triton)
    `[num_blocks, block_size, head_dim]`             MLA latent cache
Physical orders accepted: K/V or blocks outermost, then (slot, head) or (head, slot), then the
head's elements contiguous: the four non-MLA layouts of DESIGN.md's table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvxfer.spec import KVCacheSpec

# Axis roles of a 5-D cache tensor.
_KV, _BLOCK, _SLOT, _HEAD, _DIM = "kv", "block", "slot", "head", "dim"
_PHYSICAL_ORDERS: dict[tuple[str, ...], tuple[str, str]] = {
    (_KV, _BLOCK, _SLOT, _HEAD, _DIM): ("NHD", "kv_first"),
    (_KV, _BLOCK, _HEAD, _SLOT, _DIM): ("HND", "kv_first"),
    (_BLOCK, _KV, _SLOT, _HEAD, _DIM): ("NHD", "blocks_first"),
    (_BLOCK, _KV, _HEAD, _SLOT, _DIM): ("HND", "blocks_first"),
}
_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


@dataclass(frozen=True)
class EngineGeometry:
    """What the engine's configuration says about one rank's caches.

    Attributes:
        total_kv_heads: KV heads of the whole model (1 for MLA).
        head_dim: elements per head (the latent width for MLA).
        block_size: tokens per block.
        tp_size, tp_rank: this rank's tensor-parallel place.
        mla: whether the model uses a latent (MLA) cache.
    """

    total_kv_heads: int
    head_dim: int
    block_size: int
    tp_size: int
    tp_rank: int
    mla: bool = False


def physical_layer(tensor: torch.Tensor, geometry: EngineGeometry) -> tuple[torch.Tensor, str, str]:
    """The layer tensor viewed in its physical order, with its (layout, kv_placement).

    Raises:
        ValueError: a shape or memory order that is not one of the module's layouts, naming
            what was found and what was expected.
    """
    if geometry.mla:
        if tensor.dim() != 3 or tensor.shape[1:] != (geometry.block_size, geometry.head_dim):
            raise ValueError(
                f"MLA cache tensor has shape {tuple(tensor.shape)}; expected [num_blocks, "
                f"{geometry.block_size}, {geometry.head_dim}] (block_size, latent width)"
            )
        return _contiguous_or_fail(tensor, "MLA cache tensor"), "NHD", "kv_first"
    if tensor.dim() != 5:
        raise ValueError(
            f"cache tensor has {tensor.dim()} dims (shape {tuple(tensor.shape)}); expected a 5-D "
            "[2, blocks, block_size, heads, head_dim] or [blocks, 2, ...] attention cache"
        )
    roles = _logical_roles(tensor, geometry)
    # Physical order: outermost axis first. Ties (size-1 axes) keep the logical order.
    strides = tensor.stride()
    order = sorted(range(5), key=lambda axis: (-strides[axis], axis))
    physical = tuple(roles[axis] for axis in order)
    found = _PHYSICAL_ORDERS.get(physical)
    if found is None:
        raise ValueError(
            f"cache tensor's memory order is {physical} (strides {tensor.stride()}); kvxfer "
            f"reads {sorted(_PHYSICAL_ORDERS)}: K/V or blocks outermost, head elements innermost"
        )
    return _contiguous_or_fail(tensor.permute(order), "cache tensor"), *found


def _logical_roles(tensor: torch.Tensor, geometry: EngineGeometry) -> list[str]:
    heads = max(1, geometry.total_kv_heads // geometry.tp_size)
    tail = (geometry.block_size, heads, geometry.head_dim)
    if tuple(tensor.shape[2:]) != tail:
        raise ValueError(
            f"cache tensor has shape {tuple(tensor.shape)}; its last three axes should be "
            f"(block_size, heads per rank, head_dim) = {tail}; check block_size and the "
            "tensor-parallel size the connector was configured with"
        )
    if tensor.shape[0] == 2:
        return [_KV, _BLOCK, _SLOT, _HEAD, _DIM]
    if tensor.shape[1] == 2:
        return [_BLOCK, _KV, _SLOT, _HEAD, _DIM]
    raise ValueError(
        f"cache tensor has shape {tuple(tensor.shape)}; no K/V axis of size 2 among the first "
        "two axes"
    )


def _contiguous_or_fail(tensor: torch.Tensor, what: str) -> torch.Tensor:
    if not tensor.is_contiguous():
        raise ValueError(
            f"{what} is not dense in its physical order (shape {tuple(tensor.shape)}, strides "
            f"{tensor.stride()}); kvxfer registers each layer as one memory region"
        )
    return tensor


def spec_from_layers(
    layers: Sequence[torch.Tensor], geometry: EngineGeometry
) -> tuple[KVCacheSpec, list[torch.Tensor]]:
    """The `KVCacheSpec` of one rank and its layer tensors in the spec's shape.

    Every layer must share one physical layout, dtype and block count: a rank has one spec.

    Raises:
        ValueError: no layers, mixed layouts or dtypes, or a layout kvxfer cannot read.
    """
    if not layers:
        raise ValueError("no KV cache tensors were registered; pass one per attention layer")
    views, layouts = [], []
    for tensor in layers:
        view, layout, placement = physical_layer(tensor, geometry)
        views.append(view)
        layouts.append((layout, placement, view.dtype, tuple(view.shape)))
    if len(set(layouts)) != 1:
        raise ValueError(
            f"layers differ in layout, dtype or shape: {sorted(set(map(str, layouts)))}; "
            "kvxfer needs one geometry per rank (one KV cache group)"
        )
    layout, placement, dtype, _ = layouts[0]
    if dtype not in _DTYPE_NAMES:
        raise ValueError(
            f"cache dtype {dtype} is not supported; use one of {sorted(_DTYPE_NAMES.values())}"
        )
    first = views[0]
    num_blocks = first.shape[0] if geometry.mla or placement == "blocks_first" else first.shape[1]
    spec = KVCacheSpec(
        num_layers=len(views),
        num_kv_heads=1 if geometry.mla else geometry.total_kv_heads,
        head_dim=geometry.head_dim,
        dtype=_DTYPE_NAMES[dtype],  # type: ignore[arg-type]
        tp_size=geometry.tp_size,
        tp_rank=geometry.tp_rank,
        block_size=geometry.block_size,
        num_blocks=int(num_blocks),
        layout=layout,  # type: ignore[arg-type]
        kv_placement=placement,  # type: ignore[arg-type]
        mla=geometry.mla,
    )
    return spec, views
