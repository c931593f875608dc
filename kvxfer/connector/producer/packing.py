"""`Packer`: a producer's staging and its packs: each consumer session's pool (taken at its
first pack, recycled once its holds end), the pack programs warmed up per consumer geometry,
the fences packs wait for on CUDA, and the pack of one chunk into a staging range.

Threads: `pack_inline` runs on the side channel (a small CPU pack, never waiting for room);
`pack_on_worker` submits to the session's worker, which waits for room, packs, and posts the
result back to the side channel (`post`); nothing here decides what a pack's result means
(`kvxfer.connector.producer.serving` does). Fences are set by the engine's threads (publish,
mark_ready) and read by the packs: they, and the pools' hand-out, are under this object's lock.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvxfer.connector.messages import ChunkReady, RegionInfo, TransferRequest
from kvxfer.connector.producer.sessions import ConsumerSession, ServedChunk
from kvxfer.connector.staging import StagingPool
from kvxfer.connector.streams import CopyStream, Fence, copies_inline
from kvxfer.execute import Backend, run_cell_copy, warm_up
from kvxfer.plan import HeadRoute
from kvxfer.plan.program import TRAITS, CellCopy, PairChunk
from kvxfer.spec import KVCacheSpec
from kvxfer.transport.base import Transport

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PackJob:
    """A chunk to pack into staging and offer: the answer made for it (without its staging
    range yet) and the pack."""

    chunk: ServedChunk
    ready: ChunkReady
    pack: CellCopy

    @property
    def ask(self) -> TransferRequest:
        return self.chunk.ask


# (the side channel) What became of a pack: its pool and range (None: none was taken), and
# the error that ended it, if any.
PackDone = Callable[
    [ConsumerSession, PackJob, StagingPool | None, int | None, Exception | None], None
]


class Packer:
    """Packs chunks of this rank's cache into per-session staging pools.

    Args:
        spec: this rank's geometry.
        caches: this rank's layer tensors.
        transport: registers the pools' memory.
        backend: the resolved pack backend.
        copy_stream: where packs run (a CUDA side stream, or inline).
        staging_bytes: each session's pool, in bytes.
        staging_slots: slots in each pool.
        post: runs a callable on the side-channel thread (`SideChannelServer.post`).
    """

    def __init__(
        self,
        spec: KVCacheSpec,
        caches: Sequence[torch.Tensor],
        transport: Transport,
        backend: Backend,
        copy_stream: CopyStream,
        staging_bytes: int,
        staging_slots: int,
        post: Callable[[Callable[[], None]], None],
    ) -> None:
        self.spec = spec
        self.caches = list(caches)
        self.transport = transport
        self._backend = backend
        self._copy_stream = copy_stream
        self._staging_bytes, self._staging_slots = staging_bytes, staging_slots
        self.slot_bytes = StagingPool.slot_size(staging_bytes, staging_slots)
        self._post = post
        self._lock = threading.Lock()
        self._fences: dict[str, Fence] = {}  # CUDA: by published request (`KVProducer.publish`)
        self._spare_pools: list[StagingPool] = []
        self._warmed: set[tuple[object, ...]] = set()
        self.closed = False

    # ---- fences (the engine's threads, the packs) -----------------------------------------

    def fence(self) -> Fence:
        """What a pack from now on must wait for: the caller's stream so far (None inline)."""
        return self._copy_stream.fence()

    def set_fence(self, request_id: str, fence: Fence) -> None:
        """Packs of `request_id` wait for `fence` from now on (a later one covers more)."""
        if fence is not None:
            with self._lock:
                self._fences[request_id] = fence

    def drop_fence(self, request_id: str) -> None:
        with self._lock:
            self._fences.pop(request_id, None)

    # ---- packs ----------------------------------------------------------------------------

    def warm_up(self, route: HeadRoute, consumer_spec: KVCacheSpec) -> None:
        """(a session's worker) Compile the packs this pair may ask for now, not on its first
        request."""
        key = (
            route.num_heads,
            route.src_head_offset,
            consumer_spec.block_size,
            consumer_spec.layout,
            consumer_spec.kv_placement,
        )
        if key in self._warmed:
            return
        one = np.zeros(1, dtype=np.int64)
        for strategy in (s for s, traits in TRAITS.items() if traits.send_from != "cache"):
            pack = PairChunk(route, strategy, self.spec, consumer_spec, 0, 1).pack(one)
            assert pack is not None
            dtype, device = self.caches[0].dtype, self.caches[0].device
            compile_pack = functools.partial(warm_up, pack, dtype, device, self._backend)
            self._copy_stream.launch(compile_pack).wait()  # on the side stream's device
        self._warmed.add(key)

    def pack_bytes(self, pack: CellCopy) -> int:
        """The staging bytes a pack fills: between two KV dtypes, the destination's."""
        layers = pack.num_layers or self.spec.num_layers  # the route's layers
        return layers * pack.dst.geometry.layer_bytes

    def pack_inline(self, session: ConsumerSession, job: PackJob, done: PackDone) -> bool:
        """(the side channel) Pack a small CPU chunk here and report it to `done`, if its
        staging bytes are free at once (never waiting: a taker already waiting for room keeps
        its turn, see `StagingPool.try_acquire`). Returns whether it did; else the caller
        submits it to the session's worker.

        Order between chunks does not matter (each is its own range and answer); what the
        side channel spends is one short copy."""
        nbytes = self.pack_bytes(job.pack)
        if not copies_inline(self.caches[0].device, self._backend, nbytes):
            return False
        pool = self.pool_for(session)
        slot = pool.try_acquire(nbytes)
        if slot is None:
            return False
        done(session, job, pool, slot, self._pack_into(job, pool, slot, nbytes))
        return True

    def pack_on_worker(self, session: ConsumerSession, job: PackJob, done: PackDone) -> None:
        """Queue the pack on the session's worker: it waits for staging room (up to the fetch's
        remaining time), packs, and posts the result to `done` on the side channel."""
        session.worker.submit(self._pack_and_post, session, job, done)

    def _pack_and_post(self, session: ConsumerSession, job: PackJob, done: PackDone) -> None:
        """(the session's worker) Wait for room, pack, post the result back."""
        pool: StagingPool | None = None
        slot: int | None = None
        error: Exception | None = None
        try:
            pool = self.pool_for(session)
            nbytes = self.pack_bytes(job.pack)
            timeout = max(job.ask.wait_seconds, 0.1)
            give_up = lambda: self.closed or session.ended  # noqa: E731 - its consumer's leases fill it
            slot = pool.acquire(nbytes, timeout=timeout, give_up=give_up)
            error = self._pack_into(job, pool, slot, nbytes)
        except Exception as exc:  # no room in time, or the session ended meanwhile
            error = exc
        self._post(lambda: done(session, job, pool, slot, error))

    def _pack_into(
        self, job: PackJob, pool: StagingPool, slot: int, nbytes: int
    ) -> Exception | None:
        """Pack the chunk into `nbytes` at `slot` of `pool`: after the request's fence, then
        this pack's own event only (the NIC reads finished bytes, and nothing waits for the
        engine's later work). Returns the error that ended it, if any."""
        try:
            staging = pool.slot_tensor(slot, torch.uint8)
            with self._lock:
                fence = self._fences.get(job.ask.request_id)
            run = functools.partial(run_cell_copy, job.pack, self.caches, [staging], self._backend)
            self._copy_stream.launch(run, fence).wait()
        except Exception as exc:
            return exc
        return None

    def staging_region(self, pool: StagingPool, slot: int, nbytes: int) -> RegionInfo:
        """Where a consumer reads `nbytes` at `slot` of `pool`."""
        return RegionInfo(pool.region.region_id, pool.region.address + pool.offset(slot), nbytes)

    # ---- pools ----------------------------------------------------------------------------

    def pool_for(self, session: ConsumerSession) -> StagingPool:
        """The session's pool: a spare one, or a new one at its first pack."""
        with self._lock:
            if session.pool is None:
                spare = self._spare_pools.pop() if self._spare_pools else None
                session.pool = spare or StagingPool(
                    self.transport,
                    self._staging_bytes,
                    self._staging_slots,
                    self.caches[0].device,
                )
            return session.pool

    def recycle(self, session: ConsumerSession) -> None:
        """(the side channel) An ended session's packs are over and its holds ended: its pool
        becomes a spare (freed whole: no range of it is anyone's any more)."""
        with self._lock:
            pool, session.pool = session.pool, None
            if pool is not None:
                pool.reset()
                self._spare_pools.append(pool)

    @property
    def spare_pools(self) -> int:
        return len(self._spare_pools)

    def stop(self) -> None:
        """Packs waiting for room give up from now on (the producer is closing)."""
        self.closed = True

    def close(self, sessions: Sequence[ConsumerSession]) -> None:
        """Free every pool: the sessions' and the spares (the engine has stopped: no read can
        come any more)."""
        self.closed = True
        with self._lock:
            pools = [s.pool for s in sessions if s.pool is not None] + self._spare_pools
            for session in sessions:
                session.pool = None
            self._spare_pools = []
        for pool in pools:
            pool.close()


def give_back(pool: StagingPool | None, slot: int | None) -> None:
    """Return a range to its session's pool. A range the pool no longer holds was freed by its
    reset (the session ended and its pool was recycled)."""
    if pool is None or slot is None:
        return
    with contextlib.suppress(ValueError):
        pool.release(slot)
