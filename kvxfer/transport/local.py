"""`LocalTransport`: the in-process transport, segment lists executed as memory copies.

It runs exactly the segment lists a network transport would send. `reshard` copies within one
`LocalTransport` (its own `peer()`); a producer and a consumer in one process each hold their
own and reach each other by endpoint, as over a network, so connector tests that need two
endpoints but none of Mooncake's behaviour run without Mooncake. An endpoint is
`local:<pid>:<n>`: live transports are found in a process-wide table, and an endpoint of another
process, or of a transport that was closed, fails the transfer with an error that says so.

The contract is the network transports' (`tests/transport/test_contract.py` runs it over every
kind): bounds are checked against the advertised regions before a byte moves, a future settles
once every byte has landed or the transfer failed, never with bytes still to come. A driven
transport copies on its owner's `drive`, as a consumer's loop drives Mooncake's reads; otherwise
it copies at once, on the caller's thread.

Segments of equal length are copied together with one indexed gather/scatter per group, using
the widest integer word that divides every offset and length.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
import weakref
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch

from kvxfer.plan.segments import Segments
from kvxfer.transport.base import (
    CheckedTransfer,
    Direction,
    Peer,
    Region,
    TransferError,
    TransportBase,
)

_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
# Above this many words per segment, one slice copy per segment (memcpy) beats index arithmetic.
_SLICE_COPY_WORDS = 4096
# Caps the index tensors of one vectorized copy (8 bytes per word copied).
_MAX_WORDS_PER_BATCH = 1 << 22

ENDPOINT_PREFIX = "local:"

_LIVE: weakref.WeakValueDictionary[str, LocalTransport] = weakref.WeakValueDictionary()
_LIVE_LOCK = threading.Lock()
_NUMBERS = itertools.count()


def check_local_endpoint(endpoint: object) -> str:
    """Check a `LocalTransport` endpoint: `"local:<pid>:<n>"`.

    Returns:
        The endpoint, unchanged.

    Raises:
        ValueError: anything else, naming the expected form.
    """
    parts = endpoint.split(":") if isinstance(endpoint, str) else []
    if len(parts) != 3 or parts[0] != "local" or not all(p.isdigit() for p in parts[1:]):
        raise ValueError(
            f"endpoint: {endpoint!r} is not a local transport's endpoint ('local:<pid>:<n>', "
            "the `endpoint` of a LocalTransport)"
        )
    return endpoint  # type: ignore[return-value]


@dataclass
class _Op:
    """A transfer a driven transport runs at its next `drive`."""

    segments: Segments
    peer: Peer
    direction: Direction
    future: Future[None]


class LocalTransport(TransportBase):
    """The in-process transport over CPU or same-device tensors.

    Args:
        driven: transfers wait for the owner's `drive` (on the owner's thread), as a driven
            `MooncakeTransport`'s do; otherwise each copies at once, on the caller's thread.
    """

    kind = "local"
    protocol = "local"

    def __init__(self, *, driven: bool = False) -> None:
        self.driven = driven
        self.endpoint = f"{ENDPOINT_PREFIX}{os.getpid()}:{next(_NUMBERS)}"
        self._bytes: dict[int, torch.Tensor] = {}
        self._regions: dict[int, Region] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._queued: deque[_Op] = deque()
        self._closed = False
        with _LIVE_LOCK:
            _LIVE[self.endpoint] = self

    @property
    def regions(self) -> dict[int, Region]:
        """Registered local regions by id."""
        with self._lock:
            return dict(self._regions)

    def peer(self) -> Peer:
        """This transport as the peer of its own transfers (every region local)."""
        return Peer(self.endpoint, self.regions)

    def _register_memory(self, memory: torch.Tensor) -> Region:
        with self._lock:
            self._check_open()
            region_id = next(self._ids)
            self._bytes[region_id] = memory
            region = Region(region_id, memory.data_ptr(), memory.numel())
            self._regions[region_id] = region
        return region

    def unregister(self, region: Region) -> None:
        """Forget a region."""
        with self._lock:
            self._bytes.pop(region.region_id, None)
            self._regions.pop(region.region_id, None)

    def drive(self) -> float | None:
        """(a driven transport's owner, every turn) Run every queued transfer.

        Returns:
            None: nothing is left in flight (each copy settles within its turn).
        """
        if not self.driven:
            raise TransferError("drive(): this transport is not driven")
        while True:
            with self._lock:
                if not self._queued:
                    return None
                op = self._queued.popleft()
            self._settle(op)

    def in_flight(self, endpoint: str | None = None) -> int:
        """Transfers queued for the next `drive` (for one peer, or all)."""
        with self._lock:
            return sum(1 for op in self._queued if endpoint in (None, op.peer.endpoint))

    def close(self) -> None:
        """Forget every region; transfers still queued fail, and peers' transfers from or to
        this transport fail from now on."""
        with _LIVE_LOCK:
            if _LIVE.get(self.endpoint) is self:
                del _LIVE[self.endpoint]
        with self._lock:
            self._closed = True
            self._bytes.clear()
            self._regions.clear()
            queued, self._queued = list(self._queued), deque()
        for op in queued:
            op.future.set_exception(TransferError("the transport was closed before it finished"))

    # ---- transfers -------------------------------------------------------------------------

    def _live_regions(self) -> dict[int, Region]:
        with self._lock:
            self._check_open()
            return dict(self._regions)

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("the transport is closed")

    def _start(self, transfer: CheckedTransfer) -> Future[None]:
        op = _Op(transfer.segments, transfer.peer, transfer.direction, Future())
        with self._lock:
            self._check_open()
            if self.driven:
                self._queued.append(op)
                return op.future
        self._settle(op)
        return op.future

    def _settle(self, op: _Op) -> None:
        try:
            self._copy(op)
        except TransferError as exc:
            op.future.set_exception(exc)
        else:
            op.future.set_result(None)

    def _copy(self, op: _Op) -> None:
        """Copy an op's segments, once every region they name is found on both sides."""
        other = self if op.peer.endpoint == self.endpoint else _live(op.peer.endpoint)
        reads = op.direction == "read"
        local_ids = op.segments.dst_region if reads else op.segments.src_region
        peer_ids = op.segments.src_region if reads else op.segments.dst_region
        mine, theirs = self._own(op, local_ids), other._reached(op, peer_ids)
        src, dst = (theirs, mine) if reads else (mine, theirs)
        _copy_segments(op.segments, src, dst)

    def _own(self, op: _Op, ids: np.ndarray) -> dict[int, torch.Tensor]:
        """The tensors of this transport's regions `ids` (its own ids).

        Raises:
            TransferError: a region that is not registered here (any more).
        """
        wanted = {int(i) for i in np.unique(ids)}
        with self._lock:
            self._check_open()
            missing = sorted(wanted - set(self._bytes))
            if missing:
                raise TransferError(
                    f"{op.direction} with {op.peer.endpoint}: local region(s) {missing} are "
                    "not registered any more"
                )
            return {i: self._bytes[i] for i in wanted}

    def _reached(self, op: _Op, ids: np.ndarray) -> dict[int, torch.Tensor]:
        """The memory a peer reaches here through the regions `ids` of its view (`op.peer`):
        each an address range that must lie inside one region registered here, as a network
        transport resolves a remote address.

        Raises:
            TransferError: a range inside no registered region (unregistered since, say).
        """
        found: dict[int, torch.Tensor] = {}
        with self._lock:
            self._check_peer_open(op)
            for i in {int(i) for i in np.unique(ids)}:
                want = op.peer.regions[i]
                for region_id, region in self._regions.items():
                    start = want.address - region.address
                    if start >= 0 and start + want.nbytes <= region.nbytes:
                        found[i] = self._bytes[region_id][start : start + want.nbytes]
                        break
                else:
                    raise TransferError(
                        f"{op.direction} with {self.endpoint}: {want.nbytes} bytes at "
                        f"{want.address:#x} are not within any region registered there"
                    )
        return found

    def _check_peer_open(self, op: _Op) -> None:
        if self._closed:
            raise TransferError(f"{op.direction} with {self.endpoint}: that transport is closed")


def _live(endpoint: str) -> LocalTransport:
    """The live transport at `endpoint` in this process.

    Raises:
        TransferError: none is (closed, or of another process), naming why.
    """
    with _LIVE_LOCK:
        found = _LIVE.get(endpoint)
    if found is not None:
        return found
    pid = endpoint.split(":")[1] if endpoint.startswith(ENDPOINT_PREFIX) else None
    if pid is not None and pid != str(os.getpid()):
        raise TransferError(
            f"peer {endpoint} is a local transport of process {pid}: a local transport reaches "
            f"peers in its own process ({os.getpid()}) only; use transport 'mooncake' between "
            "processes"
        )
    raise TransferError(f"peer {endpoint}: no live local transport there (closed?)")


def _copy_segments(
    segments: Segments, src: Mapping[int, torch.Tensor], dst: Mapping[int, torch.Tensor]
) -> None:
    if len(segments) == 0:
        return
    keys = np.stack([segments.src_region, segments.dst_region, segments.length], axis=1)
    groups, inverse = np.unique(keys, axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    for g, (src_id, dst_id, length) in enumerate(groups):
        members = np.flatnonzero(inverse == g)
        _copy_group(
            src[int(src_id)],
            segments.src_offset[members],
            dst[int(dst_id)],
            segments.dst_offset[members],
            int(length),
        )


def _copy_group(
    src: torch.Tensor,
    src_offsets: np.ndarray,
    dst: torch.Tensor,
    dst_offsets: np.ndarray,
    length: int,
) -> None:
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
