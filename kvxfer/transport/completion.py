"""`CompletionPump`: submits a Mooncake engine's descriptors and polls them to completion,
without spinning, on one thread per engine, or on its owner's thread (a driven pump).

Every call into the engine runs on one thread: the pump's, or its owner's for a driven pump
(submitting on the caller's thread while the pump's thread polled hung `kvxfer bench`'s
producers, whose writes come from another thread). A driven pump has no thread: its owner, a
loop that already wakes for its own events, submits at `add` and calls `drive` every turn,
coming back when `drive` says the next poll is due while anything is in flight. A consumer
drives the engine it owns from its loop: a short read then costs no thread hand-over at all
(a wake-up of another thread costs about 0.1 ms on a busy 2-core machine, the time Mooncake
takes to read 0.5 MB over loopback). A read is first polled `POLL_SECONDS` after its submit,
never at once: it cannot have landed yet.

Why one descriptor per Mooncake batch: a batch's status turns failed (-1) as soon as one of its
descriptors fails while the others may still be running, and they still land afterwards
(measured on the non-CUDA wheel 0.3.13: a 64-descriptor read from a SIGSTOPped peer reported -1
after Mooncake's 30 s no-progress limit, and 255 of its 256 MiB landed after SIGCONT). kvxfer's
no-late-byte contract needs to know when *every* descriptor has settled, so each is its own
batch (2,000 single-descriptor reads of 32 KiB: 9 ms to submit, 113 ms to complete on loopback,
no slower than one batch).

A submit that returns 0 or less was refused (0: the peer could not be reached) and must never
be polled: asking the status of batch 0 crashes the process.

Why polling: `get_batch_transfer_status` blocks and spins (0.8 of a core while a peer is frozen);
`transfer_check_status` answers at once (0 running, 1 done, -1 failed) and frees the batch once
it has answered a final status, so each batch is asked until then and never again.

How often: a young read is polled every `POLL_SECONDS` (0.2 ms), an older one every eighth of
the time since the last submit (`POLL_FRACTION`), at most `MAX_POLL_SECONDS` apart. A short
read (a small request's, under 1.6 ms) is found as soon as before; a long one waits at most an
eighth of its age, 2 ms at most, and is polled several times less often (a 20 ms read about 30
times instead of 100). Each poll of a driven pump is a turn of its consumer's loop, CPU that
the copies need on a small machine: in `kvxfer bench` on the project's 2-core machine the
consumers' loops went from 13-16 to 7-13 ms of CPU per 100.7 MB run
(benchmarks/history/2026-12-03.md, measured with benchmarks/studies/thread_cpu.py).

Caps: more than about 2,048 descriptors in flight make an engine fail every later transfer
(module docstring of `kvxfer.transport.mooncake`), so at most `TOTAL_IN_FLIGHT` are in flight
per engine and at most `PEER_IN_FLIGHT` per peer: a frozen peer holds a quarter of the engine's
capacity at most, and the others keep moving.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvxfer.transport.base import Direction, TransferError

log = logging.getLogger(__name__)

TOTAL_IN_FLIGHT = 1024
PEER_IN_FLIGHT = 256
# The shortest wait between polls: about Mooncake's own time for a 0.5 MB read over loopback
# (0.1-0.2 ms, `benchmarks/floor.py`), so a small request's read is found within its own time.
POLL_SECONDS = 0.0002
POLL_FRACTION = 0.125  # of the time since the last submit: the wait between polls after that
MAX_POLL_SECONDS = 0.002  # the longest wait between polls while anything is in flight
IDLE_SECONDS = 0.05  # nothing in flight: wake at least this often to notice close()


@dataclass
class _Op:
    """One `add` call: its descriptors and its future."""

    endpoint: str
    direction: Direction
    local: list[int]
    remote: list[int]
    lengths: list[int]
    future: Future[None]
    next_index: int = 0  # descriptors below it were submitted
    unsettled: int = 0
    failed: list[int] = field(default_factory=list)

    @property
    def all_submitted(self) -> bool:
        return self.next_index >= len(self.lengths)


def poll_interval(since_submit: float) -> float:
    """The wait between two polls, `since_submit` seconds after the last submit:
    `POLL_FRACTION` of that, between `POLL_SECONDS` and `MAX_POLL_SECONDS` (module docstring)."""
    return min(MAX_POLL_SECONDS, max(POLL_SECONDS, since_submit * POLL_FRACTION))


class CompletionPump:
    """Moves descriptors through one engine: queued per peer, submitted within the caps,
    polled until each settles. An op's future completes once every descriptor of it has
    settled, never earlier: then nothing of it can land any more.

    Args:
        engine: the Mooncake engine.
        name: the thread's name.
        threaded: run the thread; else the pump is driven (`drive`), and every call but
            `in_flight` and `stop` comes from its owner's one thread.
    """

    def __init__(self, engine: Any, name: str, threaded: bool = True) -> None:
        self._engine = engine
        self._cond = threading.Condition()
        self._queues: dict[str, deque[_Op]] = {}
        self._in_flight: list[tuple[int, _Op, int]] = []  # (batch id, op, descriptor index)
        self._per_peer: dict[str, int] = {}
        self._stopped = False
        self._polled = 0.0  # when the pump last polled
        self._submitted = 0.0  # when a descriptor was last submitted
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
            self._thread.start()

    def add(
        self,
        endpoint: str,
        direction: Direction,
        local: np.ndarray,
        remote: np.ndarray,
        lengths: np.ndarray,
    ) -> Future[None]:
        """Queue descriptors (local address, remote address, length) for one peer (a driven
        pump submits those that fit the caps now, on its owner's thread).

        Returns:
            A future that completes when every descriptor has settled; it fails with
            `TransferError` if any failed.
        """
        future: Future[None] = Future()
        op = _Op(endpoint, direction, local.tolist(), remote.tolist(), lengths.tolist(), future)
        if not op.lengths:
            future.set_result(None)
            return future
        with self._cond:
            if self._stopped:
                raise TransferError("the transport is closed")
            op.unsettled = len(op.lengths)
            self._queues.setdefault(endpoint, deque()).append(op)
            self._cond.notify()
        if self._thread is None:  # driven: on its way now, on the owner's thread
            self._submit_what_fits()
        return future

    def drive(self) -> float | None:
        """(a driven pump's owner every turn, or the pump's thread) Submit what fits the caps;
        poll what is in flight if its poll is due (`_poll_due_in`).

        Returns:
            The seconds until the next poll is due (the owner turns again by then), or None
            when nothing is queued or in flight.
        """
        self._submit_what_fits()
        if self._poll_due_in() == 0.0:
            self._polled = time.monotonic()
            self._poll()
        with self._cond:
            if not self._has_work():
                return None
        return self._poll_due_in()

    def in_flight(self, endpoint: str | None = None) -> int:
        """Descriptors submitted and not settled (for one peer, or all)."""
        with self._cond:
            if endpoint is None:
                return len(self._in_flight)
            return self._per_peer.get(endpoint, 0)

    def stop(self) -> list[Future[None]]:
        """Stop the thread; return the futures of ops that had not settled (the caller fails
        them once the engine is gone and nothing of them can land)."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
        ops = {id(op): op for _, op, _ in self._in_flight}
        ops.update({id(op): op for queue in self._queues.values() for op in queue})
        self._engine = None
        return [op.future for op in ops.values() if not op.future.done()]

    # ---- the thread -----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._stopped:
                    return
                if not self._has_work():
                    self._cond.wait(IDLE_SECONDS)
                    continue
            due_in = self.drive()
            with self._cond:  # until the next poll is due, or an `add` brings more to submit
                if not self._stopped and due_in:
                    self._cond.wait(due_in)

    def _poll_due_in(self) -> float:
        """Seconds until the next poll is due (0: now): `poll_interval` after the last poll or
        the last submit, whichever came later (a read just submitted is not polled at once:
        it cannot have landed yet)."""
        now = time.monotonic()
        since = max(self._polled, self._submitted)
        return max(0.0, since + poll_interval(now - self._submitted) - now)

    def _has_work(self) -> bool:
        """Descriptors queued or in flight (called under the lock)."""
        return bool(self._in_flight) or any(self._queues.values())

    def _submit_what_fits(self) -> None:
        with self._cond:
            if self._stopped:
                return
            batch = self._take_submittable()
        if batch:
            self._submitted = time.monotonic()
        for endpoint, op, index in batch:
            self._submit(endpoint, op, index)

    def _take_submittable(self) -> list[tuple[str, _Op, int]]:
        """Descriptors that fit the caps, round-robin over peers (called under the lock)."""
        taken: list[tuple[str, _Op, int]] = []
        room = TOTAL_IN_FLIGHT - len(self._in_flight)
        progress = True
        while room > 0 and progress:
            progress = False
            for endpoint, queue in self._queues.items():
                if not queue or room <= 0:
                    continue
                if self._per_peer.get(endpoint, 0) >= PEER_IN_FLIGHT:
                    continue
                op = queue[0]
                taken.append((endpoint, op, op.next_index))
                op.next_index += 1
                if op.all_submitted:
                    queue.popleft()
                self._per_peer[endpoint] = self._per_peer.get(endpoint, 0) + 1
                room -= 1
                progress = True
        return taken

    def _submit(self, endpoint: str, op: _Op, index: int) -> None:
        call = (
            self._engine.batch_transfer_async_read
            if op.direction == "read"
            else self._engine.batch_transfer_async_write
        )
        try:
            batch_id = call(endpoint, [op.local[index]], [op.remote[index]], [op.lengths[index]])
        except Exception:
            log.exception("Mooncake %s submit to %s raised", op.direction, endpoint)
            batch_id = -1
        if batch_id <= 0:  # refused at submit (0: peer unknown): settled, nothing in flight
            with self._cond:
                self._per_peer[endpoint] -= 1
            self._settle(op, index, ok=False)
            return
        with self._cond:
            self._in_flight.append((batch_id, op, index))

    def _poll(self) -> None:
        with self._cond:
            in_flight = list(self._in_flight)
        settled: list[tuple[int, _Op, int, bool]] = []
        for batch_id, op, index in in_flight:
            status = self._engine.transfer_check_status(batch_id)
            if status != 0:
                settled.append((batch_id, op, index, status == 1))
        if not settled:
            return
        done_ids = {batch_id for batch_id, _, _, _ in settled}
        with self._cond:
            self._in_flight = [e for e in self._in_flight if e[0] not in done_ids]
            for _, op, _, _ in settled:
                self._per_peer[op.endpoint] -= 1
        for _, op, index, ok in settled:
            self._settle(op, index, ok)

    def _settle(self, op: _Op, index: int, ok: bool) -> None:
        if not ok:
            op.failed.append(index)
        op.unsettled -= 1
        if op.unsettled > 0:
            return
        if op.failed:
            first = min(op.failed)
            op.future.set_exception(
                TransferError(
                    f"Mooncake {op.direction} {'from' if op.direction == 'read' else 'to'} "
                    f"{op.endpoint} failed for {len(op.failed)} "
                    f"of {len(op.lengths)} segments (first: segment {first}, "
                    f"{op.lengths[first]} bytes)"
                )
            )
        else:
            op.future.set_result(None)
