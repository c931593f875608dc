"""Dead and restarted peers: a producer SIGKILLed mid-transfer fails the fetch within seconds
(not at its timeout), a restarted producer serves again, a consumer closed mid-fetch returns at
once; never a byte after the result."""

from __future__ import annotations

import time

import pytest

from kvxfer.testing import (
    DECODE,
    PREFILL,
    SLOW_STAGING,
    BlockPool,
    Request,
    describe,
    leaks,
    wait_for_progress,
    watch_for_late_bytes,
)
from kvxfer.testing.checks import settle_results

SLOW = {"strategy": "pack+unpack", **SLOW_STAGING}  # a 4 MiB request in hundreds of chunks
DEAD_PEER_BOUND_S = 3.5  # a killed peer is found by its closed connection, within a second


@pytest.mark.parametrize("peer_timeout_s", [2.0, 60.0], ids=["default", "long-silence-timeout"])
def test_killed_producer_fails_the_fetch_within_seconds(rig, peer_timeout_s):
    """Found by its closed connection, not by its silence: as fast with a `peer_timeout_s`
    far beyond the bound (one long enough for a loaded machine's unscheduled seconds)."""
    big = Request("big", 4096, seed=1)
    consumer_options = {**SLOW, "peer_timeout_s": peer_timeout_s}
    producer, consumer, ids = rig.published_pair(big, SLOW_STAGING, consumer_options)

    consumer.fetch(big, ids, timeout=8.0)
    wait_for_progress(consumer, ids)
    producer.kill()
    killed_at = time.monotonic()
    result = consumer.result(big.request_id, timeout=8.0 + 5)
    took = result["finished"] - killed_at
    assert took <= DEAD_PEER_BOUND_S, f"the fetch returned {took:.1f} s after the kill"
    assert not result["ok"]
    failed = result["failed_block_ids"]
    assert failed and set(failed) <= set(ids.tolist())
    consumer.model.settle(ids, big, failed)
    groups = {"failed": failed, "request": ids}
    bad = consumer.model.mismatches()
    assert not bad, f"at the result: {describe(bad, groups)}"
    late = watch_for_late_bytes([consumer], 1.5)
    assert not late, describe(late[consumer.name], groups)
    problems = leaks([], [consumer], timeout=10.0)
    assert not problems, problems


def _fetch_exact(consumer, request, ids, timeout=10.0) -> None:
    consumer.fetch(request, ids, timeout=timeout)
    result = consumer.result(request.request_id, timeout=timeout + 5)
    assert result["ok"], f"{request.request_id}: {result['errors'][:3]}"
    consumer.model.settle(ids, request, result["failed_block_ids"])
    bad = consumer.model.mismatches()
    assert not bad, f"{request.request_id}: {describe(bad, {'request': ids})}"


@pytest.mark.parametrize("same_port", [False, True], ids=["new-address", "same-address"])
def test_a_restarted_producer_serves_the_next_fetch(rig, same_port):
    """The same engine restarted: at a new address it serves once the consumer connects to
    it; at the same address the consumer needs no connect() call."""
    first = rig.producer(PREFILL, options=SLOW_STAGING)
    consumer = rig.consumer(DECODE, options=SLOW)
    consumer.connect([first.address])
    src, dst = BlockPool(PREFILL.num_blocks, 1), BlockPool(DECODE.num_blocks, 2)
    before, after = Request("before", 512, seed=1), Request("after", 512, seed=2)
    first.publish(before, src.take(PREFILL.blocks_for(512)))
    _fetch_exact(consumer, before, dst.take(DECODE.blocks_for(512)))

    first.kill()
    if same_port:
        second = rig.producer(PREFILL, port=first.port, options=SLOW_STAGING)
        assert second.address == first.address
    else:
        second = rig.producer(PREFILL, options=SLOW_STAGING)  # same engine id, a new port
        assert second.address != first.address
        consumer.connect([second.address])
    second.publish(after, src.take(PREFILL.blocks_for(512)))
    _fetch_exact(consumer, after, dst.take(DECODE.blocks_for(512)))
    problems = leaks([second], [consumer], timeout=10.0)
    assert not problems, problems


def test_consumer_closed_mid_fetch_returns_at_once_and_nothing_lands(rig):
    producer = rig.producer(PREFILL, options=SLOW_STAGING)
    consumer = rig.consumer(DECODE, options=SLOW)
    consumer.connect([producer.address])
    src, dst = BlockPool(PREFILL.num_blocks, 1), BlockPool(DECODE.num_blocks, 2)
    moving, waiting = Request("moving", 4096, seed=1), Request("waiting", 512, seed=2)
    src_ids = {r.request_id: src.take(PREFILL.blocks_for(r.num_tokens)) for r in (moving, waiting)}
    ids = {r.request_id: dst.take(DECODE.blocks_for(r.num_tokens)) for r in (moving, waiting)}
    producer.publish(moving, src_ids["moving"], deadline_s=4.0)

    consumer.fetch(moving, ids["moving"], timeout=6.0)
    consumer.fetch(waiting, ids["waiting"], timeout=6.0)  # published only after the close
    wait_for_progress(consumer, ids["moving"])
    close_seconds = consumer.close_consumer()
    assert close_seconds <= 2.0, f"close() took {close_seconds:.1f} s with fetches running"
    results = {r.request_id: consumer.result(r.request_id, timeout=5.0) for r in (moving, waiting)}
    assert not results["waiting"]["ok"]
    assert sorted(results["waiting"]["failed_block_ids"]) == sorted(ids["waiting"].tolist())
    groups = settle_results(consumer, (moving, waiting), ids, results)
    bad = consumer.model.mismatches()
    assert not bad, f"at the results: {describe(bad, groups)}"

    producer.publish(waiting, src_ids["waiting"], deadline_s=2.0)
    late = watch_for_late_bytes([consumer], 2.0)
    assert not late, describe(late[consumer.name], groups)
    problems = leaks([producer], [], timeout=8.0)  # released at the latest at the deadlines
    assert not problems, problems


def test_producer_whose_gil_is_held_longer_than_peer_timeout_serves_afterwards(rig):
    """vLLM CPU workers' TP all-gather held a worker's GIL for 56-60 s under the real-engine
    suite: no Python thread of the producer ran, its side channel answered nothing. Its libzmq
    still answers heartbeats, so the consumer keeps it alive through a hold of ten times
    `peer_timeout_s`, and the fetch asked before the hold completes after it, exact."""
    producer = rig.producer(PREFILL)
    consumer = rig.consumer(DECODE, options={"peer_timeout_s": 0.5, "heartbeat_s": 0.1})
    consumer.connect([producer.address])
    request = Request("held", 1024, seed=3)
    ids = BlockPool(DECODE.num_blocks, 2).take(DECODE.blocks_for(request.num_tokens))
    consumer.fetch(request, ids, timeout=120.0)  # asked before the publish: held meanwhile
    held = producer.send("hold_gil", 5)
    producer.reply(held, timeout=60.0)
    producer.publish(request, BlockPool(PREFILL.num_blocks, 1).take(PREFILL.blocks_for(1024)))
    result = consumer.result(request.request_id, timeout=120.0)
    assert result["ok"], result["errors"][:3]
    consumer.model.settle(ids, request, result["failed_block_ids"])
    bad = consumer.model.mismatches()
    assert not bad, describe(bad, {"request": ids})
