"""Triton kernel: copy (layer, plane, token, head) cells between two paged KV buffers.

One launch covers every layer of a request. A program owns one tile of tokens of one (layer,
plane) and moves every head the copy moves, as rows of contiguous words; its tile never
straddles a block on either side, so each side costs it one block-id load and one scalar
address computation (int64), and the per-element work is int32 offsets from that address.
How the design follows the best paged-KV copy kernels is in docs/design.md ("JIT and the kernels").

Layers are reached through a per-layer address table (a device tensor built once per set of
layer tensors, then cached) or, for a staging buffer (`StackedLayers`), a base pointer and a
layer stride (`kvxfer.kernels.layer_sets`). Elements move as integer words: bit-exact for every
dtype, fp8 included, with no float arithmetic (the interpreter has none for bf16). A copy
between two dtypes (bf16 into an fp8 cache, and back) loads each element as its own word and
converts it on the way (`kvxfer.kernels.convert`: vLLM's arithmetic, on integer bits). When the
host has checked that every address, stride and row is 16-byte aligned, the kernel copies 4-byte
words and says so to the compiler (`tl.multiple_of` on the final pointers), which then emits
16-byte loads and stores; otherwise a narrower variant copies the widest word that divides
everything.

Every runtime integer is excluded from Triton's specialization (`do_not_specialize`, and
pointers from alignment specialization), so one compiled variant per geometry serves every
request: the warm-up at handshake compiles exactly what requests use.

gather_kv, scatter_kv and remap_kv are this kernel specialized on which side is paged. The
launch's choices (word width, tile, warps) are `cell_copy_flags.py`'s; `prepare_cell_copy`
checks a copy, takes those choices and turns them into the kernel's arguments.
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

from kvxfer.kernels.buffers import (
    KVBuffer,
    check_copy_pair,
)
from kvxfer.kernels.cell_copy_flags import (
    SideGeometry,
    Tiling,
    choose_tiling,
    copy_words,
)
from kvxfer.kernels.convert import KIND_NONE, KINDS, SCALE_DIVIDE, scale_mode
from kvxfer.kernels.convert import from_float32 as _from_float32
from kvxfer.kernels.convert import quantize_torch_cast_triton as _quantize_torch_cast
from kvxfer.kernels.convert import to_float32 as _to_float32
from kvxfer.kernels.layer_sets import LayerSet, layer_set, with_words

# The interpreter is chosen when `triton.jit` decorates, i.e. when this module is imported.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
# The interpreter patches triton.language globally while a kernel runs, so two interpreted
# launches from different threads break each other ("_semantic argument must be provided");
# compiled kernels have no such limit.
_INTERPRETER_LOCK = threading.Lock()
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# CUDA limits grid axis 1 to 65535 programs; axis 1 walks (layer, plane).
_MAX_GRID_Y = 65535
_INT32_MAX = 2**31 - 1

# Runtime integers that vary per request (or per staging slot, or per set of caches): none of
# them may pick a compiled variant (see the module docstring). They are also typed `tl.int64`
# in the signature, or Triton would type each by its value's range (i32 or i64).
_RUNTIME_INTS = [
    "tile_origin",
    "token_start",
    "token_end",
    "src_layer_stride",
    "src_token_shift",
    "src_plane_stride",
    "src_block_stride",
    "src_slot_stride",
    "src_head_stride",
    "src_head_offset",
    "dst_layer_stride",
    "dst_token_shift",
    "dst_plane_stride",
    "dst_block_stride",
    "dst_slot_stride",
    "dst_head_stride",
    "dst_head_offset",
]
_POINTERS = [
    "src_ptr",
    "src_layers_ptr",
    "src_block_ids_ptr",
    "dst_ptr",
    "dst_layers_ptr",
    "dst_block_ids_ptr",
    "scales_ptr",
]


@triton.jit
def _tile_base(
    ptr,  # words of layer 0 (table mode: only its element type is used)
    layers_ptr,  # [layers] int64 byte addresses, read when TABLE
    block_ids_ptr,  # [logical blocks] int64, read when PAGED
    layer,
    plane,
    tile_first,  # first token of the tile (int64)
    layer_stride,
    token_shift,
    plane_stride,
    block_stride,
    slot_stride,
    head_stride,
    head_offset,
    BLOCK_SIZE: tl.constexpr,  # tokens per block; 0 when positions map linearly to slots
    PAGED: tl.constexpr,
    TABLE: tl.constexpr,
):
    """Pointer to the first moved word of the tile's first token (scalar int64 math only)."""
    pos = tile_first - token_shift
    if BLOCK_SIZE > 0:
        logical = pos // BLOCK_SIZE  # a constant divisor: shifts or a multiply, never div.s64
        slot = pos - logical * BLOCK_SIZE
    else:
        logical = pos * 0
        slot = pos
    if PAGED:  # noqa: SIM108 (a constexpr branch: the other side is never compiled)
        block = tl.load(block_ids_ptr + logical)
    else:
        block = logical
    offset = plane * plane_stride + block * block_stride + slot * slot_stride
    offset += head_offset * head_stride
    if TABLE:
        base = tl.load(layers_ptr + layer).to(tl.pointer_type(ptr.dtype.element_ty))
    else:
        base = ptr + layer * layer_stride
    return base + offset


@triton.jit(do_not_specialize=_RUNTIME_INTS, do_not_specialize_on_alignment=_POINTERS)
def _copy_cells_kernel(
    src_ptr,  # staging: [layers * layer_elements] words; table mode: layer 0's words
    src_layers_ptr,  # [layers] int64 byte address of each source layer (table mode)
    src_block_ids_ptr,  # [logical blocks] int64 (paged)
    dst_ptr,  # as src_ptr, for the destination
    dst_layers_ptr,  # [layers] int64
    dst_block_ids_ptr,  # [logical blocks] int64
    scales_ptr,  # [layers, planes] float32: the fp8 side's scales (SCALE_MODE > 0)
    tile_origin: tl.int64,  # first token of tile 0: token_start rounded down to BLOCK_T
    token_start: tl.int64,
    token_end: tl.int64,
    src_layer_stride: tl.int64,  # words between layers (stacked mode)
    src_token_shift: tl.int64,
    src_plane_stride: tl.int64,  # words
    src_block_stride: tl.int64,
    src_slot_stride: tl.int64,
    src_head_stride: tl.int64,
    src_head_offset: tl.int64,
    dst_layer_stride: tl.int64,
    dst_token_shift: tl.int64,
    dst_plane_stride: tl.int64,
    dst_block_stride: tl.int64,
    dst_slot_stride: tl.int64,
    dst_head_stride: tl.int64,
    dst_head_offset: tl.int64,
    NUM_PLANES: tl.constexpr,  # 2 (K, V) or 1 (MLA)
    NUM_HEADS: tl.constexpr,  # heads moved
    BLOCK_H: tl.constexpr,  # next power of two of NUM_HEADS
    HEAD_WORDS: tl.constexpr,  # words per head
    BLOCK_W: tl.constexpr,  # next power of two of HEAD_WORDS
    BLOCK_T: tl.constexpr,  # tokens per program; divides every BLOCK_SIZE > 0
    SRC_BLOCK_SIZE: tl.constexpr,
    DST_BLOCK_SIZE: tl.constexpr,
    SRC_PAGED: tl.constexpr,
    DST_PAGED: tl.constexpr,
    SRC_TABLE: tl.constexpr,
    DST_TABLE: tl.constexpr,
    ALIGNED: tl.constexpr,  # every row start is 16-byte aligned (checked by the host)
    SRC_KIND: tl.constexpr = 0,  # the dtypes (convert.KINDS) of a converting copy; 0: words
    DST_KIND: tl.constexpr = 0,
    SCALE_MODE: tl.constexpr = 0,  # 1: divide by the scale (quantize), 2: multiply
    TORCH_CAST: tl.constexpr = False,  # quantize as SGLang's write (convert.py's docstring)
):
    pid_t = tl.program_id(0).to(tl.int64)
    pid_lp = tl.program_id(1).to(tl.int64)  # (layer, plane), plane fastest
    layer = pid_lp // NUM_PLANES
    plane = pid_lp % NUM_PLANES
    tile_first = tile_origin + pid_t * BLOCK_T

    src_base = _tile_base(
        src_ptr,
        src_layers_ptr,
        src_block_ids_ptr,
        layer,
        plane,
        tile_first,
        src_layer_stride,
        src_token_shift,
        src_plane_stride,
        src_block_stride,
        src_slot_stride,
        src_head_stride,
        src_head_offset,
        SRC_BLOCK_SIZE,
        SRC_PAGED,
        SRC_TABLE,
    )
    dst_base = _tile_base(
        dst_ptr,
        dst_layers_ptr,
        dst_block_ids_ptr,
        layer,
        plane,
        tile_first,
        dst_layer_stride,
        dst_token_shift,
        dst_plane_stride,
        dst_block_stride,
        dst_slot_stride,
        dst_head_stride,
        dst_head_offset,
        DST_BLOCK_SIZE,
        DST_PAGED,
        DST_TABLE,
    )

    # Offsets inside the tile fit int32 (checked by the host): the only per-element math.
    t = tl.arange(0, BLOCK_T)[:, None, None]
    h = tl.arange(0, BLOCK_H)[None, :, None]
    w = tl.arange(0, BLOCK_W)[None, None, :]
    src_off = t * src_slot_stride.to(tl.int32) + h * src_head_stride.to(tl.int32) + w
    dst_off = t * dst_slot_stride.to(tl.int32) + h * dst_head_stride.to(tl.int32) + w
    first = tl.maximum(token_start - tile_first, 0).to(tl.int32)  # the tile's moved tokens
    last = tl.minimum(token_end - tile_first, BLOCK_T).to(tl.int32)
    mask = (t >= first) & (t < last) & (h < NUM_HEADS) & (w < HEAD_WORDS)
    src_words = src_base + src_off
    dst_words = dst_base + dst_off
    if ALIGNED:
        # Rows start on 16-byte boundaries: 4 words of 4 bytes per access.
        src_words = tl.multiple_of(src_words, [1, 1, 16])
        dst_words = tl.multiple_of(dst_words, [1, 1, 16])
    cells = tl.load(src_words, mask=mask)
    if SRC_KIND != DST_KIND:
        values = _to_float32(cells, SRC_KIND)
        if TORCH_CAST:  # SGLang's cache write (quantizes: SCALE_MODE 1)
            cells = _quantize_torch_cast(values, tl.load(scales_ptr + pid_lp), SRC_KIND, DST_KIND)
        else:
            if SCALE_MODE == 1:  # vLLM's cache write: x / scale, rounded to nearest
                values = tl.math.div_rn(values, tl.load(scales_ptr + pid_lp))
            elif SCALE_MODE == 2:
                values = values * tl.load(scales_ptr + pid_lp)
            cells = _from_float32(values, DST_KIND)
    tl.store(dst_words, cells, mask=mask)


def check_launchable(device: torch.device) -> None:
    """Raise unless Triton can run on `device` (CUDA, or any device under the interpreter)."""
    if device.type != "cuda" and not INTERPRETED:
        raise RuntimeError(
            f"the Triton kernels need CUDA tensors, got {device.type}; on CPU use the torch "
            "backend, or set TRITON_INTERPRET=1 before kvxfer is imported to run the interpreter"
        )


@dataclass(frozen=True)
class CellCopyLaunch:
    """A prepared launch of the cell-copy kernel: `launch()` does nothing but launch.

    Attributes:
        grid: (token tiles, layers x planes).
        arguments: the kernel's keyword arguments, constexprs included.
        num_warps: warps per program.
    """

    grid: tuple[int, int]
    arguments: dict[str, Any]
    num_warps: int

    def launch(self) -> None:
        """Enqueue the kernel on the current CUDA stream (or run it in the interpreter)."""
        with _INTERPRETER_LOCK if INTERPRETED else contextlib.nullcontext():
            _copy_cells_kernel[self.grid](**self.arguments, num_warps=self.num_warps)


def prepare_cell_copy(
    src: KVBuffer,
    dst: KVBuffer,
    token_start: int,
    token_end: int,
    num_heads: int,
    *,
    block_t: int | None = None,
    scales: torch.Tensor | None = None,
) -> CellCopyLaunch:
    """Validate a cell copy and compute its launch, without launching (see `copy_cells`).

    Pure host work: it runs on any device (benchmarks/kernel_codegen.py compiles its variants
    for a GPU on a CPU machine); only `launch()` needs CUDA or the interpreter.

    Host work is O(1) per launch apart from reading each layer's address once: layer tables
    are cached per set of layer tensors, staging buffers (`StackedLayers`) need none, and
    nothing is copied to the device or synchronized.

    Raises:
        ValueError: a buffer in a CPU attention placement or a destination quantized
            `toward_zero` (vLLM CPU attention's layouts and fp8 write: only CPU engines have
            them, and the torch backend moves them), or buffers `check_copy_pair` refuses.
    """
    _refuse_cpu_engine_copies(src, dst)
    src_geo, dst_geo = SideGeometry.of(src), SideGeometry.of(dst)
    check_copy_pair(
        src, dst, src_geo.shape, dst_geo.shape, token_start, token_end, num_heads, scales
    )
    num_layers = len(src.layers)
    if num_layers * src_geo.planes > _MAX_GRID_Y:
        raise ValueError(
            f"src.layers: {num_layers} layers x {src_geo.planes} planes exceed {_MAX_GRID_Y} "
            "programs on grid axis 1; split the copy by layers"
        )
    # Word width first from the tensors' own alignment (uint8 words fit any), then the views.
    src_set, dst_set = layer_set("src", src), layer_set("dst", dst)
    src_dtype, dst_dtype = src.layers[0].dtype, dst.layers[0].dtype
    converting = src_dtype != dst_dtype
    words = copy_words((src_geo, src_set), (dst_geo, dst_set), converting)
    tiling = choose_tiling(src_geo, dst_geo, words, num_heads, block_t)
    tile_origin = token_start - token_start % tiling.block_t
    grid = (triton.cdiv(token_end - tile_origin, tiling.block_t), num_layers * src_geo.planes)
    arguments: dict[str, Any] = {
        "tile_origin": tile_origin,
        "token_start": token_start,
        "token_end": token_end,
    }
    src_set = with_words(src_set, _WORDS[words.src])
    dst_set = with_words(dst_set, _WORDS[words.dst])
    arguments.update(_side_arguments("src", src, src_geo, src_set, words.src, tiling))
    arguments.update(_side_arguments("dst", dst, dst_geo, dst_set, words.dst, tiling))
    arguments.update(
        scales_ptr=scales if scales is not None else src_set.word_view,
        NUM_PLANES=src_geo.planes,
        NUM_HEADS=num_heads,
        BLOCK_H=tiling.block_h,
        HEAD_WORDS=tiling.head_words,
        BLOCK_W=tiling.block_w,
        BLOCK_T=tiling.block_t,
        ALIGNED=words.aligned,
        SRC_KIND=KINDS[src_dtype] if converting else KIND_NONE,
        DST_KIND=KINDS[dst_dtype] if converting else KIND_NONE,
        SCALE_MODE=scale_mode(src_dtype, dst_dtype),
        TORCH_CAST=scale_mode(src_dtype, dst_dtype) == SCALE_DIVIDE
        and dst.fp8_rounding == "torch_cast",
    )
    return CellCopyLaunch(grid, arguments, tiling.num_warps)


def _refuse_cpu_engine_copies(src: KVBuffer, dst: KVBuffer) -> None:
    """vLLM CPU attention's layouts and truncating fp8 write have no Triton kernel."""
    for name, buf in (("src", src), ("dst", dst)):
        if buf.cpu_placement:
            raise ValueError(
                f"{name}: kv_placement {buf.kv_placement!r} (vLLM CPU attention) has no Triton "
                "kernel: it exists on CPU engines only; use backend='torch'"
            )
    if dst.fp8_rounding == "toward_zero" and src.layers[0].dtype != dst.layers[0].dtype:
        raise ValueError(
            f"dst: fp8_rounding {dst.fp8_rounding!r} (vLLM CPU attention's fp8 write) has no "
            "Triton kernel: it exists on CPU engines only; use backend='torch'"
        )


def _side_arguments(
    name: str, buf: KVBuffer, geo: SideGeometry, side_set: LayerSet, word: int, tiling: Tiling
) -> dict[str, Any]:
    """One side's kernel arguments, its strides in words.

    Raises:
        ValueError: a tile of this side would span more than 2^31 words (int32 offsets).
    """
    itemsize = geo.itemsize

    def to_words(elements: int) -> int:
        return elements * itemsize // word  # exact: `word` divides every stride in bytes

    sp, sb, ss, sh = geo.strides
    extent = tiling.block_t * abs(ss) + tiling.block_h * abs(sh) + tiling.block_w
    if to_words(extent) > _INT32_MAX:
        raise ValueError(f"{name}: a tile spans more than 2^31 words; use smaller tiles")
    table, ids = side_set.table, buf.block_ids
    return {
        f"{name}_ptr": side_set.word_view,
        # An unused pointer argument still needs a tensor: the words stand in.
        f"{name}_layers_ptr": table if table is not None else side_set.word_view,
        f"{name}_block_ids_ptr": ids if ids is not None else side_set.word_view,
        f"{name}_layer_stride": side_set.layer_stride_bytes // word,
        f"{name}_token_shift": buf.token_shift,
        f"{name}_plane_stride": to_words(sp),
        f"{name}_block_stride": to_words(sb),
        f"{name}_slot_stride": to_words(ss),
        f"{name}_head_stride": to_words(sh),
        f"{name}_head_offset": buf.head_offset,
        f"{name.upper()}_BLOCK_SIZE": 0 if geo.linear else geo.block_size,
        f"{name.upper()}_PAGED": ids is not None,
        f"{name.upper()}_TABLE": table is not None,
    }


def copy_cells(
    src: KVBuffer,
    dst: KVBuffer,
    token_start: int,
    token_end: int,
    num_heads: int,
    *,
    block_t: int | None = None,
    scales: torch.Tensor | None = None,
) -> None:
    """Copy every layer's cells of tokens `[token_start, token_end)` and `num_heads` heads from
    `src` to `dst` with one kernel launch. Other cells keep their bytes.

    Args:
        src: the buffer to copy from; paged (block table) or dense.
        dst: the buffer to copy into; paged or dense.
        token_start: the first token to move.
        token_end: one past the last token to move.
        num_heads: heads to move, from each side's `head_offset`.
        block_t: tokens per program (default: `tile_tokens`); must divide both block sizes.
        scales: where `src` and `dst` hold different dtypes and one is fp8: that side's scales,
            float32 `[layers, planes]` on the device (`kvxfer.kernels.convert`).

    Raises:
        ValueError: inconsistent buffers (see `check_copy_pair`), or too many layers.
        RuntimeError: CPU tensors without the Triton interpreter.
    """
    check_launchable(src.layers[0].device)
    prepare_cell_copy(
        src, dst, token_start, token_end, num_heads, block_t=block_t, scales=scales
    ).launch()
