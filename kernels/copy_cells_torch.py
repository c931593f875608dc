"""Torch implementation of the cell copy behind gather, scatter and remap: the reference
semantics for the Triton kernels, and the CPU backend.

A "cell" is one (plane, token, head) vector of `head_dim` contiguous elements. Cells are
addressed as rows of the underlying memory, so one layer is one `index_select` (a gather into
dense staging) or one row scatter (numpy's on CPU, `index_copy_` elsewhere): on CPU this is
several times faster than advanced indexing into the permuted 5-D views
(benchmarks/history/2026-11-30.md).
The host work around them (index math, row views) is what a short chunk's copy costs; it is
kept to a few numpy calls and, for a cache, views made once.
"""

from __future__ import annotations

import functools
import math
import weakref
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from kvxfer.kernels.buffers import (
    KVBuffer,
    StackedLayers,
    canonical_kv_view,
    check_copy_pair,
    check_layers,
)
from kvxfer.kernels.convert import convert_torch, scale_mode
from kvxfer.layout import cell_planes

# A CPU gather of more bytes a layer than this runs in torch: its `index_select` gathers 2 MiB
# layers twice as fast as `np.take` (benchmarks/torch_copy.py: 2,048-token packs 1.9 ms against
# 4.3 ms) and lets other threads run meanwhile; smaller ones in numpy (`_copy_rows_host`).
_HOST_GATHER_BYTES = 512 << 10
# A CPU copy of at least this many bytes moves runs of consecutive rows as one row each
# (`_run_grain`): below it, finding the runs costs more than it saves.
_COARSE_BYTES = 256 << 10
_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def cell_offsets(
    strides: tuple[int, ...],  # [planes, blocks, slots, heads] strides of the canonical view
    planes: int,
    blocks: np.ndarray,  # [tokens] int64
    slots: np.ndarray,  # [tokens] int64
    head_offset: int,
    num_heads: int,
) -> np.ndarray:
    """Element offset (from the canonical view's first element) of every moved cell:
    `[planes, tokens, heads]`.

    Index math runs in numpy on the host: a 16-token chunk's offsets are a handful of tiny
    arrays, which numpy builds several times faster than torch's per-op dispatch (the cell
    copy of such a chunk was mostly this host work, benchmarks/RESULTS.md).
    """
    s_plane, s_block, s_slot, s_head = strides[:4]
    plane = np.arange(planes, dtype=np.int64)[:, None, None] * s_plane
    token = (blocks * s_block + slots * s_slot)[None, :, None]
    head = (head_offset + np.arange(num_heads, dtype=np.int64))[None, None, :] * s_head
    return plane + token + head


def _moved_cells(
    buf: KVBuffer, side: _Side, token_start: int, token_end: int, num_heads: int
) -> np.ndarray:
    """`cell_offsets` of tokens `[token_start, token_end)` in `buf`, on the host."""
    block_size = side.shape[2]
    pos = np.arange(token_start - buf.token_shift, token_end - buf.token_shift, dtype=np.int64)
    logical = pos // block_size
    block = logical if buf.block_ids is None else _host(buf.block_ids)[logical]
    slot = pos - logical * block_size
    return cell_offsets(side.strides, side.shape[0], block, slot, buf.head_offset, num_heads)


def _host(ids: torch.Tensor) -> np.ndarray:
    """A block table on the host (no copy for a CPU tensor; on CUDA the torch path is a
    reference, and its index math synchronizes)."""
    return ids.cpu().numpy()


def _word_for(sides: list[_Side], itemsize: int, granule_bytes: int) -> tuple[int, torch.dtype]:
    """The widest integer word dividing `granule_bytes` and every layer's start and size.

    Copies move bits, and 8-byte words index about 1.8x faster than bf16 elements on CPU.
    """
    return _word_dividing(
        tuple((side.starts, side.spans) for side in sides), itemsize, granule_bytes
    )


@functools.lru_cache(maxsize=1024)  # the same few buffers, copy after copy
def _word_dividing(
    sides: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...], itemsize: int, granule_bytes: int
) -> tuple[int, torch.dtype]:
    sizes = [granule_bytes]
    for starts, spans in sides:
        sizes += [start * itemsize for start in starts]
        sizes += [span * itemsize for span in spans]
    return next((w, t) for w, t in _WORDS if all(n % w == 0 for n in sizes))


def _span(view: torch.Tensor) -> int:
    """Elements from a view's first element to its last, inclusive: `numel` for a permuted
    contiguous tensor, more for a layer whose blocks sit further apart (`block_stride`)."""
    return 1 + sum((n - 1) * s for n, s in zip(view.shape, view.stride(), strict=True) if s)


def _flat_words(view: torch.Tensor, dtype: torch.dtype, span: int) -> torch.Tensor:
    """The memory under a canonical view (or its layer tensor: the same first element), flat,
    as `dtype` words: the dense range from its first element to its last, `span` elements (a
    permuted contiguous tensor, or a layer with `block_stride`, whose gaps are then
    addressable but never written)."""
    flat = view.as_strided((span,), (1,))
    return flat if flat.dtype == dtype else flat.view(torch.uint8).view(dtype)


def _rows(words: torch.Tensor, length: int, step: int) -> torch.Tensor:
    """Windows of `length` words starting every `step` words (overlapping when step < length:
    fine to read from, never written to)."""
    count = (words.numel() - length) // step + 1
    return words.as_strided((count, length), (step, 1))


def copy_cells_torch(
    src: KVBuffer,
    dst: KVBuffer,
    token_start: int,
    token_end: int,
    num_heads: int,
    scales: torch.Tensor | None = None,
) -> None:
    """Copy every layer's cells of tokens `[token_start, token_end)` and `num_heads` heads from
    `src` to `dst`. Bit-exact between equal dtypes; between two dtypes each element is
    converted with vLLM's arithmetic (`kvxfer.kernels.convert`, `scales` the fp8 side's
    `[layers, planes]`). Other cells keep their bytes.

    Where both sides keep a token's heads side by side (NHD, the wire layout) and the
    destination's runs start on whole multiples of them, the moved heads of a token travel as
    one row: 1/num_heads of the index work.
    """
    if src.cpu_placement or dst.cpu_placement:
        # CPU attention's layouts have no cached `_Side`: every layer is checked each copy.
        check_layers("src", src)
        check_layers("dst", dst)
        check_copy_pair(src, dst, src.canonical_shape, dst.canonical_shape, token_start,
                        token_end, num_heads, scales)  # fmt: skip
        tokens = torch.arange(token_start, token_end, device=src.layers[0].device)
        copy_elements_torch(src, dst, tokens, num_heads, scales)
        return
    # The first layer's canonical view stands for every layer where all share its shape and
    # strides (a cache's layers, a staging buffer's): per-layer host work is then one cached
    # row view per layer (a 16-token chunk of 8 layers: most of its copy was host work). A
    # cache's layers are checked (`check_layers`) when its side is made, not on every copy.
    src_side, dst_side = _side(src, "src"), _side(dst, "dst")
    check_copy_pair(src, dst, src_side.shape, dst_side.shape, token_start, token_end, num_heads,
                    scales)  # fmt: skip
    device = src.layers[0].device
    if device.type == "cpu":
        plan = _short_copy_plan(src, src_side, dst, dst_side, token_start, token_end, num_heads)
        if plan is not None:
            _run_short_copy(plan, src, src_side, dst, dst_side)
            return
    head_dim, planes = src_side.shape[4], src_side.shape[0]
    src_off = _moved_cells(src, src_side, token_start, token_end, num_heads)
    dst_off = _moved_cells(dst, dst_side, token_start, token_end, num_heads)
    unit = head_dim
    grain = _grain(head_dim, src_side, dst_side)
    if grain < head_dim:
        # Cells off the head_dim grid (a layer with a block_stride that head_dim does not
        # divide): rows of the largest grain that divides every cell's start and head_dim.
        src_off, dst_off = (
            _split_cells(src_off, head_dim, grain),
            _split_cells(dst_off, head_dim, grain),
        )
        unit = grain
    elif _token_rows(src_side, dst_side, dst_off, num_heads):
        unit = num_heads * head_dim
        src_off, dst_off = src_off[..., 0], dst_off[..., 0]
    # Rows that tile memory (a contiguous [rows, unit] view) let index_select/index_copy_
    # memcpy whole rows: 2x faster than windows that overlap (measured, 768-byte rows). The
    # destination must be tiled; the source falls back to windows starting at every head.
    src_step = unit if bool((src_off % unit == 0).all()) else head_dim
    src_rows = (src_off // src_step).reshape(-1)
    dst_rows = (dst_off // unit).reshape(-1)
    if src_side.dtype != dst_side.dtype:
        # rows are plane-major: [planes, tokens(, heads)]
        reads = _layer_rows(src, src_side, _BITS[src_side.dtype.itemsize], unit, src_step)
        writes = _layer_rows(dst, dst_side, _BITS[dst_side.dtype.itemsize], unit, unit)
        _convert_rows(reads, writes, _on(src_rows, device), _on(dst_rows, device),
                      (src_side.dtype, dst_side.dtype), planes, scales,
                      dst.fp8_rounding)  # fmt: skip
        return
    itemsize = src_side.dtype.itemsize
    word, dtype = _word_for([src_side, dst_side], itemsize, min(grain, head_dim) * itemsize)
    unit_words, src_step_words = unit * itemsize // word, src_step * itemsize // word
    if device.type == "cpu":
        _copy_rows_host(src, src_side, dst, dst_side, dtype, (unit_words, src_step_words),
                        (src_rows, dst_rows))  # fmt: skip
        return
    reads = _layer_rows(src, src_side, dtype, unit_words, src_step_words)
    writes = _layer_rows(dst, dst_side, dtype, unit_words, unit_words)
    # One pass where one side's rows are consecutive (a dense staging buffer: the wire layout
    # of pack+unpack): gather straight into it, or scatter straight from it, instead of through
    # a temporary (two passes and an allocation).
    dst_run, src_run = _first_of_run(dst_rows), _first_of_run(src_rows)
    n = dst_rows.size
    if dst_run is not None:
        src_index = _on(src_rows, device)
        for r, w in zip(reads, writes, strict=True):
            torch.index_select(r, 0, src_index, out=w[dst_run : dst_run + n])
        return
    dst_index = _on(dst_rows, device)
    if src_run is not None:
        for r, w in zip(reads, writes, strict=True):
            w.index_copy_(0, dst_index, r[src_run : src_run + n])
        return
    src_index = _on(src_rows, device)
    for r, w in zip(reads, writes, strict=True):
        w.index_copy_(0, dst_index, r.index_select(0, src_index))


@dataclass(frozen=True)
class _ShortCopy:
    """A short CPU copy between a dense staging buffer and a cache, as rows, for any block
    table: made once per shape (`_short_copy_plan`), kept on the cache's `_Side`.

    The staging side's rows are consecutive from `dense_first`; the cache side's are
    `cache_rows + block_ids[row_blocks] * block_rows` (its rows with every block id 0, plus
    each row's block's own), so a copy of a new request's blocks costs a few numpy calls
    besides the data: its host work was most of a 16-token chunk's copy (about 105 of 120 us
    on the project's CPU machine, benchmarks/history/2026-12-07.md)."""

    word: torch.dtype
    unit: int  # words a row
    src_step: int  # words between the starts of two source rows
    into_staging: bool  # a gather (cache -> staging) rather than a scatter
    dense_first: int
    cache_rows: np.ndarray
    row_blocks: np.ndarray  # each cache row's index into the block table
    block_rows: int


# Where the key's plan is None the copy is not a short one (or its rows depend on the block
# ids in a way `_ShortCopy` cannot say): the general path runs.
_NOT_SHORT = object()
# Plans kept a cache: a chunk's shape repeats (its length, where it starts in a block), but a
# chunked prefill's steps of every length must not grow them without end.
_SHORT_COPIES_MAX = 512


def _short_copy_plan(
    src: KVBuffer,
    src_side: _Side,
    dst: KVBuffer,
    dst_side: _Side,
    token_start: int,
    token_end: int,
    num_heads: int,
) -> _ShortCopy | None:
    """The `_ShortCopy` of a copy between staging and a cache, made once per shape (on the
    cache's `_Side`, which lives as long as the cache); None where the general path runs: no
    cache side or two, two dtypes, more than `_COARSE_BYTES` (the general path may merge
    rows), or rows that do not follow the block ids linearly."""
    if (src.block_ids is None) == (dst.block_ids is None) or src_side.dtype != dst_side.dtype:
        return None
    into_staging = dst.block_ids is None  # by the buffers: both sides may share one `_Side`
    cache_side, staging_side = (src_side, dst_side) if into_staging else (dst_side, src_side)
    plans = cache_side.short_copies
    if plans is None:
        return None
    key = (
        into_staging,
        staging_side.shape,
        staging_side.strides,
        staging_side.starts,
        staging_side.spans,
        token_start - src.token_shift,
        token_start - dst.token_shift,
        token_end - token_start,
        src.head_offset,
        dst.head_offset,
        num_heads,
    )
    plan = plans.get(key, _NOT_SHORT)
    if plan is _NOT_SHORT:
        if len(plans) >= _SHORT_COPIES_MAX:
            plans.clear()
        plan = plans[key] = _make_short_copy(
            src, src_side, dst, dst_side, token_start, token_end, num_heads
        )
    return plan  # type: ignore[return-value]


def _make_short_copy(
    src: KVBuffer,
    src_side: _Side,
    dst: KVBuffer,
    dst_side: _Side,
    token_start: int,
    token_end: int,
    num_heads: int,
) -> _ShortCopy | None:
    """`copy_cells_torch`'s choice of rows, made with every block id 0, and the conditions
    under which it holds for every block table (else None)."""
    head_dim, itemsize = src_side.shape[4], src_side.dtype.itemsize
    if _grain(head_dim, src_side, dst_side) != head_dim:
        return None
    into_staging = dst.block_ids is None
    cache, cache_side = (src, src_side) if into_staging else (dst, dst_side)
    zeros = torch.zeros_like(cache.block_ids)  # type: ignore[arg-type]
    template = replace(cache, block_ids=zeros)
    src_off = _moved_cells(template if into_staging else src, src_side, token_start, token_end,
                           num_heads)  # fmt: skip
    dst_off = _moved_cells(dst if into_staging else template, dst_side, token_start, token_end,
                           num_heads)  # fmt: skip
    block_stride = cache_side.strides[1]
    unit = head_dim
    merged = unit * num_heads
    if _token_rows(src_side, dst_side, dst_off, num_heads) and (
        into_staging or block_stride % merged == 0
    ):
        unit = merged
        src_off, dst_off = src_off[..., 0], dst_off[..., 0]
    aligned = bool((src_off % unit == 0).all()) and (not into_staging or block_stride % unit == 0)
    src_step = unit if aligned else head_dim
    cache_step = src_step if into_staging else unit
    if block_stride % cache_step:
        return None
    src_rows, dst_rows = (src_off // src_step).reshape(-1), (dst_off // unit).reshape(-1)
    dense_rows, cache_rows = (dst_rows, src_rows) if into_staging else (src_rows, dst_rows)
    dense_first = _first_of_run(dense_rows)
    nbytes = dense_rows.size * unit * itemsize
    if dense_first is None or nbytes >= _COARSE_BYTES or nbytes > _HOST_GATHER_BYTES:
        return None  # the general path may merge rows, or gather in torch
    word, dtype = _word_for([src_side, dst_side], itemsize, head_dim * itemsize)
    pos = np.arange(token_start - cache.token_shift, token_end - cache.token_shift)
    logical = pos // cache_side.shape[2]  # each token's, broadcast as the rows are made
    per_token = logical[None, :, None] if src_off.ndim == 3 else logical[None, :]
    blocks = np.broadcast_to(per_token, src_off.shape)
    cache_rows.flags.writeable = False
    return _ShortCopy(
        dtype,
        unit * itemsize // word,
        src_step * itemsize // word,
        into_staging,
        dense_first,
        cache_rows,
        np.ascontiguousarray(blocks).reshape(-1),
        block_stride // cache_step,
    )


def _run_short_copy(
    plan: _ShortCopy, src: KVBuffer, src_side: _Side, dst: KVBuffer, dst_side: _Side
) -> None:
    """Run a `_ShortCopy` on this copy's block table: the cache side's rows from it, then one
    numpy gather or scatter per layer."""
    cache, cache_side = (src, src_side) if plan.into_staging else (dst, dst_side)
    blocks = _host(cache.block_ids)[plan.row_blocks]  # type: ignore[arg-type]
    if int(blocks.min()) < 0 or int(blocks.max()) >= cache_side.shape[1]:
        bad = sorted({int(b) for b in blocks if not 0 <= b < cache_side.shape[1]})
        raise ValueError(
            f"block_ids: {bad} outside the cache's {cache_side.shape[1]} blocks; pass the "
            "request's block ids"
        )
    rows = plan.cache_rows + blocks * plan.block_rows
    reads = _host_rows(src, src_side, plan.word, plan.unit, plan.src_step)
    writes = _host_rows(dst, dst_side, plan.word, plan.unit, plan.unit)
    first, n = plan.dense_first, rows.size
    if plan.into_staging:
        for r, w in zip(reads, writes, strict=True):
            np.take(r, rows, axis=0, out=w[first : first + n])
    else:
        for r, w in zip(reads, writes, strict=True):
            w[rows] = r[first : first + n]


def _token_rows(src_side: _Side, dst_side: _Side, dst_off: np.ndarray, num_heads: int) -> bool:
    """Whether a token's moved heads travel as one row: both sides keep them side by side
    (NHD, the wire layout) and the destination's cells (`dst_off`, `[..., heads]`) start on
    whole multiples of them."""
    head_dim = src_side.shape[4]
    return (
        num_heads > 1
        and src_side.strides[3] == head_dim == dst_side.strides[3]
        and bool((dst_off[..., 0] % (num_heads * head_dim) == 0).all())
    )


def _copy_rows_host(
    src: KVBuffer,
    src_side: _Side,
    dst: KVBuffer,
    dst_side: _Side,
    word: torch.dtype,
    shape: tuple[int, int],  # (unit, source step), in words
    rows: tuple[np.ndarray, np.ndarray],  # (source rows, destination rows)
) -> None:
    """A CPU copy's rows, layer by layer, in numpy on the rows' memory (torch only for a large
    gather, `_HOST_GATHER_BYTES`).

    A short chunk's copy is mostly host work: numpy views made without a torch call per layer
    and numpy's gather took a 16-token pack from 139 to 123 us, and numpy scatters rows 2-4
    times faster than `index_copy_` (benchmarks/history/2026-12-02.md).
    """
    (unit, src_step), (src_rows, dst_rows) = shape, rows
    reads = _host_rows(src, src_side, word, unit, src_step)
    writes = _host_rows(dst, dst_side, word, unit, unit)
    dst_run, src_run = _first_of_run(dst_rows), _first_of_run(src_rows)
    # The first row of the one dense side (staging), if exactly one side is dense
    dense = dst_run if src_run is None else (src_run if dst_run is None else None)
    if (
        dense is not None
        and src_step == unit
        and dst_rows.size * unit * writes[0].itemsize >= _COARSE_BYTES
    ):
        # One side dense (staging), the other in runs of consecutive rows (a block's tokens):
        # move whole runs as rows, many times fewer and longer (a 25 MB unpack 5.2 -> 2.4 ms)
        sparse = src_rows if src_run is None else dst_rows
        grain = math.gcd(_run_grain(sparse), dense)
        coarse = _coarse(reads, writes, grain) if grain > 1 else None
        if coarse is not None:
            reads, writes = coarse
            src_rows, dst_rows, unit = (
                src_rows[::grain] // grain,
                dst_rows[::grain] // grain,
                unit * grain,
            )
            dst_run, src_run = _first_of_run(dst_rows), _first_of_run(src_rows)
    n = dst_rows.size
    if dst_run is not None and n * unit * writes[0].itemsize > _HOST_GATHER_BYTES:
        index = torch.from_numpy(src_rows)  # a large gather: torch's is faster (see above)
        for r, w in zip(reads, writes, strict=True):
            out = torch.from_numpy(w[dst_run : dst_run + n])
            torch.index_select(torch.from_numpy(r), 0, index, out=out)
    elif dst_run is not None:  # into dense staging: one gather per layer, straight into place
        for r, w in zip(reads, writes, strict=True):
            np.take(r, src_rows, axis=0, out=w[dst_run : dst_run + n])
    elif src_run is not None:  # from dense staging: one scatter per layer
        for r, w in zip(reads, writes, strict=True):
            w[dst_rows] = r[src_run : src_run + n]
    else:
        for r, w in zip(reads, writes, strict=True):
            w[dst_rows] = r[src_rows]


def _on(rows: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host row indices as an int64 tensor on `device` (no copy on the CPU)."""
    index = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64))
    return index if device.type == "cpu" else index.to(device)


def _convert_rows(
    reads: list[torch.Tensor],
    writes: list[torch.Tensor],
    src_rows: torch.Tensor,
    dst_rows: torch.Tensor,
    dtypes: tuple[torch.dtype, torch.dtype],
    planes: int,
    scales: torch.Tensor | None,
    rounding: str,
) -> None:
    """The rows of a copy between two dtypes: gathered in the source's dtype (`reads`, each
    layer's rows as the source's bits), converted with each row's plane's scale (and the
    destination's fp8 `rounding`), scattered in the destination's (`writes`, as its bits).
    CPU torch indexes no fp8, so rows move as bits and convert as their dtypes."""
    src_dtype, dst_dtype = dtypes
    per_plane = src_rows.numel() // planes
    scaled = scale_mode(src_dtype, dst_dtype) != 0
    for layer, (r, w) in enumerate(zip(reads, writes, strict=True)):
        values = r.index_select(0, src_rows).view(src_dtype)
        scale = None
        if scaled:
            assert scales is not None  # check_copy_pair
            scale = scales[layer].repeat_interleave(per_plane)[:, None]
        converted = convert_torch(values, dst_dtype, scale, rounding)
        w.index_copy_(0, dst_rows, converted.view(w.dtype))


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def copy_elements_torch(
    src: KVBuffer, dst: KVBuffer, tokens: torch.Tensor, num_heads: int, scales: torch.Tensor | None
) -> None:
    """`copy_cells_torch` of `tokens` (a checked copy's, on the layers' device) element by
    element, through each side's per-plane views (`kvxfer.layout.cell_planes`): for layers
    whose cells are not contiguous rows, vLLM CPU attention's `k_transposed` (K's elements of
    one token sit `block_size` apart) and `amx_tiles` (slots and dims packed in tile groups).
    Bit-exact (the elements move as integers of their width) or converted as
    `copy_cells_torch` does; other elements keep their bytes.
    """
    src_blocks, src_slots = src.token_cells(tokens)
    dst_blocks, dst_slots = dst.token_cells(tokens)
    src_heads = slice(src.head_offset, src.head_offset + num_heads)
    dst_heads = slice(dst.head_offset, dst.head_offset + num_heads)
    src_dtype, dst_dtype = src.layers[0].dtype, dst.layers[0].dtype
    s_bits, d_bits = _BITS[src.layers[0].element_size()], _BITS[dst.layers[0].element_size()]
    scaled = scale_mode(src_dtype, dst_dtype) != 0
    for layer, (s_layer, d_layer) in enumerate(zip(src.layers, dst.layers, strict=True)):
        s_planes = cell_planes(s_layer, src.layout, src.kv_placement, src.mla)
        d_planes = cell_planes(d_layer, dst.layout, dst.kv_placement, dst.mla)
        for plane, (s_plane, d_plane) in enumerate(zip(s_planes, d_planes, strict=True)):
            # [tokens, heads, head_dim], as bits: CPU torch indexes no fp8
            values = s_plane.as_bits(s_bits).read(src_blocks, src_slots, src_heads)
            if src_dtype != dst_dtype:
                scale = scales[layer, plane] if scaled and scales is not None else None
                converted = convert_torch(
                    values.view(src_dtype), dst_dtype, scale, dst.fp8_rounding
                )
                values = converted.view(d_bits)
            d_plane.as_bits(d_bits).write(dst_blocks, dst_slots, dst_heads, values)


def _grain(head_dim: int, *sides: _Side) -> int:
    """A divisor of `head_dim` that every cell start of the `sides` is a multiple of: the gcd
    of `head_dim` and their strides along every axis longer than one (a cell start is a sum
    of multiples of those). `head_dim` itself for every dense layout; smaller for a layer
    whose blocks sit `block_stride` apart when head_dim does not divide it. Integers only: no
    work on the cells."""
    grain = head_dim
    for side in sides:
        for size, stride in zip(side.shape[:4], side.strides[:4], strict=True):
            if size > 1:
                grain = math.gcd(grain, stride)
    return grain


def _split_cells(offsets: np.ndarray, head_dim: int, grain: int) -> np.ndarray:
    """Each cell's `head_dim // grain` pieces of `grain` elements, in order: `[..., pieces]`."""
    return offsets[..., None] + np.arange(0, head_dim, grain, dtype=np.int64)


@dataclass(frozen=True)
class _Side:
    """One side of a copy as its rows are made: the canonical `[plane, block, slot, head,
    head_dim]` shape, strides and dtype that every layer shares (layer 0's), each layer's
    first element (its storage offset) and span, in elements, and (a cache's) row views
    already made, by (word, unit, step)."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: torch.dtype
    starts: tuple[int, ...]
    spans: tuple[int, ...]
    rows: dict[tuple[torch.dtype, int, int], list[torch.Tensor]] | None = None
    host_rows: dict[tuple[torch.dtype, int, int], list[np.ndarray]] | None = None
    # (a cache's) `_ShortCopy`s by shape; None where the general path runs
    short_copies: dict[tuple[Any, ...], _ShortCopy | None] | None = None


def _side(buf: KVBuffer, name: str) -> _Side:
    """`buf`'s `_Side`: a staging buffer's from its geometry; a cache's made once per set of
    layer tensors (`_CACHE_SIDES`), its layers checked then.

    Raises:
        ValueError: no layers, or layers of different shapes, dtypes or devices (`name` is
            the argument at fault).
    """
    layers = buf.layers
    if not layers:
        check_layers(name, buf)  # raises, naming the argument
    if isinstance(layers, StackedLayers):
        shape, strides = _dense_canonical(layers.layer_shape, buf.layout, buf.kv_placement, buf.mla)
        first, size, count = layers.flat.storage_offset(), layers.layer_elements, len(layers)
        starts = tuple(first + i * size for i in range(count))
        return _Side(shape, strides, layers.flat.dtype, starts, (size,) * count)
    return _CACHE_SIDES.get(buf, name)


@functools.lru_cache(maxsize=256)
def _dense_canonical(
    layer_shape: tuple[int, ...], layout: str, kv_placement: str, mla: bool
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The canonical view's shape and strides of a contiguous layer of `layer_shape`."""
    view = canonical_kv_view(torch.empty(layer_shape, device="meta"), layout, kv_placement, mla)
    return tuple(view.shape), view.stride()


def _cache_side(buf: KVBuffer) -> _Side:
    """A cache's `_Side`. Where every layer shares layer 0's shape and strides (a cache's
    layers) layer 0's canonical view stands for all (a canonical view starts at its layer's
    first element and spans what its layer does); otherwise each layer's span comes from its
    own canonical view."""
    layers = buf.layers
    first = layers[0]
    view = canonical_kv_view(first, buf.layout, buf.kv_placement, buf.mla)
    starts = tuple(t.storage_offset() for t in layers)
    if all(t.shape == first.shape and t.stride() == first.stride() for t in layers):
        spans = (_span(view),) * len(layers)
    else:
        spans = tuple(_span(v) for v in buf.canonical_layers())
    return _Side(tuple(view.shape), view.stride(), view.dtype, starts, spans, {}, {}, {})


class _CacheSides:
    """Each cache's `_Side`, with its row views, made once: a cache is the same layer tensors
    for the engine's life, so a copy's per-layer host work is a lookup. An entry is found by
    layer 0 and checked against every layer (weak references: the cache keeps no tensor
    alive), and goes when layer 0 does, its row views with it. A tensor whose memory is
    replaced in place (`set_`, `resize_`) is not a cache the layout contract knows."""

    def __init__(self) -> None:
        self._entries: dict[tuple[Any, ...], tuple[list[weakref.ref[torch.Tensor]], _Side]] = {}

    def get(self, buf: KVBuffer, name: str) -> _Side:
        layers = buf.layers
        key = (id(layers[0]), len(layers), buf.layout, buf.kv_placement, buf.mla)
        entry = self._entries.get(key)
        if entry is not None and all(r() is t for r, t in zip(entry[0], layers, strict=True)):
            return entry[1]
        check_layers(name, buf)
        side = _cache_side(buf)
        entries = self._entries  # not self: the callback must not keep this registry alive
        refs = [weakref.ref(layers[0], lambda _: entries.pop(key, None))]
        refs += [weakref.ref(t) for t in list(layers)[1:]]
        entries[key] = (refs, side)  # a race makes the same entry twice: harmless
        return side


_CACHE_SIDES = _CacheSides()


def _layer_rows(
    buf: KVBuffer, side: _Side, word: torch.dtype, unit: int, step: int
) -> list[torch.Tensor]:
    """Every layer's memory as rows of `unit` words starting every `step` words: a cache's
    made once (`_Side.rows`); a staging buffer's from its one flat tensor, a view per layer."""
    layers = buf.layers
    if side.rows is not None:
        key = (word, unit, step)
        rows = side.rows.get(key)
        if rows is None:
            rows = side.rows[key] = [
                _rows(_flat_words(t, word, span), unit, step)
                for t, span in zip(layers, side.spans, strict=True)
            ]
        return rows
    words, placed = _stacked_words(buf, side, word, unit, step)
    base = words.storage_offset()
    return [words.as_strided((count, unit), (step, 1), base + first) for first, count in placed]


def _stacked_words(
    buf: KVBuffer, side: _Side, word: torch.dtype, unit: int, step: int
) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """A staging buffer's layers as one flat tensor of `word`s (they sit back to back, whole
    words each: `_word_for`), and where each layer's rows of `unit` words every `step` are:
    its first word in that tensor and its number of rows."""
    layers = buf.layers
    assert isinstance(layers, StackedLayers)
    base, itemsize = side.starts[0], side.dtype.itemsize
    words = _flat_words(layers.flat, word, side.starts[-1] - base + side.spans[-1])
    ratio = words.element_size() // itemsize  # >= 1: a word never splits an element (_word_for)
    placed = [
        ((start - base) // ratio, (span // ratio - unit) // step + 1)
        for start, span in zip(side.starts, side.spans, strict=True)
    ]
    return words, placed


def _host_rows(
    buf: KVBuffer, side: _Side, word: torch.dtype, unit: int, step: int
) -> list[np.ndarray]:
    """`_layer_rows` as numpy arrays on the same CPU memory: a cache's made once
    (`_Side.host_rows`), a staging buffer's from one numpy view of its flat tensor (no torch
    call per layer)."""
    if side.host_rows is not None:
        key = (word, unit, step)
        rows = side.host_rows.get(key)
        if rows is None:
            made = _layer_rows(buf, side, word, unit, step)
            rows = side.host_rows[key] = [r.numpy() for r in made]
        return rows
    flat, placed = _stacked_words(buf, side, word, unit, step)
    words = flat.numpy()
    out = []
    for first, count in placed:
        if step == unit:  # rows that tile the layer: a plain reshape
            out.append(words[first : first + count * unit].reshape(count, unit))
        else:
            strides = (step * words.itemsize, words.itemsize)
            out.append(np.lib.stride_tricks.as_strided(words[first:], (count, unit), strides))
    return out


def _run_grain(rows: np.ndarray) -> int:
    """The largest g such that `rows` are whole runs of g consecutive rows, each starting at a
    multiple of g (1 when there is none larger)."""
    if rows.size < 2:
        return 1
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [rows.size])))
    return int(np.gcd.reduce(np.concatenate((lengths, rows[starts]))))


def _coarse(
    reads: list[np.ndarray], writes: list[np.ndarray], grain: int
) -> tuple[list[np.ndarray], list[np.ndarray]] | None:
    """Both sides' row views as rows of `grain` rows each, for rows that come in runs of
    `grain` consecutive rows starting at multiples of `grain` on both sides (`_run_grain`);
    None where a side's rows do not tile memory (then they cannot be merged)."""
    if not all(a.flags.c_contiguous for a in (*reads, *writes)):
        return None

    def merged(arrays: list[np.ndarray]) -> list[np.ndarray]:
        return [a[: a.shape[0] // grain * grain].reshape(-1, grain * a.shape[1]) for a in arrays]

    return merged(reads), merged(writes)


def _first_of_run(rows: np.ndarray) -> int | None:
    """The first row if `rows` are consecutive (r, r + 1, ...), else None."""
    if rows.size == 0:
        return None
    first = int(rows[0])
    return first if np.array_equal(rows, np.arange(first, first + rows.size)) else None
