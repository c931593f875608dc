"""`CopyStream`: where a connector's local copies (packs, unpacks) run, and how a thread waits
for one of them without waiting for anything else.

CPU tensors: a copy runs in the calling thread and is finished when `launch` returns.

CUDA tensors: a copy runs on a side stream the connector owns (one per producer or consumer, on
its cache's device), never on the engine's stream and never behind the model's compute. Two
events order it:

- `fence()`, called on the engine's thread when the engine hands a request over (the producer's
  `publish`, the consumer's `fetch`), records an event on that thread's current stream. The copy
  waits for it on the GPU (`Stream.wait_event`, no host sync): a pack then sees the KV of every
  kernel the engine enqueued before the publish (the forward passes that wrote it may still be
  running), and an unpack writes its blocks only after every kernel enqueued before the fetch
  (one that still reads those blocks for their previous owner) is done. Work the engine
  enqueues later, such as the next forward pass, is never waited for.
- `launch` records an event after the copy; the worker waits on that event alone
  (`CopyDone.wait`: `Event.synchronize`, a blocking-sync event that does not spin a core), never
  on a stream or the device. Only then does the producer answer `ChunkReady` (the NIC reads
  finished bytes) and the consumer release the slot and report the chunk (the engine reads
  finished blocks).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

Fence = torch.cuda.Event | None
"""What `fence()` recorded: an event on the engine's stream (CUDA), or None (CPU)."""


class CopyDone(Protocol):
    """A launched copy."""

    def done(self) -> bool:
        """Whether the copy has finished (never blocks)."""
        ...

    def wait(self) -> None:
        """Block the calling thread until this copy has finished (CUDA: its own event, so at
        most the copies queued before it on the side stream too; never the engine's work)."""
        ...


class CopyStream(Protocol):
    """Runs a connector's copies (see the module docstring)."""

    def fence(self) -> Fence:
        """Mark what the calling thread's current stream has enqueued so far (call it on the
        engine's thread when a request is handed over)."""
        ...

    def launch(self, copy: Callable[[], None], after: Fence = None) -> CopyDone:
        """Start `copy` (which launches its kernels on the current stream) once the work that
        `after` marked is done."""
        ...


class _Finished:
    """A copy that ran inline."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        pass


_FINISHED = _Finished()


class InlineCopyStream:
    """CPU tensors: every copy runs in the calling thread; nothing to fence or wait for."""

    def fence(self) -> Fence:
        return None

    def launch(self, copy: Callable[[], None], after: Fence = None) -> CopyDone:
        copy()
        return _FINISHED


class _EventDone:
    """A copy on a CUDA side stream, followed by its event."""

    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def done(self) -> bool:
        return bool(self.event.query())

    def wait(self) -> None:
        self.event.synchronize()  # this event only; releases the GIL while it waits


class CudaCopyStream:
    """CUDA tensors: copies run on one side stream of `device`, owned by this object.

    Any thread may call `launch` (the current stream is per thread, so switching to the side
    stream here does not change the engine's). Copies launched from several threads queue on the
    same side stream; each one's event then also waits for the copies queued before it, which
    only ever delays a `wait`, never shortens one.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def fence(self) -> Fence:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def launch(self, copy: Callable[[], None], after: Fence = None) -> CopyDone:
        # The device too: a worker thread's current device is 0 whatever the caches' device.
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            try:
                copy()
            except BaseException:
                # Kernels it launched before failing may still write: the caller reuses the
                # slot or reports the blocks failed at once, so wait for them first.
                self._event().synchronize()
                raise
            finished = self._event()
        return _EventDone(finished)

    def _event(self) -> torch.cuda.Event:
        """An event after everything queued on the side stream so far."""
        event = torch.cuda.Event(blocking=True)
        event.record(self.stream)
        return event


# A CPU copy of at most this many bytes runs on the loop that asked for it: a producer's pack on
# its side-channel thread (`Packer.pack_inline`), a consumer's unpack on its loop
# (`CacheCopier.start`). A 16-token chunk's copy costs less than the two thread hand-overs a
# worker costs it (the worker's wake-up, then its answer back to the loop). 4 MiB (0.6 ms of
# copying, 512 tokens of 8 layers and 2 heads of 128) and not 1: sixteen 256-token requests at
# once went from 91-99 to 108-112 a second (benchmarks/history/2026-12-03.md).
INLINE_COPY_BYTES = 4 << 20


def copies_inline(device: torch.device, backend: str, nbytes: int) -> bool:
    """Whether a copy of `nbytes` runs on the calling loop's thread rather than a worker: a
    small one with the torch backend on the CPU, done when it returns (a CUDA copy waits for
    its event, which could queue behind other copies on the side stream)."""
    return device.type == "cpu" and backend == "torch" and nbytes <= INLINE_COPY_BYTES


def copy_stream_for(device: torch.device) -> CopyStream:
    """A side stream on CUDA devices; inline copies elsewhere."""
    if device.type == "cuda":
        return CudaCopyStream(device)
    return InlineCopyStream()
