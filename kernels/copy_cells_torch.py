"""Torch implementation of the cell copy behind gather, scatter and remap: the reference
semantics for the Triton kernels, and the CPU backend.

A "cell" is one (plane, token, head) vector of `head_dim` contiguous elements. Cells are
addressed as rows of the underlying memory, so one layer is one `index_select` and one
`index_copy_`: on CPU this is several times faster than advanced indexing into the permuted 5-D
views (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import math

import torch

from kvxfer.kernels.convert import convert_torch, scale_mode
from kvxfer.kernels.layout import KVBuffer, canonical_kv_view, check_cell_copy
from kvxfer.layout import plane_views

_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def cell_offsets(
    view: torch.Tensor,  # [planes, blocks, slots, heads, head_dim], head_dim contiguous
    blocks: torch.Tensor,  # [tokens] int64
    slots: torch.Tensor,  # [tokens] int64
    head_offset: int,
    num_heads: int,
) -> torch.Tensor:
    """Element offset (from the view's first element) of every moved cell: [planes, tokens,
    heads]."""
    if view.dim() != 5 or view.stride(4) != 1:
        raise ValueError(
            f"view: expected [planes, blocks, slots, heads, head_dim] with head_dim contiguous, "
            f"got shape {tuple(view.shape)} strides {view.stride()}"
        )
    s_plane, s_block, s_slot, s_head, _ = view.stride()
    device = blocks.device
    planes = torch.arange(view.shape[0], device=device)[:, None, None] * s_plane
    tokens = (blocks * s_block + slots * s_slot)[None, :, None]
    heads = (head_offset + torch.arange(num_heads, device=device))[None, None, :] * s_head
    return planes + tokens + heads


def _word_for(
    views: list[torch.Tensor], spans: list[int], granule_bytes: int
) -> tuple[int, torch.dtype]:
    """The widest integer word dividing `granule_bytes` and every view's start and size.

    Copies move bits, and 8-byte words index about 1.8x faster than bf16 elements on CPU.
    """
    sizes = [granule_bytes]
    for v, span in zip(views, spans, strict=True):
        sizes += [v.storage_offset() * v.element_size(), span * v.element_size()]
    return next((w, t) for w, t in _WORDS if all(n % w == 0 for n in sizes))


def _span(view: torch.Tensor) -> int:
    """Elements from a view's first element to its last, inclusive: `numel` for a permuted
    contiguous tensor, more for a layer whose blocks sit further apart (`block_stride`)."""
    return 1 + sum((n - 1) * s for n, s in zip(view.shape, view.stride(), strict=True) if s)


def _flat_words(view: torch.Tensor, dtype: torch.dtype, span: int | None = None) -> torch.Tensor:
    """The memory under a canonical view (or its layer tensor: the same first element), flat,
    as `dtype` words: the dense range from its first element to its last, `span` elements
    (default: the view's; a permuted contiguous tensor, or a layer with `block_stride`, whose
    gaps are then addressable but never written)."""
    flat = view.as_strided((_span(view) if span is None else span,), (1,))
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
    check_cell_copy(src, dst, token_start, token_end, num_heads, scales)
    if src.k_transposed or dst.k_transposed:
        copy_elements_torch(src, dst, token_start, token_end, num_heads, scales)
        return
    device = src.layers[0].device
    tokens = torch.arange(token_start, token_end, device=device)
    # The first layer's canonical view stands for every layer where all share its shape and
    # strides (a cache's layers, a staging buffer's): per-layer host work is then a few views
    # (a 16-token chunk of 8 layers: most of its 1 ms copy was per-layer view-making).
    (src_layers, src_spans), (dst_layers, dst_spans) = _canonical_first(src), _canonical_first(dst)
    head_dim = src_layers[0].shape[4]
    src_off = cell_offsets(src_layers[0], *src.token_cells(tokens), src.head_offset, num_heads)
    dst_off = cell_offsets(dst_layers[0], *dst.token_cells(tokens), dst.head_offset, num_heads)
    unit = head_dim
    grain = _grain(head_dim, src_layers[0], dst_layers[0])
    if grain < head_dim:
        # Cells off the head_dim grid (a layer with a block_stride that head_dim does not
        # divide): rows of the largest grain that divides every cell's start and head_dim.
        src_off, dst_off = (
            _split_cells(src_off, head_dim, grain),
            _split_cells(dst_off, head_dim, grain),
        )
        unit = grain
    elif (
        num_heads > 1
        and src_layers[0].stride(3) == head_dim == dst_layers[0].stride(3)
        and bool((dst_off[..., 0] % (num_heads * head_dim) == 0).all())
    ):
        unit = num_heads * head_dim
        src_off, dst_off = src_off[..., 0], dst_off[..., 0]
    # Rows that tile memory (a contiguous [rows, unit] view) let index_select/index_copy_
    # memcpy whole rows: 2x faster than windows that overlap (measured, 768-byte rows). The
    # destination must be tiled; the source falls back to windows starting at every head.
    src_step = unit if bool((src_off % unit == 0).all()) else head_dim
    src_rows = (src_off // src_step).reshape(-1)
    dst_rows = (dst_off // unit).reshape(-1)
    if src_layers[0].dtype != dst_layers[0].dtype:
        planes = src_layers[0].shape[0]  # rows are plane-major: [planes, tokens(, heads)]
        _convert_rows(src_layers, src_spans, dst_layers, dst_spans, src_rows, dst_rows,
                      (unit, src_step), planes, scales)  # fmt: skip
        return
    itemsize = src_layers[0].element_size()
    word, dtype = _word_for(
        [*src_layers, *dst_layers], [*src_spans, *dst_spans], min(grain, head_dim) * itemsize
    )
    unit_words, src_step_words = unit * itemsize // word, src_step * itemsize // word
    # One pass where one side's rows are consecutive (a dense staging buffer: the wire layout
    # of pack+unpack): gather straight into it, or scatter straight from it, instead of through
    # a temporary (two passes and an allocation).
    dst_run, src_run = _first_of_run(dst_rows), _first_of_run(src_rows)
    n = dst_rows.numel()
    for s, s_span, d, d_span in zip(src_layers, src_spans, dst_layers, dst_spans, strict=True):
        reads = _rows(_flat_words(s, dtype, s_span), unit_words, src_step_words)
        writes = _rows(_flat_words(d, dtype, d_span), unit_words, unit_words)
        if dst_run is not None:
            torch.index_select(reads, 0, src_rows, out=writes[dst_run : dst_run + n])
        elif src_run is not None:
            writes.index_copy_(0, dst_rows, reads[src_run : src_run + n])
        else:
            writes.index_copy_(0, dst_rows, reads.index_select(0, src_rows))


def _convert_rows(
    src_layers: list[torch.Tensor],
    src_spans: list[int],
    dst_layers: list[torch.Tensor],
    dst_spans: list[int],
    src_rows: torch.Tensor,
    dst_rows: torch.Tensor,
    unit_step: tuple[int, int],
    planes: int,
    scales: torch.Tensor | None,
) -> None:
    """The rows of a copy between two dtypes: gathered in the source's dtype, converted with
    each row's plane's scale, scattered in the destination's (rows of `unit` elements, source
    rows starting every `step`)."""
    unit, step = unit_step
    src_dtype, dst_dtype = src_layers[0].dtype, dst_layers[0].dtype
    # Moved as their bits (CPU torch indexes no fp8), converted as their dtypes.
    src_bits, dst_bits = _BITS[src_dtype.itemsize], _BITS[dst_dtype.itemsize]
    per_plane = src_rows.numel() // planes
    scaled = scale_mode(src_dtype, dst_dtype) != 0
    for layer, (s, s_span, d, d_span) in enumerate(
        zip(src_layers, src_spans, dst_layers, dst_spans, strict=True)
    ):
        reads = _rows(_flat_words(s, src_bits, s_span), unit, step)
        values = reads.index_select(0, src_rows).view(src_dtype)
        scale = None
        if scaled:
            assert scales is not None  # check_cell_copy
            scale = scales[layer].repeat_interleave(per_plane)[:, None]
        writes = _rows(_flat_words(d, dst_bits, d_span), unit, unit)
        writes.index_copy_(0, dst_rows, convert_torch(values, dst_dtype, scale).view(dst_bits))


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def copy_elements_torch(
    src: KVBuffer,
    dst: KVBuffer,
    token_start: int,
    token_end: int,
    num_heads: int,
    scales: torch.Tensor | None = None,
) -> None:
    """`copy_cells_torch` element by element, through each side's per-plane views
    (`kvxfer.layout.plane_views`): for layers whose cells are not contiguous rows, vLLM CPU
    attention's `k_transposed` (K's elements of one token sit `block_size` apart). Bit-exact
    (the elements move as integers of their width) or converted as `copy_cells_torch` does;
    other elements keep their bytes.
    """
    device = src.layers[0].device
    tokens = torch.arange(token_start, token_end, device=device)
    src_blocks, src_slots = src.token_cells(tokens)
    dst_blocks, dst_slots = dst.token_cells(tokens)
    src_heads = slice(src.head_offset, src.head_offset + num_heads)
    dst_heads = slice(dst.head_offset, dst.head_offset + num_heads)
    src_dtype, dst_dtype = src.layers[0].dtype, dst.layers[0].dtype
    bits = _BITS[src.layers[0].element_size()] if src_dtype == dst_dtype else None
    scaled = scale_mode(src_dtype, dst_dtype) != 0
    for layer, (s_layer, d_layer) in enumerate(zip(src.layers, dst.layers, strict=True)):
        s_planes = plane_views(s_layer, src.layout, src.kv_placement, src.mla)
        d_planes = plane_views(d_layer, dst.layout, dst.kv_placement, dst.mla)
        for plane, (s_plane, d_plane) in enumerate(zip(s_planes, d_planes, strict=True)):
            # [tokens, heads, head_dim]: advanced indices on (block, slot), the heads sliced
            if bits is not None:
                values = s_plane.view(bits)[src_blocks, src_slots, src_heads]
                d_plane.view(bits)[dst_blocks, dst_slots, dst_heads] = values
                continue
            # fp8 has no index_put on CPU: the destination's elements move as their bits
            scale = scales[layer, plane] if scaled and scales is not None else None
            s_bits = _BITS[s_plane.element_size()]
            values = s_plane.view(s_bits)[src_blocks, src_slots, src_heads].view(src_dtype)
            got = convert_torch(values, dst_dtype, scale)
            d_bits = _BITS[d_plane.element_size()]
            d_plane.view(d_bits)[dst_blocks, dst_slots, dst_heads] = got.view(d_bits)


def _grain(head_dim: int, *views: torch.Tensor) -> int:
    """A divisor of `head_dim` that every cell start of the canonical `views` is a multiple of:
    the gcd of `head_dim` and their strides along every axis longer than one (a cell start is a
    sum of multiples of those). `head_dim` itself for every dense layout; smaller for a layer
    whose blocks sit `block_stride` apart when head_dim does not divide it. Integers only: no
    work on the cells."""
    grain = head_dim
    for view in views:
        for size, stride in zip(view.shape[:4], view.stride()[:4], strict=True):
            if size > 1:
                grain = math.gcd(grain, stride)
    return grain


def _split_cells(offsets: torch.Tensor, head_dim: int, grain: int) -> torch.Tensor:
    """Each cell's `head_dim // grain` pieces of `grain` elements, in order: `[..., pieces]`."""
    pieces = torch.arange(0, head_dim, grain, device=offsets.device)
    return offsets[..., None] + pieces


def _canonical_first(buf: KVBuffer) -> tuple[list[torch.Tensor], list[int]]:
    """Every layer for `_flat_words`, and the span of each: layer 0's canonical view, then
    the other layers as they are, where they all share layer 0's shape, strides and dtype (a
    canonical view starts at its layer's first element and spans what its layer does, so the
    flat memory under each is the same range); else every layer's canonical view."""
    layers = list(buf.layers)
    first = layers[0]
    if all(
        t.shape == first.shape and t.stride() == first.stride() and t.dtype == first.dtype
        for t in layers[1:]
    ):
        view = canonical_kv_view(first, buf.layout, buf.kv_placement, buf.mla)
        return [view, *layers[1:]], [_span(view)] * len(layers)
    views = buf.canonical_layers()
    return views, [_span(v) for v in views]


def _first_of_run(rows: torch.Tensor) -> int | None:
    """The first row if `rows` are consecutive (r, r + 1, ...), else None."""
    if rows.numel() == 0:
        return None
    first = int(rows[0])
    expected = torch.arange(first, first + rows.numel(), device=rows.device)
    return first if torch.equal(rows, expected) else None
