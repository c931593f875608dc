"""`StagingPool`: a registered buffer cut into equal slots, one chunk of a transfer per slot.

A full pool means waiting for a slot, never failing. A slot that a transfer may still land in
stays held by its holder until that transfer has settled (the consumer's quarantine).
"""

from __future__ import annotations

import threading
import time

import torch

from kvxfer.transport.base import Region, Transport

SLOT_ALIGNMENT = 256  # bytes; keeps every slot aligned for any dtype and for RDMA


class StagingPool:
    """`num_slots` slots of `slot_bytes` bytes in one registered buffer."""

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
        self._free = list(range(num_slots))
        self._cond = threading.Condition()

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
        """Slots available now."""
        with self._cond:
            return len(self._free)

    def acquire(self, timeout: float | None = None) -> int:
        """Take a slot, waiting until one is free.

        Raises:
            TimeoutError: no slot came free within `timeout` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._free:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"no staging slot came free within {timeout:.1f} s")
                self._cond.wait(remaining)
            return self._free.pop()

    def try_acquire(self) -> int | None:
        """Take a slot if one is free."""
        with self._cond:
            return self._free.pop() if self._free else None

    def release(self, slot: int) -> None:
        """Give a slot back."""
        with self._cond:
            if slot in self._free or not 0 <= slot < self.num_slots:
                raise ValueError(f"slot {slot} is not held")
            self._free.append(slot)
            self._cond.notify()

    def reset(self) -> None:
        """Make every slot free again (the pool changes hands between sessions)."""
        with self._cond:
            self._free = list(range(self.num_slots))
            self._cond.notify_all()

    def offset(self, slot: int) -> int:
        """Byte offset of a slot in the registered region."""
        return slot * self.slot_bytes

    def slot_tensor(self, slot: int, dtype: torch.dtype) -> torch.Tensor:
        """A slot's memory as a flat tensor of `dtype`."""
        start = self.offset(slot)
        return self.buffer[start : start + self.slot_bytes].view(dtype)

    def close(self) -> None:
        """Unregister the buffer."""
        self._transport.unregister(self.region)
