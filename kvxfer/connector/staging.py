"""`StagingPool`: a registered buffer lent out in aligned byte ranges, one chunk of a transfer
per range ("slot"), at most `slot_bytes` each.

The pool is sized as `num_slots` slots of `slot_bytes` (a chunk is cut to fit one), but a chunk
takes only the bytes it needs: many short chunks (a short request's, or many requests' at once)
are in flight where one slot each would allow `num_slots` (16 requests of 256 tokens at once
waited for slots; benchmarks/RESULTS.md). Ranges are taken first-fit and merge back when
given back. Blocking takers are served in arrival order; `try_acquire` takes nothing while one
waits. The price of ranges: a slot-sized chunk may wait while less than a slot's bytes are held,
scattered (before, a slot fitted whenever fewer than `num_slots` chunks were held); holders
give their ranges back when their reads end or their leases expire, so it waits, never for
ever. Non-blocking takers keep their own order (the consumer's reads wait in a line per
producer rank: `FetchMachine._room_for`).

A full pool means waiting, never failing. A range that a transfer may still land in stays held
by its holder until that transfer has settled (the consumer's quarantine).
"""

from __future__ import annotations

import bisect
import collections
import itertools
import threading
import time
from collections.abc import Callable

import torch

from kvxfer.transport.base import Region, Transport

SLOT_ALIGNMENT = 256  # bytes; keeps every range aligned for any dtype and for RDMA
GIVE_UP_POLL_S = 0.05  # how often a blocked `acquire` asks its `give_up`


class StagingPool:
    """`num_slots` x `slot_bytes` bytes in one registered buffer, lent in ranges of at most
    `slot_bytes`; a taken range is named by an int (its "slot") until it is given back."""

    def __init__(
        self,
        transport: Transport,
        total_bytes: int,
        num_slots: int,
        device: torch.device | str = "cpu",
    ) -> None:
        slot_bytes = self.slot_size(total_bytes, num_slots)
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self.buffer = torch.empty(slot_bytes * num_slots, dtype=torch.uint8, device=device)
        self._transport = transport
        self.region: Region = transport.register(self.buffer)
        self._cond = threading.Condition()
        self._free: list[tuple[int, int]] = []  # (start, end), sorted, never touching
        self._held: dict[int, tuple[int, int]] = {}  # slot -> (start, nbytes)
        self._names = itertools.count()
        self._queue: collections.deque[object] = collections.deque()  # blocking takers, in order
        self._make_all_free()

    @staticmethod
    def slot_size(total_bytes: int, num_slots: int) -> int:
        """Bytes per slot of a pool of `total_bytes` in `num_slots` aligned slots.

        Raises:
            ValueError: the pool cannot hold that many slots.
        """
        if num_slots < 1:
            raise ValueError(f"staging_slots: must be at least 1, got {num_slots}")
        slot_bytes = (total_bytes // num_slots) // SLOT_ALIGNMENT * SLOT_ALIGNMENT
        if slot_bytes <= 0:
            raise ValueError(
                f"staging_bytes: {total_bytes} cannot hold {num_slots} slots of at least "
                f"{SLOT_ALIGNMENT} bytes; raise staging_bytes or lower staging_slots"
            )
        return slot_bytes

    @property
    def free_slots(self) -> int:
        """How many slot-sized (largest) chunks could be taken now: `num_slots` when nothing
        is held, 0 when not even one fits."""
        with self._cond:
            return sum((end - start) // self.slot_bytes for start, end in self._free)

    @property
    def waiting_takers(self) -> int:
        """Blocking takers waiting in line now."""
        with self._cond:
            return len(self._queue)

    def acquire(
        self,
        nbytes: int | None = None,
        *,
        timeout: float | None = None,
        give_up: Callable[[], bool] | None = None,
    ) -> int:
        """Take `nbytes` (a slot's worth by default), waiting until they are free, after every
        taker that came before; `give_up` is asked every `GIVE_UP_POLL_S` while waiting (under
        the pool's lock: it must neither block nor take a lock held around `release`).

        Raises:
            ValueError: `nbytes` is more than a slot.
            TimeoutError: they did not come free within `timeout` seconds, or `give_up` said so.
        """
        asked = self.slot_bytes if nbytes is None else nbytes
        need = self._aligned(asked)
        deadline = None if timeout is None else time.monotonic() + timeout
        ticket = object()
        with self._cond:
            self._queue.append(ticket)
            try:
                while True:
                    if self._queue[0] is ticket:
                        slot = self._take(need, asked)
                        if slot is not None:
                            return slot
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise TimeoutError(
                            f"no {need} bytes of staging came free within {timeout:.1f} s"
                        )
                    if give_up is not None:
                        if give_up():
                            raise TimeoutError("gave up waiting for staging")
                        remaining = min(remaining or GIVE_UP_POLL_S, GIVE_UP_POLL_S)
                    self._cond.wait(remaining)
            finally:
                self._queue.remove(ticket)
                self._cond.notify_all()  # the next taker in line may fit now

    def try_acquire(self, nbytes: int | None = None) -> int | None:
        """Take `nbytes` (a slot's worth by default) if they are free now and no blocking taker
        is waiting ahead."""
        asked = self.slot_bytes if nbytes is None else nbytes
        need = self._aligned(asked)
        with self._cond:
            return None if self._queue else self._take(need, asked)

    def release(self, slot: int) -> None:
        """Give a range back."""
        with self._cond:
            held = self._held.pop(slot, None)
            if held is None:
                raise ValueError(f"slot {slot} is not held")
            start, nbytes = held
            self._give_back(start, start + self._aligned(nbytes))
            self._cond.notify_all()

    def reset(self) -> None:
        """Make the whole pool free again (the pool changes hands between sessions)."""
        with self._cond:
            self._make_all_free()
            self._cond.notify_all()

    def offset(self, slot: int) -> int:
        """Byte offset of a held range in the registered region."""
        return self._held[slot][0]

    def size(self, slot: int) -> int:
        """Bytes of a held range, as asked for."""
        return self._held[slot][1]

    def slot_tensor(self, slot: int, dtype: torch.dtype) -> torch.Tensor:
        """A held range's memory as a flat tensor of `dtype`."""
        start, nbytes = self._held[slot]
        return self.buffer[start : start + nbytes].view(dtype)

    def _aligned(self, nbytes: int) -> int:
        """`nbytes` rounded up to `SLOT_ALIGNMENT`, if a slot holds them."""
        if not 0 < nbytes <= self.slot_bytes:
            raise ValueError(
                f"a staging range of {nbytes} bytes: must be 1 to {self.slot_bytes} (a slot); "
                "raise staging_bytes or lower staging_slots for larger chunks"
            )
        return -(-nbytes // SLOT_ALIGNMENT) * SLOT_ALIGNMENT

    def _make_all_free(self) -> None:
        self._free = [(0, self.slot_bytes * self.num_slots)]
        self._held.clear()

    def _take(self, need: int, asked: int) -> int | None:
        """First fit: the lowest free range of `need` aligned bytes for `asked` bytes (under
        the lock)."""
        for i, (start, end) in enumerate(self._free):
            if end - start >= need:
                if end - start == need:
                    del self._free[i]
                else:
                    self._free[i] = (start + need, end)
                slot = next(self._names)
                self._held[slot] = (start, asked)
                return slot
        return None

    def _give_back(self, start: int, end: int) -> None:
        """Return `[start, end)` to the free list, merged with its neighbours (under the lock)."""
        i = bisect.bisect_left(self._free, (start, end))
        if i < len(self._free) and self._free[i][0] == end:
            end = self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][1] == start:
            i -= 1
            start = self._free.pop(i)[0]
        self._free.insert(i, (start, end))

    def close(self) -> None:
        """Unregister the buffer."""
        self._transport.unregister(self.region)
