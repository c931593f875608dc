"""Bounded state: thousands of requests leave no growing trace on the producer (released ids
expire) and every one of them is released exactly once."""

from __future__ import annotations

from kvxfer.testing import DECODE, PREFILL, BlockPool, Request, leaks

COUNT = 2000
TTL_S = 0.2  # released ids are remembered this long (the producer's `released_ttl_s`)
STAGING = {"staging_bytes": 64 << 10, "staging_slots": 4}


def test_released_ids_expire_over_thousands_of_requests(rig):
    producer = rig.producer(PREFILL, options={"released_ttl_s": TTL_S, **STAGING})
    consumer = rig.consumer(DECODE, options=STAGING)
    consumer.connect([producer.address])
    src = BlockPool(PREFILL.num_blocks, 1).take(1)
    dst = BlockPool(DECODE.num_blocks, 2).take(1)
    tokens, seed = 5, 9

    kept = []
    for batch in range(4):
        prefix = f"tiny-{batch}-"
        producer.call("publish_many", prefix, COUNT // 4, src.tolist(), tokens, seed)
        outcome = consumer.call(
            "fetch_many", prefix, COUNT // 4, dst.tolist(), tokens, seed, 50, timeout=120
        )
        assert outcome["failed"] == 0, outcome["errors"]
        kept.append(producer.report()["stats"]["released_ids_kept"])
    assert max(kept) < COUNT // 2, f"released ids kept after each 500 requests: {kept}"

    consumer.model.land(dst, Request("tiny", tokens, seed))
    bad = consumer.model.mismatches()
    assert not bad, bad
    stats = producer.report()["stats"]
    assert stats["sessions"] == 1, stats
    problems = leaks([producer], [consumer], timeout=8.0)
    assert not problems, problems
