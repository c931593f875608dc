"""What every transport offers: registered regions and batched segment writes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from kvxfer.plan.segments import Segments


class TransferError(RuntimeError):
    """A write failed; nothing about the destination bytes of the batch is guaranteed."""


@dataclass(frozen=True)
class Region:
    """A registered memory range that segments may read from or write to."""

    region_id: int
    address: int
    nbytes: int


class Transport(Protocol):
    """Moves byte segments between registered regions."""

    def register(self, tensor: torch.Tensor) -> Region:
        """Register a contiguous tensor's memory and return its region."""
        ...

    def unregister(self, region: Region) -> None:
        """Forget a region; segments may no longer name it."""
        ...

    def write(self, segments: Segments) -> None:
        """Copy every segment (region ids, not keys); raise `TransferError` on failure."""
        ...


def check_segments_in_regions(
    segments: Segments, src_sizes: dict[int, int], dst_sizes: dict[int, int]
) -> None:
    """Check that every segment lies inside its registered source and destination regions.

    Raises:
        TransferError: naming the first offending segment and region.
    """
    for side, regions, offsets, sizes in (
        ("source", segments.src_region, segments.src_offset, src_sizes),
        ("destination", segments.dst_region, segments.dst_offset, dst_sizes),
    ):
        unknown = sorted({int(r) for r in np.unique(regions)} - set(sizes))
        if unknown:
            raise TransferError(f"{side} region(s) {unknown} are not registered")
        ids = np.asarray(sorted(sizes), dtype=np.int64)
        limits = np.asarray([sizes[int(i)] for i in ids], dtype=np.int64)
        limit = limits[np.searchsorted(ids, regions)]
        bad = np.flatnonzero(
            (offsets < 0) | (segments.length <= 0) | (offsets + segments.length > limit)
        )
        if bad.size:
            i = int(bad[0])
            raise TransferError(
                f"segment {i} ({segments.length[i]} bytes at {side} offset {offsets[i]}) does "
                f"not lie inside {side} region {regions[i]} of {limit[i]} bytes "
                f"({bad.size} such segments)"
            )
