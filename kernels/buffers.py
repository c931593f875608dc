"""How the kernels see a KV buffer: per-layer tensors, their layout and their block table."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import overload

import torch

from kvxfer.kernels.convert import check_conversion
from kvxfer.layout import canonical_shape, canonical_view, is_cpu_placement


def canonical_kv_view(
    tensor: torch.Tensor, layout: str, kv_placement: str, mla: bool
) -> torch.Tensor:
    """View one layer's tensor as `[plane, block, slot, head, head_dim]`, without copying.

    The layout contract's own view (`kvxfer.layout.canonical_view`), under the kernels' name.

    Args:
        tensor: a layer tensor in the layout contract's shape.
        layout: "NHD" or "HND" (ignored when `mla`).
        kv_placement: "kv_first", "blocks_first" or "kv_inner" (ignored when `mla`).
        mla: `tensor` is `[block, slot, head_dim]`; it gets a plane and a head axis of size 1
            (stride 0).

    Raises:
        ValueError: `tensor` does not have the layout's number of axes.
    """
    return canonical_view(tensor, layout, kv_placement, mla)


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
        fp8_rounding: how values converted into this (fp8) buffer are rounded
            (`KVCacheSpec.fp8_rounding`): "nearest_even", "toward_zero" (torch backend only)
            or "torch_cast" (`kvxfer.kernels.convert`'s docstring).
    """

    layers: Sequence[torch.Tensor]
    layout: str = "NHD"
    kv_placement: str = "kv_first"
    mla: bool = False
    block_ids: torch.Tensor | None = None
    token_shift: int = 0
    head_offset: int = 0
    fp8_rounding: str = "nearest_even"

    def canonical_layers(self) -> list[torch.Tensor]:
        """Every layer as `[plane, block, slot, head, head_dim]` (not for CPU attention's,
        which has a view per plane: `kvxfer.layout.plane_views`)."""
        return [canonical_kv_view(t, self.layout, self.kv_placement, self.mla) for t in self.layers]

    @property
    def paged(self) -> bool:
        """Whether tokens are found through a block table."""
        return self.block_ids is not None

    @functools.cached_property  # asked several times per copy; the layers never change
    def canonical_shape(self) -> tuple[int, int, int, int, int]:
        """(planes, blocks, block_size, heads, head_dim)."""
        return canonical_shape(self.layers[0], self.layout, self.kv_placement, self.mla)

    @property
    def cpu_placement(self) -> bool:
        """Whether the layers are in one of vLLM CPU attention's placements, `k_transposed` or
        `amx_tiles` (torch only, element by element)."""
        return is_cpu_placement(self.kv_placement, self.mla)

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
    # MLA: one block of `tokens` slots; K/V: [2, 1, tokens, heads, head_dim]
    layer_shape = (1, *wire.shape[1:]) if mla else (wire.shape[1], 1, *wire.shape[2:])
    layers = StackedLayers(wire.reshape(-1), wire.shape[0], layer_shape)
    return KVBuffer(layers, "NHD", "kv_first", mla, None, token_start, 0)


class StackedLayers(Sequence[torch.Tensor]):
    """Layers stored back to back in one flat tensor (a staging buffer), as a sequence of views.

    Views are made only when asked for: the Triton launcher reads `flat` and `layer_elements`
    instead, so a staging buffer of 64 layers costs no per-layer host work per launch.
    """

    def __init__(self, flat: torch.Tensor, num_layers: int, layer_shape: Sequence[int]) -> None:
        elements = 1
        for n in layer_shape:
            elements *= n
        if flat.dim() != 1 or not flat.is_contiguous():
            raise ValueError(f"flat: must be a contiguous 1-D tensor, got {tuple(flat.shape)}")
        if num_layers < 1 or flat.numel() < num_layers * elements:
            raise ValueError(
                f"flat: {flat.numel()} elements cannot hold {num_layers} layers of "
                f"{tuple(layer_shape)}; pass a larger buffer or fewer layers"
            )
        self.flat = flat
        self.num_layers = num_layers
        self.layer_shape = tuple(layer_shape)
        self.layer_elements = elements

    def __len__(self) -> int:
        return self.num_layers

    @overload
    def __getitem__(self, index: int) -> torch.Tensor: ...
    @overload
    def __getitem__(self, index: slice) -> list[torch.Tensor]: ...
    def __getitem__(self, index: int | slice) -> torch.Tensor | list[torch.Tensor]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self.num_layers))]
        if not -self.num_layers <= index < self.num_layers:
            raise IndexError(f"layer {index} out of range for {self.num_layers} layers")
        i = index % self.num_layers
        n = self.layer_elements
        return self.flat[i * n : (i + 1) * n].view(self.layer_shape)


def check_layers(name: str, buf: KVBuffer) -> None:
    """Validate one side's layers: at least one, all of one shape, dtype and device (O(layers);
    the Triton launcher runs it once per set of layer tensors, not per launch).

    Raises:
        ValueError: naming the argument at fault.
    """
    if not buf.layers:
        raise ValueError(f"{name}.layers: empty; pass at least one layer")
    if isinstance(buf.layers, StackedLayers):
        return  # one flat tensor: uniform by construction
    first = buf.layers[0]
    for i, t in enumerate(buf.layers):
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            raise ValueError(f"{name}.layers[{i}]: shape, dtype and device must match layer 0")


def check_copy_pair(
    src: KVBuffer,
    dst: KVBuffer,
    src_shape: tuple[int, ...],
    dst_shape: tuple[int, ...],
    token_start: int,
    token_end: int,
    num_heads: int,
    scales: torch.Tensor | None = None,
) -> None:
    """Validate what the two sides must agree on, from their first layers only (O(1)).

    `src_shape` and `dst_shape` are the sides' `canonical_shape` (the caller has them). Two
    dtypes convert (`kvxfer.kernels.convert.check_conversion`, with `scales`).

    Raises:
        ValueError: naming the argument at fault.
    """
    if not src.layers or len(src.layers) != len(dst.layers):
        raise ValueError(
            f"dst: {len(dst.layers)} layers, src: {len(src.layers)}; pass the same, at least one"
        )
    for name, buf in (("src", src), ("dst", dst)):
        if buf.block_ids is not None and buf.block_ids.dtype != torch.int64:
            raise ValueError(f"{name}.block_ids: must be int64, got {buf.block_ids.dtype}")
    first_src, first_dst = src.layers[0], dst.layers[0]
    check_conversion(first_src.dtype, first_dst.dtype, scales, len(src.layers), src_shape[0])
    if scales is not None and scales.device != first_src.device:
        raise ValueError(f"scales: on {scales.device}; move them to the caches' {first_src.device}")
    if first_src.device != first_dst.device:
        raise ValueError("dst: must live on the same device as src")
    sp, _, _, sh, sd = src_shape
    dp, _, _, dh, dd = dst_shape
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
