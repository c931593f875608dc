"""The encoder-cache producer's registered pool: items in one bounded, registered block of memory.

`ByteRanges` allocates aligned byte ranges first fit (the producer's pool and the consumer's
receive buffer both use it). `ItemPool` keeps the producer's items, least recently used first,
in one uint8 tensor registered with the producer's transport, so that a consumer can read
an item's bytes where they lie. An item's bytes never change while it is in the pool: a range
is written only when it is allocated, and an item's range is not free until the item is
evicted. Eviction takes the least recently used item that no read pins; a pinned item stays,
and a save that the pinned items leave no room for fails without evicting anything.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from kvxfer.ec.base import tensor_bytes
from kvxfer.transport.base import Transport

log = logging.getLogger(__name__)

ALIGN = 256  # every range starts on this many bytes


class ByteRanges:
    """First-fit allocation of aligned byte ranges in `[0, capacity)`."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free: list[tuple[int, int]] = [(0, capacity)]  # (offset, size), sorted

    @staticmethod
    def rounded(nbytes: int) -> int:
        """The size a request of `nbytes` occupies."""
        return max(ALIGN, -(-nbytes // ALIGN) * ALIGN)

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
        self._free = _merged([*self._free, (offset, self.rounded(nbytes))])

    def would_fit(self, nbytes: int, freed: list[tuple[int, int]]) -> bool:
        """Whether `nbytes` would fit once the ranges `freed` ((offset, nbytes) each, all
        allocated now) were given back."""
        spans = _merged([*self._free, *((o, self.rounded(n)) for o, n in freed)])
        return any(size >= self.rounded(nbytes) for _, size in spans)

    @property
    def free_bytes(self) -> int:
        """Bytes not allocated."""
        return sum(size for _, size in self._free)


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(offset, size) spans sorted, with touching ones joined."""
    merged: list[tuple[int, int]] = []
    for start, length in sorted(spans):
        if merged and merged[-1][0] + merged[-1][1] == start:
            merged[-1] = (merged[-1][0], merged[-1][1] + length)
        else:
            merged.append((start, length))
    return merged


@dataclass(eq=False)  # identity: "the same entry" means the same bytes, never rewritten
class Entry:
    """An item in the pool: where its bytes lie, what they are, and how many reads pin it."""

    offset: int
    nbytes: int
    dtype: str
    shape: list[int]
    pins: int = 0


def dtype_name(dtype: torch.dtype) -> str:
    """A torch dtype as the wire names it ("float16", "bfloat16", ...)."""
    return str(dtype).removeprefix("torch.")


class ItemPool:
    """The producer's items in one registered tensor of `capacity` bytes (thread-safe).

    Args:
        capacity: the pool's bytes (`pool_bytes`).
        transport: the producer's transport; the pool is registered with it.

    Raises:
        TransferError: the transport could not register the pool.
    """

    def __init__(self, capacity: int, transport: Transport) -> None:
        self._memory = torch.empty(capacity, dtype=torch.uint8)
        self.region = transport.register(self._memory)
        self._ranges = ByteRanges(capacity)
        self._entries: OrderedDict[str, Entry] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int:
        """The pool's bytes."""
        return self._ranges.capacity

    @property
    def stored(self) -> list[str]:
        """Hashes held, least recently used first."""
        with self._lock:
            return list(self._entries)

    def put(self, mm_hash: str, tensor: torch.Tensor) -> None:
        """Store a tensor's bytes under `mm_hash`, evicting unpinned items as needed; an item
        held already is only touched (same hash, same content).

        Raises:
            ValueError: the tensor is larger than the whole pool.
            RuntimeError: the pool is full of items being read.
        """
        data = tensor_bytes(tensor.cpu())
        nbytes = data.numel()
        if ByteRanges.rounded(nbytes) > self.capacity:
            raise ValueError(
                f"tensor: {nbytes} bytes exceed the pool of {self.capacity}; raise pool_bytes"
            )
        with self._lock:
            if mm_hash in self._entries:
                self._entries.move_to_end(mm_hash)
                return
            offset = self._room_for(nbytes)
        # The copy runs without the lock (the side channel keeps answering); the entry is
        # published once its bytes are in place.
        self._memory[offset : offset + nbytes].copy_(data)
        with self._lock:
            if mm_hash in self._entries:  # another thread saved it meanwhile
                self._ranges.free(offset, nbytes)
                return
            shape = [int(n) for n in tensor.shape]
            self._entries[mm_hash] = Entry(offset, nbytes, dtype_name(tensor.dtype), shape)

    def _room_for(self, nbytes: int) -> int:
        """An offset for `nbytes`, evicting the least recently used unpinned items (under the
        lock). Nothing is evicted unless evicting makes room: a save that must fail (the
        pinned items leave no run long enough) costs the pool no item."""
        offset = self._ranges.alloc(nbytes)
        if offset is not None:
            return offset
        unpinned = [(h, e) for h, e in self._entries.items() if e.pins == 0]  # oldest first
        if not self._ranges.would_fit(nbytes, [(e.offset, e.nbytes) for _, e in unpinned]):
            raise RuntimeError(
                "the encoder-cache pool is full of outputs being read; retry, or raise pool_bytes"
            )
        for victim, gone in unpinned:
            del self._entries[victim]
            self._ranges.free(gone.offset, gone.nbytes)
            log.debug("evicted encoder output %s", victim)
            offset = self._ranges.alloc(nbytes)
            if offset is not None:
                return offset
        raise AssertionError("evicting every unpinned item made no room, yet would_fit said so")

    def get(self, mm_hash: str) -> Entry | None:
        """The item's entry, if held."""
        with self._lock:
            return self._entries.get(mm_hash)

    def pin(self, mm_hash: str) -> Entry | None:
        """Keep the item in place (and make it the most recent); None if it is not held."""
        with self._lock:
            entry = self._entries.get(mm_hash)
            if entry is not None:
                entry.pins += 1
                self._entries.move_to_end(mm_hash)
            return entry

    def unpin(self, entry: Entry) -> None:
        """End one pin of `entry`: once none is left, it may be evicted."""
        with self._lock:
            entry.pins -= 1

    def holds(self, mm_hash: str, entry: Entry) -> bool:
        """Whether `entry` is still the item under `mm_hash`: its range was never freed, so
        its bytes were never rewritten."""
        with self._lock:
            return self._entries.get(mm_hash) is entry

    def demote(self, mm_hash: str) -> None:
        """A consumer is done with the item: evict it first (not while it is pinned)."""
        with self._lock:
            if mm_hash in self._entries:
                self._entries.move_to_end(mm_hash, last=False)

    def address_of(self, entry: Entry) -> int:
        """Where the entry's bytes lie, in the registered memory a consumer reads."""
        return self.region.address + entry.offset

    def stats(self) -> dict[str, int]:
        """Items held and pinned, and free bytes."""
        with self._lock:
            return {
                "stored": len(self._entries),
                "pinned": sum(e.pins > 0 for e in self._entries.values()),
                "pool_free_bytes": self._ranges.free_bytes,
            }
