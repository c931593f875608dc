"""`LocalTransport`: executes segment lists as in-process memory copies.

It runs exactly the segment lists a network transport would send, so `reshard` exercises the
same plans as the connectors. Segments of equal length are copied together with one indexed
gather/scatter per group, using the widest integer word that divides every offset and length.
"""

from __future__ import annotations

import itertools
import math
from concurrent.futures import Future

import numpy as np
import torch

from kvxfer.plan.segments import Segments
from kvxfer.transport.base import (
    Peer,
    Region,
    check_segments_in_regions,
    completed,
    tensor_memory,
)

_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
# Above this many words per segment, one slice copy per segment (memcpy) beats index arithmetic.
_SLICE_COPY_WORDS = 4096
# Caps the index tensors of one vectorized copy (8 bytes per word copied).
_MAX_WORDS_PER_BATCH = 1 << 22


class LocalTransport:
    """In-process transport over CPU or same-device tensors."""

    endpoint = "local"

    def __init__(self) -> None:
        self._bytes: dict[int, torch.Tensor] = {}
        self._regions: dict[int, Region] = {}
        self._ids = itertools.count()

    def peer(self) -> Peer:
        """This transport as the destination of writes (in-process: its own regions)."""
        return Peer(self.endpoint, dict(self._regions))

    def register(self, tensor: torch.Tensor) -> Region:
        """Register the memory a tensor spans (`tensor_memory`) and return its region."""
        memory = tensor_memory(tensor)
        region_id = next(self._ids)
        self._bytes[region_id] = memory
        region = Region(region_id, memory.data_ptr(), memory.numel())
        self._regions[region_id] = region
        return region

    def unregister(self, region: Region) -> None:
        """Forget a region."""
        self._bytes.pop(region.region_id, None)
        self._regions.pop(region.region_id, None)

    def submit(self, segments: Segments, peer: Peer) -> Future[None]:
        """Copy now; return a completed future (failed with the error, if any)."""
        try:
            self.write(segments, peer)
        except Exception as exc:  # handed to the caller through the future
            return completed(exc)
        return completed()

    def read(self, segments: Segments, peer: Peer) -> Future[None]:
        """Copy now, from the peer's regions (in-process: this transport's own) into local
        ones; return a completed future (failed with the error, if any)."""
        return self.submit(segments, peer)

    def close(self) -> None:
        """Forget every region."""
        self._bytes.clear()
        self._regions.clear()

    def write(self, segments: Segments, peer: Peer, timeout: float | None = None) -> None:
        """Copy every segment; all are bounds-checked before the first byte moves. In-process
        copies are synchronous, so `timeout` has nothing to bound.

        `peer` must be this transport's own `peer()` view: in-process, every region is local.
        """
        if peer.endpoint != self.endpoint:
            raise ValueError(f"peer: LocalTransport writes in-process only, got {peer.endpoint!r}")
        check_segments_in_regions(segments, self._regions, peer.regions)
        if len(segments) == 0:
            return
        keys = np.stack([segments.src_region, segments.dst_region, segments.length], axis=1)
        groups, inverse = np.unique(keys, axis=0, return_inverse=True)
        inverse = inverse.reshape(-1)
        for g, (src_id, dst_id, length) in enumerate(groups):
            members = np.flatnonzero(inverse == g)
            self._copy_group(
                int(src_id),
                segments.src_offset[members],
                int(dst_id),
                segments.dst_offset[members],
                int(length),
            )

    def _copy_group(
        self,
        src_id: int,
        src_offsets: np.ndarray,
        dst_id: int,
        dst_offsets: np.ndarray,
        length: int,
    ) -> None:
        src, dst = self._bytes[src_id], self._bytes[dst_id]
        word = _word_size(length, src_offsets, dst_offsets, src, dst)
        src_w, dst_w = src.view(_WORD_DTYPES[word]), dst.view(_WORD_DTYPES[word])
        n = length // word
        if n >= _SLICE_COPY_WORDS:
            for s, d in zip(
                (src_offsets // word).tolist(), (dst_offsets // word).tolist(), strict=True
            ):
                dst_w[d : d + n].copy_(src_w[s : s + n])
            return
        lane = torch.arange(n, dtype=torch.int64)
        rows = max(1, _MAX_WORDS_PER_BATCH // n)
        for i in range(0, len(src_offsets), rows):
            s = torch.from_numpy(src_offsets[i : i + rows] // word)[:, None] + lane
            d = torch.from_numpy(dst_offsets[i : i + rows] // word)[:, None] + lane
            dst_w[d.reshape(-1)] = src_w[s.reshape(-1)]


def _word_size(
    length: int,
    src_offsets: np.ndarray,
    dst_offsets: np.ndarray,
    src: torch.Tensor,
    dst: torch.Tensor,
) -> int:
    # A word view needs every offset, length, region size and storage offset to be a multiple.
    common = math.gcd(
        length,
        src.numel(),
        dst.numel(),
        src.storage_offset(),
        dst.storage_offset(),
        int(np.gcd.reduce(src_offsets)),
        int(np.gcd.reduce(dst_offsets)),
    )
    return next(w for w in (8, 4, 2, 1) if common % w == 0)
