"""`StagingPool` lends aligned byte ranges of at most a slot: short chunks share what a slot
each would hold alone; ranges merge back; blocking takers are served in arrival order.

On `LocalTransport`'s registration (the pool needs nothing else from a transport); the threads
that wait are real and are waited on with events, not sleeps.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

from kvxfer.connector.staging import SLOT_ALIGNMENT, StagingPool
from kvxfer.testing import wait_until
from kvxfer.transport.local import LocalTransport

SLOT = 4 * SLOT_ALIGNMENT
WAIT_S = 20.0


@pytest.fixture
def pool() -> Iterator[StagingPool]:
    staging = StagingPool(LocalTransport(), 2 * SLOT, 2)
    yield staging
    staging.close()


def test_short_chunks_share_the_pool_in_disjoint_aligned_ranges(pool: StagingPool) -> None:
    taken = [pool.try_acquire(100) for _ in range(8)]  # 8 ranges of 256 bytes: the whole pool
    assert None not in taken
    assert pool.try_acquire(1) is None and pool.free_slots == 0
    offsets = sorted(pool.offset(s) for s in taken)
    assert offsets == [i * SLOT_ALIGNMENT for i in range(8)]
    # Each range's memory is its own: written through one, read back unchanged after the rest
    for value, slot in enumerate(taken):
        pool.slot_tensor(slot, torch.uint8).fill_(value)
        assert pool.size(slot) == 100 and pool.slot_tensor(slot, torch.uint8).numel() == 100
    for value, slot in enumerate(taken):
        assert bool((pool.slot_tensor(slot, torch.uint8) == value).all())
    for slot in taken:
        pool.release(slot)
    assert pool.free_slots == 2


def test_ranges_given_back_merge_into_a_slot_sized_one(pool: StagingPool) -> None:
    quarters = [pool.acquire(SLOT_ALIGNMENT) for _ in range(8)]
    # Give back the middle four out of order: together they hold one slot again
    for i in (3, 5, 2, 4):
        pool.release(quarters[i])
    assert pool.free_slots == 1
    whole = pool.try_acquire()
    assert whole is not None and pool.offset(whole) == 2 * SLOT_ALIGNMENT
    assert pool.size(whole) == SLOT and pool.try_acquire() is None


def test_bad_sizes_and_releases_are_refused_with_the_fix(pool: StagingPool) -> None:
    with pytest.raises(ValueError, match=r"1 to 1024 \(a slot\); raise staging_bytes"):
        pool.try_acquire(SLOT + 1)
    with pytest.raises(ValueError, match="1 to 1024"):
        pool.acquire(0)
    slot = pool.acquire()
    pool.release(slot)
    with pytest.raises(ValueError, match=f"slot {slot} is not held"):
        pool.release(slot)
    stale = pool.acquire(SLOT_ALIGNMENT)
    pool.reset()  # a new session's pool: the old holder's release cannot free a new range
    fresh = pool.acquire(SLOT_ALIGNMENT)
    with pytest.raises(ValueError, match="is not held"):
        pool.release(stale)
    assert pool.offset(fresh) == 0


def _wait_for_takers(pool: StagingPool, count: int) -> None:
    wait_until(lambda: pool.waiting_takers >= count, WAIT_S, f"{count} waiting takers", 0.001)
    assert pool.waiting_takers == count


def test_blocking_takers_are_served_in_arrival_order(pool: StagingPool) -> None:
    """A slot-sized taker that came first is not passed over by a short one that came after
    it (blocking or not), though the room freed would fit the short one."""
    shorts = [pool.acquire(SLOT_ALIGNMENT) for _ in range(8)]  # the pool is full
    order: list[str] = []

    def take(name: str, nbytes: int | None) -> None:
        pool.acquire(nbytes, timeout=WAIT_S)
        order.append(name)

    big = threading.Thread(target=take, args=("big", None))
    big.start()
    _wait_for_takers(pool, 1)
    small = threading.Thread(target=take, args=("small", SLOT_ALIGNMENT))
    small.start()
    _wait_for_takers(pool, 2)
    pool.release(shorts.pop())  # room for a short chunk, not for the taker ahead of it
    assert pool.try_acquire(SLOT_ALIGNMENT) is None
    # Time for a wrong pool to hand the room to the small taker (a right one never does)
    time.sleep(0.05)
    assert order == [] and pool.waiting_takers == 2  # the small taker still waits its turn
    for slot in shorts:
        pool.release(slot)
    for taker in (big, small):
        taker.join(WAIT_S)
        assert not taker.is_alive()
    assert order == ["big", "small"] and pool.waiting_takers == 0


def test_a_blocked_taker_gives_up_when_told_or_at_its_timeout(pool: StagingPool) -> None:
    pool.acquire()
    pool.acquire()
    stop = threading.Event()
    errors: list[BaseException] = []

    def wait_for_room() -> None:
        try:
            pool.acquire(SLOT_ALIGNMENT, timeout=WAIT_S, give_up=stop.is_set)
        except TimeoutError as exc:
            errors.append(exc)

    taker = threading.Thread(target=wait_for_room)
    taker.start()
    stop.set()
    taker.join(WAIT_S)
    assert not taker.is_alive() and "gave up" in str(errors[0])
    with pytest.raises(TimeoutError, match=r"within 0\.1 s"):
        pool.acquire(SLOT_ALIGNMENT, timeout=0.1)
