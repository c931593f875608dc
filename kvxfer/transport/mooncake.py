"""`MooncakeTransport`: segment writes through Mooncake Transfer Engine, peer to peer.

The engine runs in P2P-handshake mode (no metadata server): a peer is addressed as
`host:rpc_port`, both sides register their memory, and one write must lie inside one registered
buffer on each side. TCP by default; RDMA when `protocol="rdma"` and a NIC is present.

Measured with the non-CUDA wheel 0.3.13 on TCP loopback (2-core machine): a batch of more than
about 2,048 descriptors, or several batches in flight whose descriptors add up to that, fails
with -1 *and leaves the engine failing every later write*. Transfers therefore go through one
`CompletionPump` per engine, which keeps at most 1,024 descriptors in flight (256 per peer) and
polls them without spinning (`kvxfer.transport.completion`). One descriptor costs about 20 us
there with many in flight (45 us one after another with the old busy-waiting writes), whatever
its size up to 16 KiB (`benchmarks/chunk_costs.py`).

Mooncake cuts TCP transfers into slices of `MC_TCP_SLICE_SIZE` bytes, read from the environment
once per process; kvxfer sets `TCP_SLICE_SIZE` there before its first engine starts unless the
environment already has a value (the user's wins).
"""

from __future__ import annotations

import importlib.util
import itertools
import logging
import os
import threading
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

from kvxfer.rdma import infiniband_sysfs, rdma_devices
from kvxfer.transport.base import CheckedTransfer, Region, TransferError, TransportBase
from kvxfer.transport.completion import CompletionPump
from kvxfer.validation import check_host

log = logging.getLogger(__name__)

PROTOCOLS: tuple[str, ...] = ("tcp", "rdma")
"""The Mooncake protocols `MooncakeTransport` accepts."""

TCP_SLICE_SIZE = 64 << 10
"""Bytes per Mooncake TCP slice (`MC_TCP_SLICE_SIZE`) when the environment sets none: Mooncake's
own default, which no other size beat beyond the noise over loopback (64 KiB to 4 MiB, one
stream, four streams and `kvxfer bench`; `benchmarks/studies/tcp_slice_size.py`,
benchmarks/history/2026-11-30.md). Set explicitly so that the value kvxfer was measured with
does not move with Mooncake's."""


def check_protocol(protocol: object) -> str:
    """Check a transport protocol name: "tcp" or "rdma".

    Returns:
        The protocol, unchanged.

    Raises:
        ValueError: any other value (e.g. "udp"), naming the accepted ones.
    """
    if protocol not in PROTOCOLS:
        raise ValueError(
            f"protocol: {protocol!r} is not supported; use one of {list(PROTOCOLS)} "
            '("tcp" works everywhere, "rdma" needs an RDMA NIC)'
        )
    return str(protocol)


def _missing_rdma(device: str) -> str | None:
    """Why RDMA cannot run here with the device filter `device`, or None when it can."""
    found = rdma_devices()
    if not found:
        return f"no RDMA device found ({infiniband_sysfs()} lists none)"
    wanted = [name.strip() for name in device.split(",") if name.strip()]
    missing = [name for name in wanted if name not in found]
    if missing:
        return f"RDMA device(s) {missing} not found; this machine has {found}"
    return None


def _rdma_unavailable(problem: str) -> TransferError:
    return TransferError(
        f'protocol="rdma": {problem}; use protocol="tcp", or pass rdma_fallback=True to fall '
        "back to TCP when RDMA is unavailable"
    )


def _warn_fallback(problem: str) -> None:
    log.warning(
        'protocol="rdma" asked, but %s; using TCP instead because rdma_fallback=True '
        "(transfers are slower than over RDMA)",
        problem,
    )


def _engine_class() -> type:
    # Mooncake's native logging is verbose at INFO; keep errors unless the user chose a level.
    # This wheel reads MC_LOG_LEVEL; GLOG_minloglevel is for builds that log through glog.
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    os.environ.setdefault("GLOG_minloglevel", "1")
    # Read by Mooncake once per process, when its first TCP transfer starts: before any engine.
    os.environ.setdefault("MC_TCP_SLICE_SIZE", str(TCP_SLICE_SIZE))
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise ImportError(
            "MooncakeTransport needs Mooncake Transfer Engine: pip install "
            "'kvxfer[mooncake]' on CUDA machines or 'kvxfer[mooncake-cpu]' elsewhere "
            f"(both need the system's libibverbs) ({exc})"
        ) from exc
    return TransferEngine


def check_mooncake_available(protocol: str, rdma_fallback: bool) -> None:
    """Fail at start, not at the first transfer, when Mooncake or an asked-for RDMA device is
    missing (for a connector that creates its engines later, one per peer).

    Raises:
        ImportError: Mooncake Transfer Engine is not installed.
        TransferError: protocol "rdma" on a machine without an RDMA device (and no fallback).
    """
    if importlib.util.find_spec("mooncake") is None:
        raise ImportError(
            "the Mooncake transport needs Mooncake Transfer Engine: pip install "
            "'kvxfer[mooncake]' on CUDA machines or 'kvxfer[mooncake-cpu]' elsewhere"
        )
    problem = _missing_rdma("") if check_protocol(protocol) == "rdma" else None
    if problem is not None and not rdma_fallback:
        raise _rdma_unavailable(problem)


PORT_ATTEMPTS = 5
"""Engines started, one after another, before a lost race for a port is reported."""


def _lost_port_race(exc: RuntimeError) -> bool:
    """Whether Mooncake failed to start only because another process took the port it chose.

    In P2P-handshake mode Mooncake picks two random ports (its RPC port and its TCP
    transport's listener) after checking that each is free, then binds them: two engines
    starting at the same moment in different processes (a TP group's ranks) can pick the same
    port between the check and the bind. The bind's error then surfaces from its native code
    as a RuntimeError "bind: Address already in use"; a fresh engine picks other ports."""
    return "Address already in use" in str(exc)


def _initialized(host: str, protocol: str, device: str) -> tuple[Any, int]:
    """A new engine and the code its `initialize` returned, started again (with new random
    ports) while it loses a race for a port, at most `PORT_ATTEMPTS` times.

    Raises:
        TransferError: every attempt lost its port, or Mooncake raised anything else.
    """
    for _ in range(PORT_ATTEMPTS):
        engine = _engine_class()()
        try:
            return engine, engine.initialize(host, "P2PHANDSHAKE", protocol, device)
        except RuntimeError as exc:
            if not _lost_port_race(exc):
                raise TransferError(
                    f"Mooncake initialize({host!r}, protocol={protocol!r}) failed: {exc}"
                ) from exc
            lost = exc
            log.info("Mooncake lost a port to another process (%s); starting again", exc)
    raise TransferError(
        f"Mooncake initialize({host!r}, protocol={protocol!r}): {lost} on each of "
        f"{PORT_ATTEMPTS} attempts with random ports; free the ports Mooncake picks from "
        "(15000-17000 with the wheel kvxfer was measured with) or stop what holds them"
    ) from lost


def _new_engine(
    host: str, protocol: str, device: str, rdma_fallback: bool = False
) -> tuple[Any, str, str]:
    """An initialized engine, its endpoint (host:rpc_port) and the protocol it runs.

    RDMA is checked first (a device must be listed in sysfs): without it, or when Mooncake
    fails to start on RDMA, this raises unless `rdma_fallback`, which logs a warning and runs
    TCP instead.
    """
    if protocol == "rdma":
        problem = _missing_rdma(device)
        if problem is not None:
            if not rdma_fallback:
                raise _rdma_unavailable(problem)
            _warn_fallback(problem)
            protocol = "tcp"
    engine, code = _initialized(host, protocol, device)
    if code != 0 and protocol == "rdma":
        engine = None  # drop the failed engine now (see MooncakeTransport.close)
        problem = f"Mooncake initialize({host!r}, protocol='rdma') returned {code}"
        if not rdma_fallback:
            raise _rdma_unavailable(problem)
        _warn_fallback(problem)
        return _new_engine(host, "tcp", device)
    if code != 0:
        raise TransferError(
            f"Mooncake initialize({host!r}, protocol={protocol!r}) returned {code}; check "
            "that the host address is an address of this machine"
        )
    return engine, f"{host}:{engine.get_rpc_port()}", protocol


class MooncakeTransport(TransportBase):
    """One Mooncake TransferEngine: registers local memory, writes to peers' memory.

    Args:
        host: the address peers reach this engine at (127.0.0.1 by default).
        protocol: "tcp" (default) or "rdma".
        device: RDMA device filter, comma-separated names ("" = all).
        rdma_fallback: with protocol="rdma", run TCP (and log a warning saying so) when this
            machine has no RDMA device or Mooncake cannot start on RDMA; without it, that
            raises. `self.protocol` is the protocol actually in use.
        driven: no thread of its own: transfers are submitted on the caller's thread, and the
            owner calls `drive` on that same thread every turn (see
            `kvxfer.transport.completion`); for a loop that owns the engine alone.

    Raises:
        ValueError: a bad host, or a protocol other than "tcp" and "rdma".
        TransferError: RDMA asked but unavailable (the message names the fix), or Mooncake
            failed to start.
    """

    kind = "mooncake"

    def __init__(
        self,
        host: str = "127.0.0.1",
        protocol: str = "tcp",
        device: str = "",
        *,
        rdma_fallback: bool = False,
        driven: bool = False,
    ) -> None:
        check_host(host)
        check_protocol(protocol)
        self._engine, self.endpoint, self.protocol = _new_engine(
            host, protocol, device, rdma_fallback
        )
        self._regions: dict[int, Region] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        # One thread submits and polls every transfer of this engine, or its owner's loop
        # does (see completion.py).
        self.driven = driven
        self._pump = CompletionPump(self._engine, "kvxfer-mooncake", threaded=not driven)
        self._closed = False

    @property
    def regions(self) -> dict[int, Region]:
        """Registered local regions by id."""
        return dict(self._regions)

    def _register_memory(self, memory: torch.Tensor) -> Region:
        nbytes = memory.numel()
        code = self._engine.register_memory(memory.data_ptr(), nbytes)
        if code != 0:
            raise TransferError(f"Mooncake register_memory of {nbytes} bytes returned {code}")
        with self._lock:
            region = Region(next(self._ids), memory.data_ptr(), nbytes)
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

    def _start(self, transfer: CheckedTransfer) -> Future[None]:
        segments = transfer.segments
        src = _addresses(segments.src_region, segments.src_offset, transfer.src_regions)
        dst = _addresses(segments.dst_region, segments.dst_offset, transfer.dst_regions)
        local, remote = (src, dst) if transfer.direction == "write" else (dst, src)
        return self._pump.add(
            transfer.peer.endpoint, transfer.direction, local, remote, segments.length
        )

    def in_flight(self, endpoint: str | None = None) -> int:
        """Segments submitted to the engine and not settled (for one peer, or all)."""
        return self._pump.in_flight(endpoint)

    def drive(self) -> float | None:
        """(a driven transport's owner, every turn) Move transfers on: submit, and poll when a
        poll is due (`kvxfer.transport.completion`: every 0.2 ms for a young read, less often
        for an older one). Returns the seconds until the next poll is due (turn again by then),
        or None when nothing is queued or in flight."""
        if not self.driven:
            raise TransferError("drive(): this transport runs its own thread")
        if self._closed:
            return None
        return self._pump.drive()

    def _live_regions(self) -> dict[int, Region]:
        if self._closed:
            raise TransferError("the transport is closed")
        with self._lock:
            return dict(self._regions)

    def close(self) -> None:
        """Destroy the engine: transfers not settled fail, registrations end."""
        if self._closed:
            return
        self._closed = True
        unsettled = self._pump.stop()
        # Destroy the engine now, not whenever the garbage collector gets to this object: an
        # engine destroyed late tore down registrations of newer engines in the same process
        # (measured: a fresh engine set failed its first write with "not within any registered
        # buffer" whenever an older, closed engine was collected after it registered memory;
        # never with the engine dropped here). It takes about a second. Memory is not
        # unregistered first: transfers still in flight (a frozen peer) would then fault;
        # destroying the engine ends them and its registrations at once.
        self._regions.clear()
        self._engine = None
        for future in unsettled:  # nothing of these can land now: the engine is gone
            future.set_exception(TransferError("the transport was closed before it finished"))


def _addresses(ids: np.ndarray, offsets: np.ndarray, regions: Mapping[int, Region]) -> np.ndarray:
    first = int(ids[0]) if ids.size else None
    if first is not None and bool((ids == first).all()):  # one region: most reads
        return offsets + regions[first].address  # (no searchsorted: it gives up the GIL)
    known = np.asarray(sorted(regions), dtype=np.int64)
    bases = np.asarray([regions[int(i)].address for i in known], dtype=np.int64)
    return bases[np.searchsorted(known, ids)] + offsets
