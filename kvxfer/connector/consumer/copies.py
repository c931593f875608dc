"""`CacheCopier`: the consumer's local copies, from a staging slot into the cache.

The cache is written by these copies alone, and only once a chunk's read has landed and the
producer confirmed its source was held throughout. They run on a small pool of threads, off
the loop, except a small CPU copy (`kvxfer.connector.streams.copies_inline`), which runs on the
loop itself: a 16-token chunk's unpack costs less than the two thread hand-overs a pool thread
costs it (the producer packs small CPU chunks on its side-channel thread by the same rule).
On CUDA each launches its copy on the consumer's side stream after the fetch's fence
(`kvxfer.connector.streams`) and waits for that copy's own event, so that a chunk counts as done
(its slot read into again, its blocks reported) only once its bytes are in the cache.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from kvxfer.connector.staging import StagingPool
from kvxfer.connector.streams import Fence, copies_inline, copy_stream_for
from kvxfer.execute import Backend, run_cell_copy, warm_up
from kvxfer.plan.fitting import FittedPair
from kvxfer.plan.program import CellCopy, PairChunk
from kvxfer.spec import KVCacheSpec


class CacheCopier:
    """Copies landed chunks from staging slots into this rank's `caches`.

    Args:
        caches: this rank's layer tensors.
        backend: the copy backend (resolved: "torch" or "triton").
        workers: threads running copies.
    """

    def __init__(self, caches: Sequence[torch.Tensor], backend: Backend, workers: int) -> None:
        self._caches = list(caches)
        self._backend = backend
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="kvxfer-copy")
        self._stream = copy_stream_for(caches[0].device)

    @property
    def threads(self) -> int:
        """Copy threads started so far."""
        return len(getattr(self._pool, "_threads", ()))

    def fence(self) -> Fence:
        """(the engine's thread) What the copies of a fetch begun now wait for on the device."""
        return self._stream.fence()

    def start(self, copy: CellCopy, pool: StagingPool, slot: int, fence: Fence) -> Future[None]:
        """Copy staging slot `slot` of `pool` into the cache by `copy` (after `fence`); the
        future completes once the copy has finished (on CUDA: its own event). A small CPU copy
        has run by the time this returns (its future is done)."""
        layers = copy.num_layers or len(self._caches)  # the route's layers
        # In bytes: between two KV dtypes the staging holds the source's (run_cell_copy views it)
        nbytes = layers * copy.src.geometry.layer_bytes
        staging = pool.slot_tensor(slot, torch.uint8)[:nbytes]
        run = functools.partial(run_cell_copy, copy, [staging], self._caches, self._backend)
        if copies_inline(self._caches[0].device, self._backend, nbytes):
            return _run_now(run)
        return self._pool.submit(self._copy_into_cache, run, fence)

    def warm_up(self, pair: FittedPair, producer: KVCacheSpec, consumer: KVCacheSpec) -> None:
        """Compile the pair's unpack kernel now, not on its first request (on the side stream's
        device; nothing to do for the torch backend or a strategy without an unpack)."""
        plan = pair.plan
        ids = np.zeros(1, np.int64)
        chunk = PairChunk(plan.route, plan.strategy, producer, consumer, 0, 1, landing=True)
        unpack = chunk.unpack(ids)
        if unpack is None:
            return
        dtype, device = self._caches[0].dtype, self._caches[0].device
        compile_unpack = functools.partial(warm_up, unpack, dtype, device, self._backend)
        self._stream.launch(compile_unpack).wait()

    def close(self) -> None:
        """Wait for the copies in flight, then stop the threads."""
        self._pool.shutdown(wait=True)

    def _copy_into_cache(self, run: Callable[[], None], fence: Fence) -> None:
        """(a copy thread) Run one chunk's copy and return once it has finished: only then is
        its slot read into again and its blocks reported."""
        self._stream.launch(run, fence).wait()  # this copy's own event, on CUDA


def _run_now(run: Callable[[], None]) -> Future[None]:
    """Run a CPU copy on this thread; its outcome as a finished future."""
    future: Future[None] = Future()
    try:
        run()
    except Exception as exc:
        future.set_exception(exc)
    else:
        future.set_result(None)
    return future
