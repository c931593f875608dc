"""`MooncakeTransport`: segment writes through Mooncake Transfer Engine, peer to peer.

The engine runs in P2P-handshake mode (no metadata server): a peer is addressed as
`host:rpc_port`, both sides register their memory, and one write must lie inside one registered
buffer on each side. TCP by default; RDMA when `protocol="rdma"` and a NIC is present.

Measured with the non-CUDA wheel 0.3.13 on TCP loopback (2-core machine): a batch of more than
about 2,048 descriptors, or several batches in flight whose descriptors add up to that, fails
with -1 *and leaves the engine failing every later write*. Writes therefore go out in batches of
at most `MAX_BATCH` descriptors, one batch in flight per engine, submitted by one worker thread.
One descriptor costs about 45 us there, whatever its size up to 16 KiB.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import numpy as np
import torch

from kvxfer.plan.segments import Segments
from kvxfer.transport.base import Peer, Region, TransferError, check_segments_in_regions

log = logging.getLogger(__name__)

MAX_BATCH = 1024


def _engine_class() -> type:
    # Mooncake's native logging (glog) is verbose at INFO; keep warnings and errors unless the
    # user chose a level.
    os.environ.setdefault("GLOG_minloglevel", "1")
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise ImportError(
            "MooncakeTransport needs Mooncake Transfer Engine: pip install "
            "'kvxfer[mooncake]' on CUDA machines or 'kvxfer[mooncake-cpu]' elsewhere "
            f"(both need the system's libibverbs) ({exc})"
        ) from exc
    return TransferEngine


def _new_engine(host: str, protocol: str, device: str) -> tuple[Any, str]:
    """An initialized engine and its endpoint (host:rpc_port)."""
    engine = _engine_class()()
    code = engine.initialize(host, "P2PHANDSHAKE", protocol, device)
    if code != 0:
        raise TransferError(
            f"Mooncake initialize({host!r}, protocol={protocol!r}) returned {code}; check "
            "that the host address is local and, for rdma, that a NIC is present"
        )
    return engine, f"{host}:{engine.get_rpc_port()}"


class MooncakeTransport:
    """One Mooncake TransferEngine: registers local memory, writes to peers' memory.

    Args:
        host: the address peers reach this engine at (127.0.0.1 by default).
        protocol: "tcp" (default) or "rdma".
        device: RDMA device filter ("" = all).
    """

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp", device: str = "") -> None:
        self._engine, self.endpoint = _new_engine(host, protocol, device)
        self.protocol = protocol
        self._regions: dict[int, Region] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        # One writer thread: batches go out one at a time (see the module docstring).
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvxfer-mooncake")
        self._closed = False

    @property
    def regions(self) -> dict[int, Region]:
        """Registered local regions by id."""
        return dict(self._regions)

    def register(self, tensor: torch.Tensor) -> Region:
        """Register a contiguous tensor's memory (CPU, or GPU with the CUDA wheel)."""
        if not tensor.is_contiguous():
            raise ValueError("tensor: must be contiguous to be registered; call .contiguous()")
        nbytes = tensor.numel() * tensor.element_size()
        code = self._engine.register_memory(tensor.data_ptr(), nbytes)
        if code != 0:
            raise TransferError(f"Mooncake register_memory of {nbytes} bytes returned {code}")
        with self._lock:
            region = Region(next(self._ids), tensor.data_ptr(), nbytes)
            self._regions[region.region_id] = region
        return region

    def unregister(self, region: Region) -> None:
        """Unregister a region's memory."""
        with self._lock:
            if self._regions.pop(region.region_id, None) is None:
                return
        code = self._engine.unregister_memory(region.address)
        if code != 0:
            log.warning("Mooncake unregister_memory(%#x) returned %d", region.address, code)

    def submit(self, segments: Segments, peer: Peer) -> Future[None]:
        """Check every segment against both sides' regions, then write in the background.

        Raises:
            TransferError: a segment outside a region (nothing is written then).
        """
        if self._closed:
            raise TransferError("the transport is closed")
        with self._lock:
            local = dict(self._regions)
        check_segments_in_regions(segments, local, peer.regions)
        src = _addresses(segments.src_region, segments.src_offset, local)
        dst = _addresses(segments.dst_region, segments.dst_offset, peer.regions)
        return self._writer.submit(self._write_batches, peer.endpoint, src, dst, segments.length)

    def write(self, segments: Segments, peer: Peer, timeout: float | None = None) -> None:
        """Write and wait up to `timeout` seconds.

        Raises:
            TransferError: a failed write, or none finished in time (the engine may still
                complete it; Mooncake has no cancel).
        """
        future = self.submit(segments, peer)
        try:
            future.result(timeout)
        except FutureTimeout as exc:
            raise TransferError(
                f"write of {len(segments)} segments to {peer.endpoint} did not finish in "
                f"{timeout} s"
            ) from exc

    def _write_batches(
        self, endpoint: str, src: np.ndarray, dst: np.ndarray, lengths: np.ndarray
    ) -> None:
        for start in range(0, len(lengths), MAX_BATCH):
            end = start + MAX_BATCH
            code = self._engine.batch_transfer_sync_write(
                endpoint,
                src[start:end].tolist(),
                dst[start:end].tolist(),
                lengths[start:end].tolist(),
            )
            if code != 0:
                raise TransferError(
                    f"Mooncake write to {endpoint} failed with {code} in segments "
                    f"[{start}, {min(end, len(lengths))}) of {len(lengths)}"
                )

    def close(self) -> None:
        """Finish queued writes, unregister everything."""
        if self._closed:
            return
        self._closed = True
        self._writer.shutdown(wait=True)
        for region in list(self._regions.values()):
            self.unregister(region)
        # Destroy the engine now, not whenever the garbage collector gets to this object: an
        # engine destroyed late tore down registrations of newer engines in the same process
        # (measured: a fresh engine set failed its first write with "not within any registered
        # buffer" whenever an older, closed engine was collected after it registered memory;
        # never with the engine dropped here). It takes about a second.
        self._engine = None

    def __enter__(self) -> MooncakeTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _addresses(ids: np.ndarray, offsets: np.ndarray, regions: Mapping[int, Region]) -> np.ndarray:
    known = np.asarray(sorted(regions), dtype=np.int64)
    bases = np.asarray([regions[int(i)].address for i in known], dtype=np.int64)
    return bases[np.searchsorted(known, ids)] + offsets
