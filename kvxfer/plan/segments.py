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

    def with_regions(self, src_ids: dict[int, int], dst_ids: dict[int, int]) -> Segments:
        """Replace region keys by the ids a transport registered them under."""
        return Segments(
            _map_keys(self.src_region, src_ids),
            self.src_offset,
            _map_keys(self.dst_region, dst_ids),
            self.dst_offset,
            self.length,
        )

    @classmethod
    def empty(cls) -> Segments:
        """No segments."""
        z = np.zeros(0, dtype=np.int64)
        return cls(z, z, z, z, z)


def _map_keys(keys: np.ndarray, table: dict[int, int]) -> np.ndarray:
    known = np.asarray(sorted(table), dtype=np.int64)
    ids = np.asarray([table[int(k)] for k in known], dtype=np.int64)
    pos = np.minimum(np.searchsorted(known, keys), max(len(known) - 1, 0))
    found = known[pos] == keys if len(known) else np.zeros(keys.shape, dtype=bool)
    if not found.all():
        missing = sorted({int(k) for k in keys[~found]})
        raise KeyError(f"no registered region for region keys {missing}")
    return ids[pos]


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


def cells_in_address_order(
    view: PagedView, token_start: int, token_end: int, num_heads: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(plane, token, head) of every moved cell, ordered as they lie in `view`'s memory.

    The order nests the canonical axes by decreasing stride (blocks follow the request's token
    order), so any run that is contiguous in `view` appears as consecutive cells.
    """
    g = view.geometry
    bs = g.block_size
    first_block = (token_start - view.token_shift) // bs
    last_block = (token_end - 1 - view.token_shift) // bs
    sizes = {
        "plane": g.num_planes,
        "chunk": last_block - first_block + 1,
        "slot": bs,
        "head": num_heads,
    }
    stride = dict(zip(_AXES, g.strides, strict=True))
    # A stable sort keeps the canonical order for ties (size-1 axes, MLA's zero strides).
    order = sorted(_AXES, key=lambda axis: -stride[axis])
    grid = np.indices([sizes[a] for a in order], dtype=np.int64).reshape(4, -1)
    axis = dict(zip(order, grid, strict=True))
    token = view.token_shift + (first_block + axis["chunk"]) * bs + axis["slot"]
    keep = (token >= token_start) & (token < token_end)
    return axis["plane"][keep], token[keep], axis["head"][keep]


def cell_byte_offsets(
    view: PagedView, plane: np.ndarray, token: np.ndarray, head: np.ndarray
) -> np.ndarray:
    """Byte offset of each cell from the start of its layer."""
    g = view.geometry
    block, slot = view.token_cells(token)
    s_plane, s_block, s_slot, s_head = g.strides
    elements = (
        plane * s_plane + block * s_block + slot * s_slot + (view.head_offset + head) * s_head
    )
    return elements * g.itemsize


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
    plane, token, head = cells_in_address_order(src, token_start, token_end, num_heads)
    src_off = cell_byte_offsets(src, plane, token, head)
    dst_off = cell_byte_offsets(dst, plane, token, head)
    unit = src.geometry.head_dim * src.geometry.itemsize
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
