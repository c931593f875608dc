"""The cell-copy kernel as it was before the rewrite of issue 13: a baseline for
benchmarks/gpu_kernels.py only, never used by kvxfer.

The Triton kernel (`_copy_cells_kernel` and its helper) and `tile_sizes` are verbatim from
`kernels/copy_cells.py` at commit c8c5817 (`git show c8c5817:kernels/copy_cells.py`): one
program per (token tile, layer, plane, head), each moving a tile of one head's rows. Its
launcher is split in two so that the benchmark can time the launch alone, as it does for the
new kernel's `prepare_cell_copy`: `prepare_copy_cells` does the host work of the old launcher
(validation, layer offsets, strides) once, `PreviousCellCopy.launch` only launches, and
`copy_cells` does both, as the old public call did on every call.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from kvxfer.kernels import KVBuffer, canonical_kv_view, check_cell_copy

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
_INTERPRETER_LOCK = threading.Lock()
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# CUDA limits grid axis 1 to 65535 programs; axis 1 walks (layer, plane, head).
_MAX_GRID_Y = 65535


@triton.jit
def _cell_row_offsets(
    tokens,  # [BLOCK_T] int64
    token_mask,  # [BLOCK_T] bool
    layer,
    plane,
    head,
    layer_offsets_ptr,  # [layers] int64: element offset of each layer from the base pointer
    block_ids_ptr,  # [logical blocks] int64, read only when PAGED
    token_shift,
    block_size,
    plane_stride,
    block_stride,
    slot_stride,
    head_stride,
    head_offset,
    PAGED: tl.constexpr,
):
    """Element offset of the first element of each token's cell."""
    pos = tokens - token_shift
    logical = pos // block_size
    slot = pos - logical * block_size
    if PAGED:  # noqa: SIM108 (a constexpr branch: the other side is never compiled)
        block = tl.load(block_ids_ptr + logical, mask=token_mask, other=0)
    else:
        block = logical
    base = tl.load(layer_offsets_ptr + layer)
    return (
        base
        + plane * plane_stride
        + block * block_stride
        + slot * slot_stride
        + (head_offset + head) * head_stride
    )


@triton.jit
def _copy_cells_kernel(
    src_ptr,  # layer 0 of the source, [planes, blocks, slots, heads, head_dim] as int words
    src_layer_offsets_ptr,  # [layers] int64
    src_block_ids_ptr,  # [logical blocks] int64
    dst_ptr,  # layer 0 of the destination, as int words of the same width
    dst_layer_offsets_ptr,  # [layers] int64
    dst_block_ids_ptr,  # [logical blocks] int64
    token_start,
    token_end,
    src_token_shift,
    src_block_size,
    src_plane_stride,
    src_block_stride,
    src_slot_stride,
    src_head_stride,
    src_head_offset,
    dst_token_shift,
    dst_block_size,
    dst_plane_stride,
    dst_block_stride,
    dst_slot_stride,
    dst_head_stride,
    dst_head_offset,
    NUM_HEADS: tl.constexpr,  # heads moved
    NUM_PLANES: tl.constexpr,  # 2 (K, V) or 1 (MLA)
    HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,  # tokens per program
    BLOCK_D: tl.constexpr,  # next power of two of HEAD_DIM
    SRC_PAGED: tl.constexpr,
    DST_PAGED: tl.constexpr,
):
    pid_t = tl.program_id(0).to(tl.int64)
    pid_cell = tl.program_id(1).to(tl.int64)  # (layer, plane, head), head fastest
    head = pid_cell % NUM_HEADS
    plane = (pid_cell // NUM_HEADS) % NUM_PLANES
    layer = pid_cell // (NUM_HEADS * NUM_PLANES)

    tokens = token_start + pid_t * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    token_mask = tokens < token_end
    dims = tl.arange(0, BLOCK_D).to(tl.int64)
    mask = token_mask[:, None] & (dims < HEAD_DIM)[None, :]

    src_rows = _cell_row_offsets(
        tokens,
        token_mask,
        layer,
        plane,
        head,
        src_layer_offsets_ptr,
        src_block_ids_ptr,
        src_token_shift,
        src_block_size,
        src_plane_stride,
        src_block_stride,
        src_slot_stride,
        src_head_stride,
        src_head_offset,
        SRC_PAGED,
    )
    dst_rows = _cell_row_offsets(
        tokens,
        token_mask,
        layer,
        plane,
        head,
        dst_layer_offsets_ptr,
        dst_block_ids_ptr,
        dst_token_shift,
        dst_block_size,
        dst_plane_stride,
        dst_block_stride,
        dst_slot_stride,
        dst_head_stride,
        dst_head_offset,
        DST_PAGED,
    )
    cells = tl.load(src_ptr + src_rows[:, None] + dims[None, :], mask=mask)
    tl.store(dst_ptr + dst_rows[:, None] + dims[None, :], cells, mask=mask)


def tile_sizes(head_dim: int, itemsize: int) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_D): the whole head in one row, and about 4 KiB per program.

    Measured on one H200 (benchmarks/RESULTS.md, gather of 32 layers x 16k tokens, 128-wide
    bf16 heads): 16 tokens per program (4 KiB) moved 2,275 GB/s, against 2,003 at 8, 1,864 at
    32, 1,322 at 64 (the former 16 KiB default) and 526 at 128. The tile depends on the head
    and dtype only, never on the request's length, so one compiled variant serves every
    request of a rank pair.
    """
    block_d = triton.next_power_of_2(head_dim)
    block_t = max(1, min(128, 4096 // (block_d * itemsize)))
    return block_t, block_d


def _bits_and_offsets(buf: KVBuffer) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 0 as integer words, and every layer's element offset from it."""
    first = buf.layers[0]
    itemsize = first.element_size()
    offsets = []
    for i, layer in enumerate(buf.layers):
        delta = layer.data_ptr() - first.data_ptr()
        if delta % itemsize:
            raise ValueError(f"layers[{i}]: address is not aligned to its {itemsize}-byte dtype")
        offsets.append(delta // itemsize)
    bits = first.view(_BITS[itemsize])
    return bits, torch.tensor(offsets, dtype=torch.int64, device=first.device)


@dataclass(frozen=True)
class PreviousCellCopy:
    """One prepared copy: the grid and every kernel argument, computed once."""

    grid: tuple[int, int]
    kwargs: dict[str, Any]

    def launch(self) -> None:
        """Launch the kernel; nothing else happens on the host."""
        with _INTERPRETER_LOCK if INTERPRETED else contextlib.nullcontext():
            _copy_cells_kernel[self.grid](**self.kwargs)


def _canonical_first(buf: KVBuffer) -> torch.Tensor:
    return canonical_kv_view(buf.layers[0], buf.layout, buf.kv_placement, buf.mla)


def prepare_copy_cells(
    src: KVBuffer,
    dst: KVBuffer,
    token_start: int,
    token_end: int,
    num_heads: int,
    *,
    block_t: int | None = None,
) -> PreviousCellCopy:
    """The old launcher's host work for one copy (same checks, same arguments)."""
    check_cell_copy(src, dst, token_start, token_end, num_heads)
    device = src.layers[0].device
    if device.type != "cuda" and not INTERPRETED:
        raise RuntimeError(
            f"the previous kernel needs CUDA tensors or TRITON_INTERPRET=1, got {device}"
        )
    src_view, dst_view = _canonical_first(src), _canonical_first(dst)
    planes, _, _, _, head_dim = src_view.shape
    cells_per_token = len(src.layers) * planes * num_heads
    if cells_per_token > _MAX_GRID_Y:
        raise ValueError(
            f"num_heads: {len(src.layers)} layers x {planes} planes x {num_heads} heads exceeds "
            f"{_MAX_GRID_Y} programs on grid axis 1; split the copy by layers"
        )
    default_t, block_d = tile_sizes(head_dim, src_view.element_size())
    block_t = block_t or default_t
    src_bits, src_offsets = _bits_and_offsets(src)
    dst_bits, dst_offsets = _bits_and_offsets(dst)
    # A dense side reads no block table; its layer offsets stand in as a valid pointer.
    src_ids = src.block_ids if src.block_ids is not None else src_offsets
    dst_ids = dst.block_ids if dst.block_ids is not None else dst_offsets
    sp, sb, ss, sh, _ = src_view.stride()
    dp, db, ds, dh, _ = dst_view.stride()
    grid = (triton.cdiv(token_end - token_start, block_t), cells_per_token)
    kwargs = dict(
        src_ptr=src_bits,
        src_layer_offsets_ptr=src_offsets,
        src_block_ids_ptr=src_ids,
        dst_ptr=dst_bits,
        dst_layer_offsets_ptr=dst_offsets,
        dst_block_ids_ptr=dst_ids,
        token_start=token_start,
        token_end=token_end,
        src_token_shift=src.token_shift,
        src_block_size=src_view.shape[2],
        src_plane_stride=sp,
        src_block_stride=sb,
        src_slot_stride=ss,
        src_head_stride=sh,
        src_head_offset=src.head_offset,
        dst_token_shift=dst.token_shift,
        dst_block_size=dst_view.shape[2],
        dst_plane_stride=dp,
        dst_block_stride=db,
        dst_slot_stride=ds,
        dst_head_stride=dh,
        dst_head_offset=dst.head_offset,
        NUM_HEADS=num_heads,
        NUM_PLANES=planes,
        HEAD_DIM=head_dim,
        BLOCK_T=block_t,
        BLOCK_D=block_d,
        SRC_PAGED=src.paged,
        DST_PAGED=dst.paged,
    )
    return PreviousCellCopy(grid, kwargs)


def copy_cells(
    src: KVBuffer,
    dst: KVBuffer,
    token_start: int,
    token_end: int,
    num_heads: int,
    *,
    block_t: int | None = None,
) -> None:
    """The old public call: prepare and launch, every call."""
    prepare_copy_cells(src, dst, token_start, token_end, num_heads, block_t=block_t).launch()
