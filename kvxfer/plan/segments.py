"""Byte segments between two paged buffers, with contiguous runs coalesced.

All of it is numpy-vectorized: cells are enumerated once for one layer (a `LayerTemplate`), in
the source buffer's address order, and the other layers are the same template shifted by each
layer's base offset.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvxfer.plan.layout import PagedView

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
    g = src.geometry
    bs = g.block_size
    first_block = (token_start - src.token_shift) // bs
    last_block = (token_end - 1 - src.token_shift) // bs
    chunk_tokens = (
        src.token_shift
        + (first_block + np.arange(last_block - first_block + 1, dtype=np.int64))[:, None] * bs
        + np.arange(bs, dtype=np.int64)[None, :]
    )  # [chunks, slots]: the tokens of each touched source block, in slot order
    valid = (chunk_tokens >= token_start) & (chunk_tokens < token_end)
    tokens = np.clip(chunk_tokens, token_start, token_end - 1)

    stride = dict(zip(_AXES, g.strides, strict=True))
    # A stable sort keeps the canonical order for ties (size-1 axes, MLA's zero strides).
    # Blocks always come before slots: a block holds its slots.
    order = sorted(_AXES, key=lambda axis: -stride[axis])
    planes = np.arange(g.num_planes, dtype=np.int64)
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
    if valid.all():
        return src_off.reshape(-1), dst_off.reshape(-1)
    keep = np.broadcast_to(on_axes(valid, "chunk", "slot"), src_off.shape)
    return src_off[keep], dst_off[keep]


@dataclass(frozen=True)
class LayerTemplate:
    """The coalesced segments of one layer, offsets relative to each side's layer base."""

    src_offset: np.ndarray
    dst_offset: np.ndarray
    length: np.ndarray

    def __len__(self) -> int:
        return int(self.length.shape[0])


def layer_template(
    src: PagedView, dst: PagedView, num_heads: int, token_start: int, token_end: int
) -> LayerTemplate:
    """Segments that copy one layer's cells of tokens `[token_start, token_end)` and `num_heads`
    heads from `src` to `dst`, with contiguous runs merged."""
    if token_end <= token_start:
        z = np.zeros(0, dtype=np.int64)
        return LayerTemplate(z, z, z)
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


def _layer_bases(view: PagedView, num_layers: int) -> tuple[np.ndarray, np.ndarray]:
    keys, bases = zip(*(view.layer_base(layer) for layer in range(num_layers)), strict=True)
    return np.asarray(keys, dtype=np.int64), np.asarray(bases, dtype=np.int64)


def expand_layers(
    template: LayerTemplate, src: PagedView, dst: PagedView, num_layers: int
) -> Segments:
    """Every layer's segments, coalesced across layer boundaries where buffers allow it."""
    m = len(template)
    src_key, src_base = _layer_bases(src, num_layers)
    dst_key, dst_base = _layer_bases(dst, num_layers)
    segments = Segments(
        np.repeat(src_key, m),
        np.tile(template.src_offset, num_layers) + np.repeat(src_base, m),
        np.repeat(dst_key, m),
        np.tile(template.dst_offset, num_layers) + np.repeat(dst_base, m),
        np.tile(template.length, num_layers),
    )
    return coalesce(segments)


def count_segments(template: LayerTemplate, src: PagedView, dst: PagedView, num_layers: int) -> int:
    """`len(expand_layers(...))` without materializing it: only layer boundaries can merge."""
    m = len(template)
    if m == 0:
        return 0
    src_key, src_base = _layer_bases(src, num_layers)
    dst_key, dst_base = _layer_bases(dst, num_layers)
    src_end = template.src_offset[-1] + template.length[-1]
    dst_end = template.dst_offset[-1] + template.length[-1]
    merges = (
        (src_key[1:] == src_key[:-1])
        & (dst_key[1:] == dst_key[:-1])
        & (src_base[:-1] + src_end == src_base[1:] + template.src_offset[0])
        & (dst_base[:-1] + dst_end == dst_base[1:] + template.dst_offset[0])
    )
    return m * num_layers - int(merges.sum())
