"""What every transport offers: registered regions and batched, bounds-checked segment reads and
writes, settling under the no-late-byte contract."""

from __future__ import annotations

import abc
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Literal, Protocol, Self

import numpy as np
import torch

from kvxfer.plan.segments import Segments

Direction = Literal["read", "write"]


class TransferError(RuntimeError):
    """A write failed; nothing about the destination bytes of the batch is guaranteed."""


@dataclass(frozen=True)
class Region:
    """A registered memory range that segments may read from or write to."""

    region_id: int
    address: int
    nbytes: int


@dataclass(frozen=True)
class Peer:
    """Where segments go: a transport endpoint and the regions registered there, by id."""

    endpoint: str
    regions: Mapping[int, Region]


@dataclass(frozen=True)
class CheckedTransfer:
    """A transfer every segment of which lies inside its source and destination regions
    (`check_segments_in_regions`); one side's regions are local, the other's the peer's, as
    `direction` says."""

    direction: Direction
    segments: Segments
    peer: Peer
    src_regions: Mapping[int, Region]
    dst_regions: Mapping[int, Region]


class Transport(Protocol):
    """Moves byte segments between local registered regions and a peer's.

    What a connector needs of a transport, whatever moves the bytes; a new transport is one
    module implementing this and one entry in `kvxfer.transport.factory.KINDS`. `endpoint` is
    opaque: a peer learns it in the handshake and hands it back in `Peer`, and only a transport
    of the same `kind` reads it (`factory.check_peer_endpoint`).

    The no-late-byte contract: a transfer's future settles once every segment has landed or
    failed, and after that nothing of it lands any more, whatever the peer does
    (tests/transport/test_contract.py checks every kind).
    """

    kind: str
    """The transport's name in `kvxfer.transport.factory.KINDS` (the `transport` setting)."""
    endpoint: str
    """Where peers reach this transport; opaque to everything but transports of its kind."""
    driven: bool
    """Whether transfers move only when the owner calls `drive`, on the owner's thread."""
    protocol: str
    """What carries the bytes, for stats and logs: Mooncake's protocol in use ("tcp" after an
    RDMA fallback), the kind's name where a kind has one way only ("local")."""

    def register(self, tensor: torch.Tensor) -> Region:
        """Register a contiguous tensor's memory and return its region."""
        ...

    def unregister(self, region: Region) -> None:
        """Forget a region; segments may no longer name it."""
        ...

    def submit(self, segments: Segments, peer: Peer) -> Future[None]:
        """Start writing `segments` (local source ids, peer destination ids); the future fails
        with `TransferError`. Raises `TransferError` at once for a segment outside a region."""
        ...

    def read(self, segments: Segments, peer: Peer) -> Future[None]:
        """Start reading `segments` (peer source ids, local destination ids); the future
        completes once every segment has settled, and fails with `TransferError`. Raises
        `TransferError` at once for a segment outside a region."""
        ...

    def write(self, segments: Segments, peer: Peer, timeout: float | None = None) -> None:
        """Write `segments` and wait up to `timeout` seconds; raise `TransferError` on failure
        or timeout."""
        ...

    def drive(self) -> float | None:
        """(a driven transport's owner, every turn) Move transfers on; the seconds until the
        owner should turn again, or None when nothing is in flight."""
        ...

    def in_flight(self, endpoint: str | None = None) -> int:
        """Transfers (or their segments) started and not settled, for one peer or all."""
        ...

    def close(self) -> None:
        """Release the transport's resources; transfers not settled fail."""
        ...


class TransportBase(abc.ABC):
    """What every transport does alike: it registers a tensor's whole memory, checks every
    segment against both sides' regions before anything moves, writes blocking, and closes as
    a context manager. A transport brings its own registration, region table and start of a
    checked transfer."""

    def register(self, tensor: torch.Tensor) -> Region:
        """Register the memory a tensor spans (`tensor_memory`) and return its region.

        Raises:
            ValueError: a tensor whose memory is not one range (`tensor_memory`).
            TransferError: the transport refused the memory, or is closed.
        """
        return self._register_memory(tensor_memory(tensor))

    def submit(self, segments: Segments, peer: Peer) -> Future[None]:
        """Write `segments` from local regions into the peer's, in the background.

        Raises:
            TransferError: a segment outside a region (nothing is written then), or a closed
                transport.
        """
        local = self._live_regions()
        check_segments_in_regions(segments, local, peer.regions)
        return self._start(CheckedTransfer("write", segments, peer, local, peer.regions))

    def read(self, segments: Segments, peer: Peer) -> Future[None]:
        """Read `segments` from the peer's regions (sources) into local regions
        (destinations), in the background. The future completes once every segment has
        settled (landed or failed): after that, nothing of this read can land any more,
        whatever the peer does.

        Raises:
            TransferError: a segment outside a region (nothing is read then), or a closed
                transport.
        """
        local = self._live_regions()
        check_segments_in_regions(segments, peer.regions, local)
        return self._start(CheckedTransfer("read", segments, peer, peer.regions, local))

    @abc.abstractmethod
    def _register_memory(self, memory: torch.Tensor) -> Region:
        """Register one flat uint8 range of memory (`tensor_memory`'s) as a new region."""

    @abc.abstractmethod
    def _live_regions(self) -> dict[int, Region]:
        """The local regions now, by id; raises `TransferError` once the transport is closed."""

    @abc.abstractmethod
    def _start(self, transfer: CheckedTransfer) -> Future[None]:
        """Start moving a transfer whose segments were checked against its regions."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the transport's resources; transfers not settled fail."""

    def write(self, segments: Segments, peer: Peer, timeout: float | None = None) -> None:
        """Write and wait up to `timeout` seconds. A transport its owner's loop drives must not
        be waited on from that loop's thread (nothing would drive the write).

        Raises:
            TransferError: the write failed, or did not finish in time (the transfer may still
                complete: a transfer in flight has no cancel).
        """
        try:
            self.submit(segments, peer).result(timeout)
        except TimeoutError as exc:
            raise TransferError(
                f"write of {len(segments)} segments to {peer.endpoint} did not finish in "
                f"{timeout} s"
            ) from exc

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_segments_in_regions(
    segments: Segments, src_regions: Mapping[int, Region], dst_regions: Mapping[int, Region]
) -> None:
    """Check that every segment lies inside its source and destination regions.

    Raises:
        TransferError: naming the first offending segment and region.
    """
    for side, regions, offsets, table in (
        ("source", segments.src_region, segments.src_offset, src_regions),
        ("destination", segments.dst_region, segments.dst_offset, dst_regions),
    ):
        limit = _region_limits(side, regions, table)
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


def _region_limits(side: str, regions: np.ndarray, table: Mapping[int, Region]) -> np.ndarray:
    """Each segment's region size, in bytes.

    Raises:
        TransferError: a region that is not registered.
    """
    first = int(regions[0]) if regions.size else None
    if first is not None and bool((regions == first).all()):  # one region: most reads
        if first not in table:
            raise TransferError(f"{side} region(s) [{first}] are not registered")
        return np.full(regions.shape, table[first].nbytes, dtype=np.int64)
    unknown = sorted({int(r) for r in np.unique(regions)} - set(table))
    if unknown:
        raise TransferError(f"{side} region(s) {unknown} are not registered")
    if not regions.size:
        return np.zeros(0, dtype=np.int64)
    ids = np.asarray(sorted(table), dtype=np.int64)
    limits = np.asarray([table[int(i)].nbytes for i in ids], dtype=np.int64)
    return limits[np.searchsorted(ids, regions)]


def tensor_memory(tensor: torch.Tensor) -> torch.Tensor:
    """The memory a tensor spans, from its first element to the end of its last, as a flat
    uint8 view: the tensor's own bytes when it is contiguous, the gaps between its blocks too
    when it is a view with a wider outer stride (`KVCacheSpec.block_stride`).

    Raises:
        ValueError: an empty tensor, or one that is neither contiguous nor contiguous within
            its outermost axis with that axis's items apart (a transposed view, say).
    """
    if tensor.numel() == 0:
        raise ValueError("tensor: empty; register a tensor with at least one element")
    if tensor.is_contiguous():
        return tensor.reshape(-1).view(torch.uint8)
    if not (
        tensor.dim() > 1 and tensor[0].is_contiguous() and tensor.stride(0) >= tensor[0].numel()
    ):
        raise ValueError(
            f"tensor: must be contiguous to be registered (or contiguous within its outermost "
            f"axis, as a layer view with block_stride), got strides {tensor.stride()}; call "
            ".contiguous()"
        )
    span = 1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True))
    flat = tensor.as_strided((span,), (1,))
    return flat.view(torch.uint8)
