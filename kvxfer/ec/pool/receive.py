"""The encoder-cache consumer's receive buffer and the Mooncake engines that read into it.

Each producer has its own Mooncake engine on the consumer (the receive buffer registered in
each), made on the first read from it: Mooncake's first transfer to a peer shakes hands under
an engine-wide lock, and a peer frozen then stops every transfer of that engine (measured:
about 60 s), so a frozen or hostile producer holds only its own loads.

No byte of a load lands in memory in use after that load returned or failed, except in a
receive range the load gave up on, which stays out of use (quarantined) until the consumer's
own Mooncake read of it has settled (Mooncake fails a read from a frozen peer after 30 s
without progress); never on a timer. A read still unsettled at `close` keeps its engine and
the buffer alive until the process exits.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import numpy as np
import torch

from kvxfer.ec.base import ECLoadError
from kvxfer.ec.pool.pool import ByteRanges
from kvxfer.plan.segments import Segments
from kvxfer.transport.base import Peer, Region, Transport
from kvxfer.transport.factory import TransportOptions, create_transport

log = logging.getLogger(__name__)

DESCRIPTOR_BYTES = 4 << 20  # a read is cut in Mooncake descriptors of at most this size
_POLL_SLICE_S = 0.1  # waits are sliced so that close() is never held up
_KEPT: list[tuple[list[Transport], torch.Tensor]] = []  # transports a read is still inside


@dataclass
class _Engine:
    """This consumer's Mooncake engine for one producer, the receive buffer registered in it."""

    transport: Transport
    region: Region
    unsettled: int = 0  # reads submitted and not settled


class ReceiveBuffer:
    """The receive buffer: ranges reserved per load, quarantined when a load gives up on its
    read, and one Mooncake engine per producer reading into it.

    Args:
        capacity: the buffer's bytes (`recv_bytes`).
        transport, options: the kind of transport to read with, one per producer, and its
            options.
        closed: set when the consumer closes: waits then end at once.
    """

    def __init__(
        self, capacity: int, transport: str, options: TransportOptions, closed: threading.Event
    ) -> None:
        self.memory = torch.empty(capacity, dtype=torch.uint8)
        self._ranges = ByteRanges(capacity)
        self._quarantine: dict[int, int] = {}  # offset -> bytes, of reads given up on
        self._engines: dict[str, _Engine] = {}  # by producer address
        self._kind, self._options = transport, options  # a kind of `KINDS`
        self._closed = closed
        self._lock = threading.Condition()  # ranges, quarantine, unsettled counts
        self._engine_lock = threading.Lock()  # engines are made one at a time

    @property
    def capacity(self) -> int:
        """The buffer's bytes."""
        return self._ranges.capacity

    def quarantined(self) -> dict[int, int]:
        """The ranges held back from reuse (offset -> bytes): reads given up on that have not
        settled."""
        with self._lock:
            return dict(self._quarantine)

    def stats(self) -> dict[str, object]:
        """Bytes quarantined and in use, reads in flight, engines and the protocol they run
        ("tcp" after an RDMA fallback)."""
        with self._lock:
            engines = list(self._engines.values())
            return {
                "quarantined_bytes": self._quarantined_bytes(),
                "recv_used_bytes": self.capacity - self._ranges.free_bytes,
                "reads_in_flight": sum(e.unsettled for e in engines),
                "transport": engines[0].transport.protocol if engines else self._options.protocol,
                "engines": len(engines),
            }

    @property
    def engine_count(self) -> int:
        """Mooncake engines made (one per producer read from), each with its completion
        thread."""
        with self._lock:
            return len(self._engines)

    @property
    def quarantined_bytes(self) -> int:
        """Receive-buffer bytes held back from reuse."""
        with self._lock:
            return self._quarantined_bytes()

    def _quarantined_bytes(self) -> int:
        return sum(ByteRanges.rounded(n) for n in self._quarantine.values())

    # ---- ranges -------------------------------------------------------------------------

    def reserve(self, nbytes: int, deadline: float) -> int:
        """A range for `nbytes`, waiting for other loads to free room until the deadline.

        Raises:
            ECLoadError: no room in time, or the consumer closed.
        """
        with self._lock:
            while True:
                offset = self._ranges.alloc(nbytes)
                if offset is not None:
                    return offset
                left = deadline - time.monotonic()
                if left <= 0 or self._closed.is_set():
                    raise ECLoadError(
                        f"no room for {nbytes} bytes in the receive buffer in time "
                        f"({self._quarantined_bytes()} bytes quarantined); raise recv_bytes"
                    )
                self._lock.wait(min(left, _POLL_SLICE_S))

    def unreserve(self, offset: int, nbytes: int) -> None:
        """Give a range back (nothing more can land in it)."""
        with self._lock:
            self._ranges.free(offset, nbytes)
            self._lock.notify_all()

    def quarantine_until_settled(self, offset: int, nbytes: int, read: Future[None]) -> None:
        """Keep a range out of use until the read into it has settled: only then can nothing
        more of it land there."""
        with self._lock:
            self._quarantine[offset] = nbytes

        def settled(_: Future[None]) -> None:
            with self._lock:
                if self._quarantine.pop(offset, None) is not None:
                    self._ranges.free(offset, nbytes)
                    self._lock.notify_all()

        read.add_done_callback(settled)

    def copy_out(self, offset: int, nbytes: int) -> torch.Tensor:
        """A copy of a range's bytes (its read settled and was confirmed)."""
        return self.memory[offset : offset + nbytes].clone()

    # ---- reads --------------------------------------------------------------------------

    def read(
        self, address: str, endpoint: str, remote: int, offset: int, nbytes: int
    ) -> Future[None]:
        """Read `[remote, remote + nbytes)` of the producer `address`'s pool (its Mooncake
        engine at `endpoint`) into the buffer at `offset`, in descriptors of at most 4 MiB;
        the future settles once every one has.

        Raises:
            ECLoadError: no engine for that producer, or Mooncake refused the read.
        """
        try:
            engine = self._engine(address)
        except Exception as exc:
            raise ECLoadError(f"no Mooncake engine for producer {address}: {exc}") from exc
        starts = np.arange(0, nbytes, DESCRIPTOR_BYTES, dtype=np.int64)
        segments = Segments(
            src_region=np.zeros_like(starts),
            src_offset=starts,
            dst_region=np.full_like(starts, engine.region.region_id),
            dst_offset=starts + offset,
            length=np.minimum(DESCRIPTOR_BYTES, nbytes - starts),
        )
        peer = Peer(endpoint, {0: Region(0, remote, nbytes)})
        try:
            future = engine.transport.read(segments, peer)
        except Exception as exc:
            raise ECLoadError(f"cannot read from producer {address}: {exc}") from exc
        with self._lock:
            engine.unsettled += 1

        def settled(_: Future[None]) -> None:
            with self._lock:
                engine.unsettled -= 1
                self._lock.notify_all()

        future.add_done_callback(settled)
        return future

    def wait_read(self, read: Future[None], deadline: float) -> None:
        """Wait for a read to settle; `FutureTimeout` at the deadline or on close; the read's
        own exception if it failed."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or self._closed.is_set():
                raise FutureTimeout
            try:
                read.result(min(left, _POLL_SLICE_S))
                return
            except FutureTimeout:
                continue

    def _engine(self, address: str) -> _Engine:
        with self._engine_lock:
            engine = self._engines.get(address)
            if engine is None:
                if self._closed.is_set():  # close() closes the engines made until then
                    raise ECLoadError("the encoder-cache connector was closed")
                transport = create_transport(self._kind, self._options)
                try:
                    region = transport.register(self.memory)
                except BaseException:
                    transport.close()
                    raise
                engine = _Engine(transport, region)
                with self._lock:
                    self._engines[address] = engine
            return engine

    def close(self, timeout_s: float) -> None:
        """Close the engines once their reads settled, waiting `timeout_s` at most.

        A read in flight (from a frozen producer) may settle soon; one that does not keeps its
        engine and the buffer alive: destroying an engine whose completion thread may be
        inside Mooncake, or freeing memory a read may still land in, is not safe, and an
        engine destroyed later tears down newer engines' registrations.
        """
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while any(e.unsettled for e in self._engines.values()):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._lock.wait(min(left, _POLL_SLICE_S))
            stuck = {a: e for a, e in self._engines.items() if e.unsettled}
        with self._engine_lock:  # no engine is made after this
            for address, engine in self._engines.items():
                if address not in stuck:
                    engine.transport.close()
        if stuck:
            log.warning(
                "encoder-cache consumer closed with reads from %s not settled; their Mooncake "
                "engines and the receive buffer are kept until the process exits",
                list(stuck),
            )
            _KEPT.append(([e.transport for e in stuck.values()], self.memory))
