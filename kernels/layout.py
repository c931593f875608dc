"""Canonical views of paged KV tensors, shared by the torch implementations and the launchers."""

from __future__ import annotations

import torch


def canonical_kv_view(
    tensor: torch.Tensor, layout: str, kv_placement: str, mla: bool
) -> torch.Tensor:
    """View one layer's tensor as `[plane, block, slot, head, head_dim]`, without copying.

    Args:
        tensor: a layer tensor in the layout contract's shape.
        layout: "NHD" or "HND" (ignored when `mla`).
        kv_placement: "kv_first" or "blocks_first" (ignored when `mla`).
        mla: `tensor` is `[block, slot, head_dim]`; it gets a plane and a head axis of size 1.
    """
    if mla:
        if tensor.dim() != 3:
            raise ValueError(f"tensor: an MLA layer is 3-D, got shape {tuple(tensor.shape)}")
        return tensor.unsqueeze(0).unsqueeze(3)
    if tensor.dim() != 5:
        raise ValueError(f"tensor: a K/V layer is 5-D, got shape {tuple(tensor.shape)}")
    plane, block = (0, 1) if kv_placement == "kv_first" else (1, 0)
    slot, head = (2, 3) if layout == "NHD" else (3, 2)
    return tensor.permute(plane, block, slot, head, 4)
