"""Hostile peers: garbage and oversized frames on the producer's side channel, a handshake with
the wrong secret, and a stranger (another engine, authenticated, its own session) aborting a
request that a consumer is fetching. Legitimate work goes on, bit for bit."""

from __future__ import annotations

import random
import time

from kvxfer.testing import (
    DECODE,
    PREFILL,
    SLOW_STAGING,
    BlockPool,
    ChildError,
    Request,
    describe,
    garbage_frames,
    leaks,
    send_raw,
    wait_for_progress,
)

SLOW = {"strategy": "pack+unpack", **SLOW_STAGING}
SECRET = "s3cret"


def test_garbage_and_a_wrong_secret_leave_service_intact(rig):
    producer = rig.producer(PREFILL, options={"secret": SECRET, **SLOW_STAGING})
    consumer = rig.consumer(DECODE, options={"secret": SECRET, **SLOW})
    intruder = rig.consumer(DECODE, engine_id="intruder")
    intruder.open(secret="other", **SLOW)
    rig.ready()

    frames = garbage_frames(random.Random(7), oversized=True)
    answers = {name: send_raw(producer.address, f) for name, f in frames}
    for name, replies in answers.items():
        kinds = {r.get("type") if isinstance(r, dict) else type(r).__name__ for r in replies}
        assert kinds <= {"refused"}, f"{name}: answered {replies!r:.300}"
    assert producer.alive(), "the producer died of garbage"

    try:
        intruder.connect([producer.address])
    except ChildError as exc:
        text = str(exc).splitlines()[-1]
        assert "ConnectionError" in text and "secret" in text.lower(), text
    else:
        raise AssertionError("a consumer with the wrong secret was let in")

    consumer.connect([producer.address])
    request = Request("after-garbage", 1024, seed=3)
    producer.publish(request, BlockPool(PREFILL.num_blocks, 1).take(PREFILL.blocks_for(1024)))
    ids = BlockPool(DECODE.num_blocks, 2).take(DECODE.blocks_for(1024))
    # 128 chunks of 8 tokens: half a second alone, many seconds under the parallel suite; the
    # test is about service, not speed, so the fetch's deadline is generous.
    consumer.fetch(request, ids, timeout=60.0)
    result = consumer.result(request.request_id, timeout=75.0)
    assert result["ok"], result["errors"][:3]
    consumer.model.settle(ids, request, [])
    bad = consumer.model.mismatches()
    assert not bad, describe(bad, {"request": ids})
    problems = leaks([producer], [consumer], timeout=8.0)
    assert not problems, problems


def test_a_strangers_abort_does_not_release_anothers_request(rig):
    victim = Request("victim", 4096, seed=5)
    decode = {"secret": SECRET, **SLOW}
    producer, consumer, ids = rig.published_pair(victim, {"secret": SECRET, **SLOW_STAGING}, decode)
    stranger = rig.consumer(DECODE, engine_id="stranger", options=decode)
    stranger.connect([producer.address])

    # 512 chunks of 8 tokens, with the consumer frozen part of the way: seconds alone, many
    # more under the parallel suite (a 15 s deadline failed in CI); the test is about who may
    # release, not speed, so the fetch's deadline is generous.
    consumer.fetch(victim, ids, timeout=60.0)
    wait_for_progress(consumer, ids)
    consumer.freeze()  # keeps the fetch in flight for as long as the check takes
    try:
        consumer.pump()
        assert not any(k == "result" for k, _ in consumer.events), "fetched before the abort"
        stranger.call("abort", victim.request_id)
        time.sleep(0.5)
        released = producer.count_releases()[victim.request_id]
    finally:
        consumer.thaw()
    assert released == 0, "a stranger's abort released a request another consumer is fetching"

    result = consumer.result(victim.request_id, timeout=75.0)
    assert result["ok"], result["errors"][:3]
    consumer.model.settle(ids, victim, [])
    bad = consumer.model.mismatches()
    assert not bad, describe(bad, {"victim": ids})
    problems = leaks([producer], [consumer, stranger], timeout=8.0)
    assert not problems, problems
