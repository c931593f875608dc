"""How the kernels see a KV buffer: per-layer tensors, their layout and their block table."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def canonical_kv_view(
    tensor: torch.Tensor, layout: str, kv_placement: str, mla: bool
) -> torch.Tensor:
    """View one layer's tensor as `[plane, block, slot, head, head_dim]`, without copying.

    Args:
        tensor: a layer tensor in the layout contract's shape.
        layout: "NHD" or "HND" (ignored when `mla`).
        kv_placement: "kv_first", "blocks_first" or "kv_inner" (ignored when `mla`).
        mla: `tensor` is `[block, slot, head_dim]`; it gets a plane and a head axis of size 1.
    """
    if mla:
        if tensor.dim() != 3:
            raise ValueError(f"tensor: an MLA layer is 3-D, got shape {tuple(tensor.shape)}")
        return tensor.unsqueeze(0).unsqueeze(3)
    if kv_placement == "kv_inner":  # [block, slot|head, head|slot, 2 * head_dim]
        if tensor.dim() != 4 or tensor.shape[3] % 2:
            raise ValueError(
                f"tensor: a kv_inner layer is 4-D with an even last axis, got {tuple(tensor.shape)}"
            )
        rows = tensor.unflatten(3, (2, tensor.shape[3] // 2))
        return rows.permute(3, 0, 1, 2, 4) if layout == "NHD" else rows.permute(3, 0, 2, 1, 4)
    if tensor.dim() != 5:
        raise ValueError(f"tensor: a K/V layer is 5-D, got shape {tuple(tensor.shape)}")
    plane, block = (0, 1) if kv_placement == "kv_first" else (1, 0)
    slot, head = (2, 3) if layout == "NHD" else (3, 2)
    return tensor.permute(plane, block, slot, head, 4)


@dataclass(frozen=True)
class KVBuffer:
    """One side of a cell copy: every layer of a paged KV buffer and how to find a token in it.

    Token `t` sits at position `p = t - token_shift`, in block `block_ids[p // block_size]` (a
    paged buffer: a cache) or block `p // block_size` (a dense buffer: staging, `block_ids` is
    None), at slot `p % block_size`. Heads `[head_offset, head_offset + n)` are the moved ones.

    Attributes:
        layers: one tensor per layer in the layout contract's shape; all share shape and dtype.
        layout: "NHD" or "HND".
        kv_placement: "kv_first", "blocks_first" or "kv_inner".
        mla: layers are `[blocks, slots, head_dim]` latent planes.
        block_ids: int64 tensor on the layers' device, or None for a dense buffer.
        token_shift: token at position 0.
        head_offset: index of the first moved head among the buffer's heads.
    """

    layers: Sequence[torch.Tensor]
    layout: str = "NHD"
    kv_placement: str = "kv_first"
    mla: bool = False
    block_ids: torch.Tensor | None = None
    token_shift: int = 0
    head_offset: int = 0

    def canonical_layers(self) -> list[torch.Tensor]:
        """Every layer as `[plane, block, slot, head, head_dim]`."""
        return [canonical_kv_view(t, self.layout, self.kv_placement, self.mla) for t in self.layers]

    @property
    def paged(self) -> bool:
        """Whether tokens are found through a block table."""
        return self.block_ids is not None

    @property
    def canonical_shape(self) -> tuple[int, int, int, int, int]:
        """(planes, blocks, block_size, heads, head_dim)."""
        p, b, s, h, d = canonical_kv_view(
            self.layers[0], self.layout, self.kv_placement, self.mla
        ).shape
        return p, b, s, h, d

    def token_cells(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, slot) of each token."""
        block_size = self.canonical_shape[2]
        pos = tokens - self.token_shift
        logical = torch.div(pos, block_size, rounding_mode="floor")
        block = logical if self.block_ids is None else self.block_ids[logical]
        return block, pos - logical * block_size


def wire_kv_buffer(wire: torch.Tensor, token_start: int, mla: bool = False) -> KVBuffer:
    """The compact wire layout `[layers, 2, tokens, heads, head_dim]` (MLA:
    `[layers, tokens, head_dim]`) holding tokens from `token_start`, as a dense `KVBuffer`."""
    if mla:
        layers = [t.unsqueeze(0) for t in wire.unbind(0)]  # one block of `tokens` slots
    else:
        layers = [t.unsqueeze(1) for t in wire.unbind(0)]  # [2, 1, tokens, heads, head_dim]
    return KVBuffer(layers, "NHD", "kv_first", mla, None, token_start, 0)


def check_cell_copy(
    src: KVBuffer, dst: KVBuffer, token_start: int, token_end: int, num_heads: int
) -> None:
    """Validate the two sides of a cell copy.

    Raises:
        ValueError: naming the argument at fault.
    """
    if not src.layers or len(src.layers) != len(dst.layers):
        raise ValueError(
            f"dst: {len(dst.layers)} layers, src: {len(src.layers)}; pass the same, at least one"
        )
    for name, buf in (("src", src), ("dst", dst)):
        first = buf.layers[0]
        for i, t in enumerate(buf.layers):
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise ValueError(f"{name}.layers[{i}]: shape, dtype and device must match layer 0")
        if buf.block_ids is not None and buf.block_ids.dtype != torch.int64:
            raise ValueError(f"{name}.block_ids: must be int64, got {buf.block_ids.dtype}")
    if src.layers[0].dtype != dst.layers[0].dtype:
        raise ValueError(f"dst: dtype {dst.layers[0].dtype} differs from src {src.layers[0].dtype}")
    if src.layers[0].device != dst.layers[0].device:
        raise ValueError("dst: must live on the same device as src")
    sp, _, _, sh, sd = src.canonical_shape
    dp, _, _, dh, dd = dst.canonical_shape
    if (sp, sd) != (dp, dd):
        raise ValueError(
            f"dst: planes x head_dim {dp}x{dd} differ from src {sp}x{sd}; "
            "both sides must be K/V or both MLA, with one head_dim"
        )
    for name, heads, offset in (("src", sh, src.head_offset), ("dst", dh, dst.head_offset)):
        if offset < 0 or offset + num_heads > heads:
            raise ValueError(
                f"{name}.head_offset: heads [{offset}, {offset + num_heads}) exceed the "
                f"buffer's {heads} heads"
            )
    if not 0 <= token_start < token_end:
        raise ValueError(f"token range [{token_start}, {token_end}) is empty or negative")
