"""Byte segments between two paged buffers, with contiguous runs coalesced.

All of it is numpy-vectorized: cells are enumerated once for one layer (a `LayerTemplate`), in
the source buffer's address order, and the other layers are the same template shifted by each
layer's base offset.

A copy from a staging buffer into one laid out the same (the wire buffer of pack+unpack, the
destination mirror of a landing pack) needs no enumeration: every moved cell keeps its offset,
so the segments are the buffer's bytes less the cells of the tokens it does not hold, and those
lie in its first and last block only. Planning such a copy costs the same for any number of
tokens (`staging_copy_template`). Where both sides keep a head's consecutive slots contiguous
(HND, MLA, NHD with one head), the slots of one head in one source and one destination block
are listed as one piece rather than cell by cell (`slot_run_offsets_in_address_order`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvxfer.plan.paged import PagedView

_AXES = ("plane", "chunk", "slot", "head")


@dataclass(frozen=True)
class Segments:
    """Byte ranges to copy: `length[i]` bytes from `(src_region[i], src_offset[i])` to
    `(dst_region[i], dst_offset[i])`. Regions are keys (the plan's) or registered ids (a
    transport's), depending on who holds the list."""

    src_region: np.ndarray
    src_offset: np.ndarray
    dst_region: np.ndarray
    dst_offset: np.ndarray
    length: np.ndarray

    def __len__(self) -> int:
        return int(self.length.shape[0])

    @property
    def nbytes(self) -> int:
        """Total bytes moved."""
        return int(self.length.sum())

    def with_regions(
        self, src_places: dict[int, tuple[int, int]], dst_places: dict[int, tuple[int, int]]
    ) -> Segments:
        """Place the plan's region keys in registered memory: each key maps to
        `(region id, byte offset of the buffer inside that region)`."""
        src_ids, src_base = _map_keys(self.src_region, src_places)
        dst_ids, dst_base = _map_keys(self.dst_region, dst_places)
        return Segments(
            src_ids, self.src_offset + src_base, dst_ids, self.dst_offset + dst_base, self.length
        )


def _map_keys(
    keys: np.ndarray, places: dict[int, tuple[int, int]]
) -> tuple[np.ndarray, np.ndarray]:
    if len(places) == 1:  # one buffer on this side: most chunks
        ((key, (region, base)),) = places.items()
        if not bool((keys == key).all()):
            missing = sorted({int(k) for k in keys[keys != key]})
            raise KeyError(f"no registered region for region keys {missing}")
        return np.full(keys.shape, region, dtype=np.int64), np.full(keys.shape, base, np.int64)
    known = np.asarray(sorted(places), dtype=np.int64)
    ids = np.asarray([places[int(k)][0] for k in known], dtype=np.int64)
    bases = np.asarray([places[int(k)][1] for k in known], dtype=np.int64)
    pos = np.minimum(np.searchsorted(known, keys), max(len(known) - 1, 0))
    found = known[pos] == keys if len(known) else np.zeros(keys.shape, dtype=bool)
    if not found.all():
        missing = sorted({int(k) for k in keys[~found]})
        raise KeyError(f"no registered region for region keys {missing}")
    return ids[pos], bases[pos]


def coalesce(segments: Segments) -> Segments:
    """Merge each segment into its predecessor where both sides continue it exactly."""
    if len(segments) < 2:
        return segments
    s = segments
    continues = (
        (s.src_region[1:] == s.src_region[:-1])
        & (s.dst_region[1:] == s.dst_region[:-1])
        & (s.src_offset[1:] == s.src_offset[:-1] + s.length[:-1])
        & (s.dst_offset[1:] == s.dst_offset[:-1] + s.length[:-1])
    )
    starts = np.flatnonzero(np.concatenate(([True], ~continues)))
    return Segments(
        s.src_region[starts],
        s.src_offset[starts],
        s.dst_region[starts],
        s.dst_offset[starts],
        np.add.reduceat(s.length, starts),
    )


def cell_offsets_in_address_order(
    src: PagedView, dst: PagedView, token_start: int, token_end: int, num_heads: int
) -> tuple[np.ndarray, np.ndarray]:
    """Byte offsets (from each side's layer start) of every moved cell, in `src`'s address order.

    The order nests the canonical axes (plane, block, slot, head) by decreasing stride in `src`,
    with blocks in the request's token order, so any run contiguous in `src` appears as
    consecutive cells. Block lookups are done once per token; the per-cell work is broadcast
    additions.
    """
    bs = src.geometry.block_size
    first_block, num_chunks = _source_chunks(src, token_start, token_end)
    chunk_tokens = (
        src.token_shift
        + (first_block + np.arange(num_chunks, dtype=np.int64))[:, None] * bs
        + np.arange(bs, dtype=np.int64)[None, :]
    )  # [chunks, slots]: the tokens of each touched source block, in slot order
    valid = (chunk_tokens >= token_start) & (chunk_tokens < token_end)
    tokens = np.clip(chunk_tokens, token_start, token_end - 1)
    src_off, dst_off, _ = _offsets_in_address_order(src, dst, tokens, valid, num_heads)
    return src_off, dst_off


def slot_run_offsets_in_address_order(
    src: PagedView, dst: PagedView, token_start: int, token_end: int, num_heads: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Like `cell_offsets_in_address_order`, with each head's consecutive slots in one source
    block and one destination block listed as one piece: (source offsets, destination offsets,
    tokens per piece). O(blocks) pieces instead of O(tokens) cells.

    None unless both sides keep a head's consecutive slots contiguous (slot stride `head_dim`:
    HND, MLA, NHD with one head) and slots are the innermost axis of `src`'s address order,
    so that a piece's cells are consecutive cells of `cell_offsets_in_address_order`.
    """
    head_dim = src.geometry.head_dim
    if not src.geometry.strides[2] == head_dim == dst.geometry.strides[2]:
        return None
    first_block, num_chunks = _source_chunks(src, token_start, token_end)
    sizes = {"plane": src.geometry.num_planes, "chunk": num_chunks, "head": num_heads}
    order = _address_order(src)
    if any(sizes[axis] > 1 for axis in order[order.index("slot") + 1 :]):
        return None
    bs, dst_bs = src.geometry.block_size, dst.geometry.block_size
    chunk_start = src.token_shift + (first_block + np.arange(num_chunks, dtype=np.int64)) * bs
    lo = np.maximum(chunk_start, token_start)
    hi = np.minimum(chunk_start + bs, token_end)
    # A source block's tokens split where destination blocks start inside it.
    next_dst = dst.token_shift + ((lo - dst.token_shift) // dst_bs + 1) * dst_bs
    count = 1 + np.maximum(0, -((next_dst - hi) // dst_bs))  # pieces per source block
    j = np.arange(int(count.max()), dtype=np.int64)[None, :]
    starts = np.where(j == 0, lo[:, None], next_dst[:, None] + (j - 1) * dst_bs)
    ends = np.minimum(next_dst[:, None] + j * dst_bs, hi[:, None])
    valid = j < count[:, None]
    starts = np.where(valid, starts, lo[:, None])
    src_off, dst_off, tokens = _offsets_in_address_order(
        src, dst, starts, valid, num_heads, ends - starts
    )
    assert tokens is not None
    return src_off, dst_off, tokens


def _source_chunks(src: PagedView, token_start: int, token_end: int) -> tuple[int, int]:
    """(first source block, number of source blocks) that hold tokens `[start, end)`."""
    bs = src.geometry.block_size
    first_block = (token_start - src.token_shift) // bs
    last_block = (token_end - 1 - src.token_shift) // bs
    return first_block, last_block - first_block + 1


def _address_order(src: PagedView) -> list[str]:
    """The canonical axes by decreasing stride in `src`."""
    stride = dict(zip(_AXES, src.geometry.strides, strict=True))
    # A stable sort keeps the canonical order for ties (size-1 axes, MLA's zero strides).
    # Blocks always come before slots: a block holds its slots.
    return sorted(_AXES, key=lambda axis: -stride[axis])


def _offsets_in_address_order(
    src: PagedView,
    dst: PagedView,
    tokens: np.ndarray,
    valid: np.ndarray,
    num_heads: int,
    per_token: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Byte offsets of the cells of `tokens` (`[source block, k]`, the entries where `valid`)
    for every plane and moved head, in `src`'s address order, with `per_token` alongside."""
    order = _address_order(src)
    planes = np.arange(src.geometry.num_planes, dtype=np.int64)
    heads = np.arange(num_heads, dtype=np.int64)

    def on_axes(values: np.ndarray, *axes: str) -> np.ndarray:
        shape = [1] * 4
        for axis, size in zip(axes, values.shape, strict=True):
            shape[order.index(axis)] = size
        return values.reshape(shape)

    offsets = []
    for view in (src, dst):
        s_plane, s_block, s_slot, s_head = view.geometry.strides
        block, slot = view.token_cells(tokens)
        elements = (
            on_axes(planes * s_plane, "plane")
            + on_axes(block * s_block + slot * s_slot, "chunk", "slot")
            + on_axes((view.head_offset + heads) * s_head, "head")
        )
        offsets.append(elements * view.geometry.itemsize)
    src_off, dst_off = np.broadcast_arrays(*offsets)
    extra = None
    if per_token is not None:
        extra = np.broadcast_to(on_axes(per_token, "chunk", "slot"), src_off.shape)
    if valid.all():
        flat = None if extra is None else extra.reshape(-1)
        return src_off.reshape(-1), dst_off.reshape(-1), flat
    keep = np.broadcast_to(on_axes(valid, "chunk", "slot"), src_off.shape)
    return src_off[keep], dst_off[keep], None if extra is None else extra[keep]


@dataclass(frozen=True)
class LayerTemplate:
    """The coalesced segments of one layer, offsets relative to each side's layer base."""

    src_offset: np.ndarray
    dst_offset: np.ndarray
    length: np.ndarray

    def __len__(self) -> int:
        return int(self.length.shape[0])


def _empty_template() -> LayerTemplate:
    z = np.zeros(0, dtype=np.int64)
    return LayerTemplate(z, z, z)


def layer_template(
    src: PagedView, dst: PagedView, num_heads: int, token_start: int, token_end: int
) -> LayerTemplate:
    """Segments that copy one layer's cells of tokens `[token_start, token_end)` and `num_heads`
    heads from `src` to `dst`, with contiguous runs merged.

    The cheapest listing that applies, all giving the same segments as
    `enumerated_layer_template`: a copy between staging buffers laid out the same costs the
    same for any number of tokens (`staging_copy_template`); where both sides keep a head's
    slots contiguous, one piece per block and head is listed (`slot_run_layer_template`);
    otherwise every cell is.
    """
    if token_end <= token_start:
        return _empty_template()
    for shortcut in (staging_copy_template, slot_run_layer_template):
        template = shortcut(src, dst, num_heads, token_start, token_end)
        if template is not None:
            return template
    return enumerated_layer_template(src, dst, num_heads, token_start, token_end)


def slot_run_layer_template(
    src: PagedView, dst: PagedView, num_heads: int, token_start: int, token_end: int
) -> LayerTemplate | None:
    """`layer_template` from the pieces of `slot_run_offsets_in_address_order` (O(blocks *
    heads) work); None when they do not apply."""
    pieces = slot_run_offsets_in_address_order(src, dst, token_start, token_end, num_heads)
    if pieces is None:
        return None
    src_off, dst_off, tokens = pieces
    length = tokens * (src.geometry.head_dim * src.geometry.itemsize)
    continues = (src_off[1:] == src_off[:-1] + length[:-1]) & (
        dst_off[1:] == dst_off[:-1] + length[:-1]
    )
    starts = np.flatnonzero(np.concatenate(([True], ~continues)))
    return LayerTemplate(src_off[starts], dst_off[starts], np.add.reduceat(length, starts))


def enumerated_layer_template(
    src: PagedView, dst: PagedView, num_heads: int, token_start: int, token_end: int
) -> LayerTemplate:
    """`layer_template` for any two buffers: every moved cell listed in `src`'s address order,
    then runs that continue on both sides merged."""
    if token_end <= token_start:
        return _empty_template()
    head_dim = src.geometry.head_dim
    # Where both sides keep a token's heads side by side (NHD, the wire layout), the moved
    # heads of one token form one cell: 1/num_heads of the cells to enumerate.
    fuse_heads = src.geometry.strides[3] == head_dim == dst.geometry.strides[3]
    cell_heads = 1 if fuse_heads else num_heads
    src_off, dst_off = cell_offsets_in_address_order(src, dst, token_start, token_end, cell_heads)
    unit = head_dim * src.geometry.itemsize * (num_heads if fuse_heads else 1)
    continues = (np.diff(src_off) == unit) & (np.diff(dst_off) == unit)
    starts = np.flatnonzero(np.concatenate(([True], ~continues)))
    lengths = np.diff(np.append(starts, src_off.shape[0])) * unit
    return LayerTemplate(src_off[starts], dst_off[starts], lengths)


def staging_copy_template(
    src: PagedView, dst: PagedView, num_heads: int, token_start: int, token_end: int
) -> LayerTemplate | None:
    """`layer_template` of a copy between two staging buffers laid out the same, without
    enumerating the moved cells; None when the copy is not one.

    It applies when both views share their geometry, token shift and block table (the same
    array: staging buffers number their blocks from 0, `PagedView`), the copy moves every head
    the buffer holds, and the moved tokens reach into the buffer's first and last block. Then
    every cell keeps its offset and the segments are the layer's bytes less the cells of the
    positions before `token_start` in the first block and from `token_end` on in the last
    block: at most `2 * (block_size - 1)` positions, whatever the number of tokens. Nothing
    outside the moved cells is ever listed (a staging buffer may hold another request's bytes
    there). Work: O(planes * heads * block_size), independent of the token count.
    """
    g = src.geometry
    if not (
        src.region == dst.region == "staging"
        and src.block_ids is dst.block_ids
        and src.geometry == dst.geometry
        and src.token_shift == dst.token_shift
        and src.head_offset == dst.head_offset == 0
        and num_heads == g.num_heads
        and src.block_ids.shape == (g.num_blocks,)
    ):
        return None
    bs, capacity = g.block_size, g.num_blocks * g.block_size
    lo, hi = token_start - src.token_shift, token_end - src.token_shift
    if not (0 <= lo < bs and capacity - bs < hi <= capacity and lo < hi):
        return None
    layer_bytes = g.layer_bytes
    if lo == 0 and hi == capacity:  # exact coverage: the whole layer is one run
        whole = np.array([0], dtype=np.int64)
        return LayerTemplate(whole, whole, np.array([layer_bytes], dtype=np.int64))
    # The cells of the unwritten positions (holes), in address order: the buffer's cells tile
    # the layer, so the runs are the gaps between holes.
    unwritten = np.concatenate(
        (np.arange(lo, dtype=np.int64), np.arange(hi, capacity, dtype=np.int64))
    )
    s_plane, s_block, s_slot, s_head = g.strides
    position = unwritten // bs * s_block + unwritten % bs * s_slot
    planes = np.arange(g.num_planes, dtype=np.int64) * s_plane
    heads = np.arange(g.num_heads, dtype=np.int64) * s_head
    elements = planes[:, None, None] + position[None, :, None] + heads[None, None, :]
    hole_start = np.sort(elements.reshape(-1)) * g.itemsize
    hole_end = hole_start + g.head_dim * g.itemsize
    run_start = np.concatenate(([0], hole_end))
    run_end = np.concatenate((hole_start, [layer_bytes]))
    keep = run_end > run_start
    run_start = run_start[keep]
    return LayerTemplate(run_start, run_start, run_end[keep] - run_start)


def _layer_bases(view: PagedView, num_layers: int) -> tuple[np.ndarray, np.ndarray]:
    """(region key, byte offset) of every layer, as `view.layer_base` gives them: a layer's
    region key and base step by the same amount from one layer to the next (a region per
    layer, or the layers back to back in one region), so two calls give all of them."""
    key0, base0 = view.layer_base(0)
    if num_layers < 2:
        return np.full(num_layers, key0, dtype=np.int64), np.full(num_layers, base0, np.int64)
    key1, base1 = view.layer_base(1)
    layers = np.arange(num_layers, dtype=np.int64)
    return key0 + (key1 - key0) * layers, base0 + (base1 - base0) * layers


def expand_layers(
    template: LayerTemplate, src: PagedView, dst: PagedView, num_layers: int
) -> Segments:
    """Every layer's segments, coalesced across layer boundaries where buffers allow it."""
    m = len(template)
    src_key, src_base = _layer_bases(src, num_layers)
    dst_key, dst_base = _layer_bases(dst, num_layers)
    if m == 1 and _layer_merges(template, src_key, src_base, dst_key, dst_base).all():
        # One run per layer, each continuing the last (a staging buffer sent whole): one run.
        return Segments(
            src_key[:1].copy(),
            src_base[:1] + template.src_offset,
            dst_key[:1].copy(),
            dst_base[:1] + template.dst_offset,
            template.length * num_layers,
        )
    segments = Segments(
        np.repeat(src_key, m),
        (src_base[:, None] + template.src_offset[None, :]).reshape(-1),
        np.repeat(dst_key, m),
        (dst_base[:, None] + template.dst_offset[None, :]).reshape(-1),
        np.repeat(template.length[None, :], num_layers, axis=0).reshape(-1),
    )
    if m < 2:  # a run per layer: the layers may chain into longer runs
        return coalesce(segments)
    # A template is coalesced already, so only a layer's last segment and the next layer's
    # first can merge (what `coalesce` would find, without comparing every segment).
    merges = _layer_merges(template, src_key, src_base, dst_key, dst_base)
    if not merges.any():
        return segments
    boundary = np.flatnonzero(merges) * m + m  # the first segment of each merging layer
    length = segments.length
    length[boundary - 1] += template.length[0]
    keep = np.ones(len(segments), dtype=bool)
    keep[boundary] = False
    return Segments(
        segments.src_region[keep],
        segments.src_offset[keep],
        segments.dst_region[keep],
        segments.dst_offset[keep],
        length[keep],
    )


def _layer_merges(
    template: LayerTemplate,
    src_key: np.ndarray,
    src_base: np.ndarray,
    dst_key: np.ndarray,
    dst_base: np.ndarray,
) -> np.ndarray:
    """Whether the first segment of each layer after the first continues, on both sides, the
    last segment of the layer before it (a template's own segments never continue each
    other)."""
    src_end = template.src_offset[-1] + template.length[-1]
    dst_end = template.dst_offset[-1] + template.length[-1]
    return (
        (src_key[1:] == src_key[:-1])
        & (dst_key[1:] == dst_key[:-1])
        & (src_base[:-1] + src_end == src_base[1:] + template.src_offset[0])
        & (dst_base[:-1] + dst_end == dst_base[1:] + template.dst_offset[0])
    )


def count_segments(template: LayerTemplate, src: PagedView, dst: PagedView, num_layers: int) -> int:
    """`len(expand_layers(...))` without materializing it: only layer boundaries can merge."""
    m = len(template)
    if m == 0:
        return 0
    src_key, src_base = _layer_bases(src, num_layers)
    dst_key, dst_base = _layer_bases(dst, num_layers)
    merges = _layer_merges(template, src_key, src_base, dst_key, dst_base)
    return m * num_layers - int(merges.sum())
