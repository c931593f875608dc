"""`MooncakeECConnector`: encoder outputs served from a bounded registered pool over Mooncake.

The producer keeps outputs in one registered buffer; when a new output does not fit, the least
recently used outputs are evicted, never one that a fetch is reading (those are pinned). A
consumer asks a producer for an item's size on the side channel, reserves room in its own
registered receive buffer, and the producer writes the bytes there with Mooncake. Same side
channel (ZeroMQ, versioned msgspec messages) and transport as the KV connector.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import zmq

from kvxfer.connector.messages import (
    ECFetch,
    ECFetched,
    ECInfo,
    ECQuery,
    ECRelease,
    ErrorReply,
    Message,
    ProtocolError,
    answer_frames,
    decode,
    encode,
)
from kvxfer.connector.producer import HARD_FRAME_LIMIT
from kvxfer.ec.base import ECConnectorBase, ECLoadError
from kvxfer.plan.segments import Segments
from kvxfer.transport.base import Peer, Region
from kvxfer.transport.mooncake import MooncakeTransport

log = logging.getLogger(__name__)

_ALIGN = 256


class ByteRanges:
    """First-fit allocation of aligned byte ranges in `[0, capacity)`."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free: list[tuple[int, int]] = [(0, capacity)]  # (offset, size), sorted

    @staticmethod
    def rounded(nbytes: int) -> int:
        """The size a request of `nbytes` occupies."""
        return max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)

    def alloc(self, nbytes: int) -> int | None:
        """An offset for `nbytes`, or None when no free range is large enough."""
        size = self.rounded(nbytes)
        for i, (offset, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (offset + size, free - size)
                return offset
        return None

    def free(self, offset: int, nbytes: int) -> None:
        """Give a range back, merging it with free neighbours."""
        size = self.rounded(nbytes)
        self._free.append((offset, size))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for start, length in self._free:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((start, length))
        self._free = merged

    @property
    def free_bytes(self) -> int:
        """Bytes not allocated."""
        return sum(size for _, size in self._free)


@dataclass
class _Entry:
    offset: int
    nbytes: int
    dtype: str
    shape: list[int]
    pins: int = 0


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ECLoadError(f"unknown dtype {name!r} from the producer")
    return dtype


class MooncakeECConnector(ECConnectorBase):
    """Encoder outputs over Mooncake Transfer Engine.

    Producer config: `host` (127.0.0.1), `port` (0: any; see `address`), `pool_bytes`
    (256 MiB), `secret`, `protocol` ("tcp" or "rdma").
    Consumer config: `producer_addresses` (list of producer `address`es), `recv_bytes`
    (256 MiB), `secret`, `timeout_s` (30), `host`, `protocol`.
    """

    def __init__(self, role: str, config: dict[str, Any] | None = None) -> None:
        super().__init__(role, config)
        cfg = self.config
        self._secret = str(cfg.get("secret", ""))
        self.transport = MooncakeTransport(cfg.get("host", "127.0.0.1"), cfg.get("protocol", "tcp"))
        self._ctx = zmq.Context()
        self._lock = threading.Condition()
        if self.role == "producer":
            self._start_producer(cfg)
        else:
            self._start_consumer(cfg)

    # ---- producer -----------------------------------------------------------------------

    def _start_producer(self, cfg: dict[str, Any]) -> None:
        capacity = int(cfg.get("pool_bytes", 256 << 20))
        self._pool = torch.empty(capacity, dtype=torch.uint8)
        self._pool_region = self.transport.register(self._pool)
        self._ranges = ByteRanges(capacity)
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.MAXMSGSIZE, HARD_FRAME_LIMIT)
        self._router.setsockopt(zmq.LINGER, 0)
        host, port = cfg.get("host", "127.0.0.1"), int(cfg.get("port", 0))
        if port == 0:
            port = self._router.bind_to_random_port(f"tcp://{host}")
        else:
            self._router.bind(f"tcp://{host}:{port}")
        self.address = f"tcp://{host}:{port}"
        self._thread = threading.Thread(target=self._serve, name="kvxfer-ec", daemon=True)
        self._thread.start()

    @property
    def stored(self) -> list[str]:
        """Hashes held, least recently used first (producer)."""
        with self._lock:
            return list(self._entries)

    def _save(self, mm_hash: str, tensor: torch.Tensor) -> None:
        data = tensor.cpu().contiguous().view(torch.uint8).reshape(-1)
        nbytes = data.numel()
        if ByteRanges.rounded(nbytes) > self._ranges.capacity:
            raise ValueError(
                f"tensor: {nbytes} bytes exceed the pool of {self._ranges.capacity}; raise "
                "pool_bytes"
            )
        with self._lock:
            if mm_hash in self._entries:  # same hash, same content: just touch it
                self._entries.move_to_end(mm_hash)
                return
            offset = self._ranges.alloc(nbytes)
            while offset is None:
                victim = next((h for h, e in self._entries.items() if e.pins == 0), None)
                if victim is None:
                    raise RuntimeError(
                        "the encoder-cache pool is full of outputs being fetched; retry, or "
                        "raise pool_bytes"
                    )
                gone = self._entries.pop(victim)
                self._ranges.free(gone.offset, gone.nbytes)
                log.debug("evicted encoder output %s", victim)
                offset = self._ranges.alloc(nbytes)
            self._pool[offset : offset + nbytes].copy_(data)
            self._entries[mm_hash] = _Entry(
                offset, nbytes, _dtype_name(tensor.dtype), list(tensor.shape)
            )

    def _serve(self) -> None:
        while not self._closed.is_set():
            if not self._router.poll(20):
                continue
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                continue
            identity, reply = answer_frames(
                frames, lambda _, message: self._answer(message), "encoder-cache side channel"
            )
            if reply is not None:
                self._router.send_multipart([identity, encode(reply)])

    def _answer(self, message: Message) -> Message | None:
        if not isinstance(message, ECQuery | ECFetch | ECRelease):
            raise ProtocolError(
                f"an encoder-cache producer does not accept {type(message).__name__}"
            )
        if not hmac.compare_digest(message.secret.encode(), self._secret.encode()):
            raise ProtocolError("refused: wrong or missing shared secret")
        if isinstance(message, ECQuery):
            with self._lock:
                entry = self._entries.get(message.mm_hash)
                if entry is None:
                    return ECInfo(mm_hash=message.mm_hash, found=False)
                return ECInfo(
                    mm_hash=message.mm_hash,
                    found=True,
                    dtype=entry.dtype,
                    shape=entry.shape,
                    nbytes=entry.nbytes,
                )
        if isinstance(message, ECRelease):
            with self._lock:
                if message.mm_hash in self._entries:
                    self._entries.move_to_end(message.mm_hash, last=False)  # evict first
            return None
        return self._fetch(message)

    def _fetch(self, ask: ECFetch) -> ECFetched:
        with self._lock:
            entry = self._entries.get(ask.mm_hash)
            if entry is None:
                return ECFetched(mm_hash=ask.mm_hash, ok=False, reason="not held (evicted?)")
            if ask.nbytes != entry.nbytes:
                return ECFetched(
                    mm_hash=ask.mm_hash,
                    ok=False,
                    reason=f"asked for {ask.nbytes} bytes, the output has {entry.nbytes}",
                )
            entry.pins += 1  # never evicted while its bytes are on the wire
            self._entries.move_to_end(ask.mm_hash)
        try:
            one = np.ones(1, dtype=np.int64)
            segments = Segments(
                one * self._pool_region.region_id,
                one * entry.offset,
                one * 0,
                one * 0,
                one * entry.nbytes,
            )
            peer = Peer(ask.endpoint, {0: Region(0, ask.address, ask.nbytes)})
            self.transport.write(segments, peer, timeout=float(self.config.get("timeout_s", 30)))
            return ECFetched(mm_hash=ask.mm_hash, ok=True)
        except Exception as exc:
            return ECFetched(mm_hash=ask.mm_hash, ok=False, reason=f"write failed: {exc}")
        finally:
            with self._lock:
                entry.pins -= 1

    # ---- consumer -----------------------------------------------------------------------

    def _start_consumer(self, cfg: dict[str, Any]) -> None:
        addresses = cfg.get("producer_addresses") or []
        if isinstance(addresses, str):
            addresses = [addresses]
        if not addresses:
            raise ValueError("config: a consumer needs producer_addresses (the producers' address)")
        self._addresses = list(addresses)
        capacity = int(cfg.get("recv_bytes", 256 << 20))
        self._recv = torch.empty(capacity, dtype=torch.uint8)
        self._recv_region = self.transport.register(self._recv)
        self._recv_ranges = ByteRanges(capacity)
        self._timeout_s = float(cfg.get("timeout_s", 30.0))

    def _ask(self, address: str, message: Message) -> Message:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(address)
            sock.send(encode(message))
            if not sock.poll(int(self._timeout_s * 1000)):
                raise ECLoadError(f"producer {address} did not answer in {self._timeout_s} s")
            reply = decode(sock.recv())
        finally:
            sock.close()
        if isinstance(reply, ErrorReply):
            raise ECLoadError(f"producer {address} refused: {reply.reason}")
        return reply

    def _locate(self, mm_hash: str) -> tuple[str, ECInfo] | None:
        for address in self._addresses:
            info = self._ask(address, ECQuery(mm_hash=mm_hash, secret=self._secret))
            if isinstance(info, ECInfo) and info.found:
                return address, info
        return None

    def _has(self, mm_hash: str) -> bool:
        return self._locate(mm_hash) is not None

    def _reserve(self, nbytes: int) -> int:
        if ByteRanges.rounded(nbytes) > self._recv_ranges.capacity:
            raise ECLoadError(f"{nbytes} bytes exceed recv_bytes {self._recv_ranges.capacity}")
        deadline = time.monotonic() + self._timeout_s
        with self._lock:
            while (offset := self._recv_ranges.alloc(nbytes)) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ECLoadError("no room in the receive buffer in time; raise recv_bytes")
                self._lock.wait(left)  # a full buffer means waiting for other loads
            return offset

    def _unreserve(self, offset: int, nbytes: int) -> None:
        with self._lock:
            self._recv_ranges.free(offset, nbytes)
            self._lock.notify_all()

    def _load(self, mm_hash: str) -> torch.Tensor:
        found = self._locate(mm_hash)
        if found is None:
            raise ECLoadError(f"no producer holds an encoder output for {mm_hash!r}")
        address, info = found
        offset = self._reserve(info.nbytes)
        try:
            reply = self._ask(
                address,
                ECFetch(
                    mm_hash=mm_hash,
                    endpoint=self.transport.endpoint,
                    address=self._recv_region.address + offset,
                    nbytes=info.nbytes,
                    secret=self._secret,
                ),
            )
            if not isinstance(reply, ECFetched) or not reply.ok:
                reason = reply.reason if isinstance(reply, ECFetched) else type(reply).__name__
                raise ECLoadError(f"producer {address} could not send {mm_hash!r}: {reason}")
            data = self._recv[offset : offset + info.nbytes].clone()
        finally:
            self._unreserve(offset, info.nbytes)
        return data.view(_dtype(info.dtype)).reshape(info.shape)

    def _release(self, mm_hash: str) -> None:
        for address in self._addresses:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(address)
            sock.send(encode(ECRelease(mm_hash=mm_hash, secret=self._secret)))
            sock.close()

    def _close(self) -> None:
        if self.role == "producer":
            self._thread.join()
            self._router.close(linger=0)
            self.transport.unregister(self._pool_region)
        else:
            self.transport.unregister(self._recv_region)
        self._ctx.term()
        self.transport.close()
