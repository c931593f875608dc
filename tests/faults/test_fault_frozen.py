"""Frozen peers (SIGSTOP mid-transfer, SIGCONT later): a frozen consumer costs only its own
request, and a producer that resumes after a fetch gave up on it writes nothing more."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from kvxfer.testing import (
    DECODE,
    PREFILL,
    ROOMY_STAGING,
    SLOW_STAGING,
    BlockPool,
    Request,
    StallingLink,
    describe,
    leaks,
    poll,
    wait_for_progress,
    watch_for_late_bytes,
)

SLOW = {"strategy": "pack+unpack", **SLOW_STAGING}  # a 4 MiB request in hundreds of chunks


BIG_PREFILL = replace(PREFILL, num_blocks=2048)
BIG_DECODE = replace(DECODE, num_blocks=1024)
# Frozen mid-transfer: 64 KiB chunks, so that a 16 MiB request is caught in flight. Frozen
# before the publish: 4 MiB chunks, more bytes due to the frozen consumer than socket buffers
# hold.
CHUNKS = {
    "mid-transfer": {"staging_bytes": 128 << 10, "staging_slots": 2},
    "before-publish": {"staging_bytes": 8 << 20, "staging_slots": 2},
}

# A's fetch takes the default timeout: the chunks it asked for wait for the publish (and the
# packs for their read) however long a loaded machine takes between the ask and the thaw.
A_TIMEOUT_S = 300.0


def _no(free_slots: int | None) -> bool:
    return free_slots == 0


@pytest.mark.parametrize("freeze_at", list(CHUNKS))
def test_frozen_consumer_does_not_stall_another_consumer(rig, freeze_at):
    chunks = CHUNKS[freeze_at]
    # A stays the producer's session while frozen, however long a loaded machine takes here:
    # by default 10 s of silence would end it, and with it the staging the test watches.
    producer = rig.producer(BIG_PREFILL, options={**chunks, "session_timeout_s": 300.0})
    a = rig.consumer(
        BIG_DECODE, engine_id="decode-a", options={"strategy": "pack+unpack", **chunks}
    )
    b = rig.consumer(DECODE, engine_id="decode-b", options=SLOW)
    for c in (a, b):
        c.connect([producer.address])
    src = BlockPool(BIG_PREFILL.num_blocks, 1)
    big, small = Request("a-big", 16384, seed=1), Request("b-small", 1024, seed=2)
    src_ids = {r.request_id: src.take(BIG_PREFILL.blocks_for(r.num_tokens)) for r in (big, small)}
    producer.publish(small, src_ids[small.request_id])
    a_ids = BlockPool(BIG_DECODE.num_blocks, 2).take(BIG_DECODE.blocks_for(big.num_tokens))
    b_ids = BlockPool(DECODE.num_blocks, 3).take(DECODE.blocks_for(small.num_tokens))

    if freeze_at == "mid-transfer":
        producer.publish(big, src_ids[big.request_id])
        a.fetch(big, a_ids, timeout=A_TIMEOUT_S)
        wait_for_progress(a, a_ids)
        a.freeze()
        a.pump()
        assert not any(k == "result" for k, _ in a.events), "the transfer ended before the freeze"
    else:
        a.fetch(big, a_ids, timeout=A_TIMEOUT_S)
        waiting = poll(lambda: producer.report()["stats"]["waiting_chunks"], bool, timeout=120.0)
        assert waiting, "consumer A's requests never reached the producer"
        a.freeze()
        producer.publish(big, src_ids[big.request_id])
        # The producer serves the frozen consumer: its packs fill A's staging, never read.
        full = poll(lambda: producer.report()["free_slots"].get(("decode-a", 0)), _no, 120.0)
        assert full == 0, f"the producer did not pack for the frozen consumer: {full}"

    # A stays frozen until B's fetch ended: B finishing at all shows A does not stall it, so
    # its deadline need not guess the loaded machine's speed (128 chunks of 8 tokens).
    b.fetch(small, b_ids, timeout=60.0)
    rb = b.result(small.request_id, timeout=75.0)
    assert rb["ok"], f"consumer B failed while A was frozen: {rb['errors']}"
    b.model.settle(b_ids, small, rb["failed_block_ids"])
    bad = b.model.mismatches()
    assert not bad, f"consumer B's cache: {describe(bad, {'b-small': b_ids})}"

    a.thaw()
    ra = a.result(big.request_id, timeout=40.0)
    assert set(ra["failed_block_ids"]) <= set(a_ids.tolist())
    assert ra["ok"] == (not ra["failed_block_ids"]), ra
    a.model.settle(a_ids, big, ra["failed_block_ids"])
    late = watch_for_late_bytes([a, b], 1.5)
    groups = {"failed": ra["failed_block_ids"], "a-big": a_ids}
    assert not late, {name: describe(m, groups) for name, m in late.items()}

    if not ra["ok"]:
        a.call("abort", big.request_id)  # the engine recomputes it
    problems = leaks([producer], [a, b], timeout=10.0)
    assert not problems, problems


@pytest.mark.parametrize("strategy", ["direct", "pack+unpack"])
def test_frozen_producer_resumed_after_the_fetch_failed_writes_nothing(rig, strategy):
    staging = SLOW_STAGING if strategy == "pack+unpack" else ROOMY_STAGING  # slots hold a block
    big = Request("big", 4096, seed=4)
    producer, consumer, ids = rig.published_pair(big, staging, {"strategy": strategy, **staging})

    consumer.fetch(big, ids, timeout=4.0)
    wait_for_progress(consumer, ids)
    producer.freeze()
    result = consumer.result(big.request_id, timeout=4.0 + 5)
    assert not result["ok"], "a fetch from a frozen producer cannot complete"
    failed = result["failed_block_ids"]
    assert failed and set(failed) <= set(ids.tolist())
    consumer.model.settle(ids, big, failed)
    bad = consumer.model.mismatches()
    assert not bad, f"at the result: {describe(bad, {'failed': failed, 'request': ids})}"

    producer.thaw()
    late = watch_for_late_bytes([consumer], 2.5)
    assert not late, describe(late[consumer.name], {"failed": failed, "request": ids})

    consumer.call("abort", big.request_id)  # the engine recomputes the failed blocks
    problems = leaks([producer], [consumer], timeout=10.0)
    assert not problems, problems


def _ask_a_frozen_producer(rig, request: Request, mid_transfer: bool = False):
    """A producer that published `request` is frozen, before a consumer (`peer_timeout_s` 1 s,
    handshakes within 2 s) asks for it, or once the fetch is under way (`mid_transfer`: chunks
    asked, offered, reading and confirming); until the consumer's libzmq gives up on the
    connection. Returns the producer, the consumer and the destination ids."""
    producer, consumer, ids = rig.published_pair(
        request, SLOW_STAGING, {**SLOW, "peer_timeout_s": 1.0}, connect_timeout=2.0
    )
    if mid_transfer:
        consumer.fetch(request, ids, timeout=120.0)
        wait_for_progress(consumer, ids)
        producer.freeze()
    else:
        producer.freeze()
        consumer.fetch(request, ids, timeout=120.0)
    lost = poll(lambda: consumer.report()["stats"]["sessions"], lambda n: n == 0, timeout=60.0)
    assert lost == 0, "the consumer kept its session with a frozen producer"
    return producer, consumer, ids


def _assert_served_exact(producer, consumer, request: Request, ids) -> None:
    """The fetch of `request` completed with nothing failed, every block exact, and neither
    side kept anything of it."""
    result = consumer.result(request.request_id, timeout=120.0 + 5)
    assert result["ok"], result["errors"][:3]
    consumer.model.settle(ids, request, result["failed_block_ids"])
    bad = consumer.model.mismatches()
    assert not bad, describe(bad, {"request": ids})
    problems = leaks([producer], [consumer], timeout=10.0)
    assert not problems, problems


@pytest.mark.parametrize("mid_transfer", [False, True], ids=["before-answering", "mid-transfer"])
def test_a_producer_not_run_for_longer_than_the_peer_timeout_serves_once_it_runs(rig, mid_transfer):
    """Silence is not death: a frozen producer looks like one a loaded machine does not run.
    Its connection is dropped after `peer_timeout_s` of silence and opened again; its kernel
    accepts, so the new handshake waits past its own deadline, within the fetch's, and once
    the producer runs every chunk not in the cache yet is asked again (those reading once
    their read settled): the fetch is exact, nothing failed."""
    big = Request("big", 4096, seed=5)
    producer, consumer, ids = _ask_a_frozen_producer(rig, big, mid_transfer)
    time.sleep(4.0)  # twice the handshake's deadline: the reconnect outlives it
    consumer.pump()
    assert not any(k == "result" for k, _ in consumer.events), "the fetch gave up"
    producer.thaw()
    _assert_served_exact(producer, consumer, big, ids)


def test_a_frozen_producer_killed_fails_the_fetch_at_once(rig):
    """Once the frozen producer is killed its address refuses the reconnect: the fetch fails
    then, not at its timeout (120 s), every block it wrote exact."""
    big = Request("big", 4096, seed=6)
    producer, consumer, ids = _ask_a_frozen_producer(rig, big)
    producer.kill()
    killed_at = time.monotonic()
    result = consumer.result(big.request_id, timeout=120.0 + 5)
    took = result["finished"] - killed_at
    # At once, not at the fetch's timeout: half of it leaves a loaded machine room.
    assert took < 60.0, f"the fetch returned {took:.1f} s after the kill"
    assert not result["ok"]
    assert "refused the connection" in " ".join(map(str, result["errors"])), result["errors"]
    consumer.model.settle(ids, big, result["failed_block_ids"])
    bad = consumer.model.mismatches()
    assert not bad, describe(bad, {"failed": result["failed_block_ids"], "request": ids})


def test_a_producer_run_in_bursts_is_waited_for_across_dropped_handshakes(rig):
    """A loaded machine runs a producer's process in bursts: its libzmq greets a new connection
    and then answers no heartbeat for a while, again and again, and its Python threads do not
    run meanwhile (here: they wait for a GIL held 20 s, and a relay stops each connection 1 s
    after it opened). Each connection the consumer's libzmq drops mid-handshake takes the
    handshake's hello with it: the handshake starts again on a new one, and goes on past its
    deadline as long as the producer's host keeps taking connections. Once the producer runs,
    the fetch is exact and nothing failed."""
    big = Request("big", 4096, seed=7)
    producer = rig.producer(PREFILL, options=SLOW_STAGING)
    with StallingLink(producer.port) as link:
        consumer = rig.consumer(DECODE, options={**SLOW, "peer_timeout_s": 1.0})
        consumer.connect([link.address], timeout=2.0)
        producer.publish(big, BlockPool(PREFILL.num_blocks, 1).take(PREFILL.blocks_for(4096)))
        ids = BlockPool(DECODE.num_blocks, 2).take(DECODE.blocks_for(4096))
        held = producer.send("hold_gil", 20)
        link.stall_each(after_s=1.0)
        consumer.fetch(big, ids, timeout=120.0)
        # The live session's drop, then two dropped handshakes, the second past the handshake's
        # deadline (2 s), each dropped with its hello.
        poll(lambda: link.connections, lambda n: n >= 4, timeout=60.0)
        link.flow()
        producer.reply(held, timeout=60.0)
        _assert_served_exact(producer, consumer, big, ids)
