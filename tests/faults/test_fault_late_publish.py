"""Late publishes: once a fetch reported blocks failed, nothing of it lands there afterwards.

A decode engine recomputes failed blocks at once, into the same blocks (vLLM does). Each case
runs three fetches that give up after 2 s, each a different way in:
- `late`: the fetch's own timeout passes; the request is published after the result;
- `late-wait`: a fetch with a long timeout whose `wait(timeout=2)` gives up first; the request
  is published after the result;
- `straddling`: published 0.3 s before the fetch's timeout, too large to arrive in time, so its
  transfer straddles the timeout.
The consumer re-poisons every failed block with another pattern the moment `wait()` returns;
then every byte of the cache is watched for a few seconds.
"""

from __future__ import annotations

import pytest

from kvxfer import STRATEGIES
from kvxfer.testing import (
    DECODE,
    PREFILL,
    ROOMY_STAGING,
    BlockPool,
    Request,
    describe,
    leaks,
    watch_for_late_bytes,
)
from kvxfer.testing.checks import settle_results

GIVE_UP_S = 2.0


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_late_publish_never_lands_in_failed_blocks(rig, strategy):
    producer = rig.producer(PREFILL, options=ROOMY_STAGING)
    consumer = rig.consumer(DECODE, options={"strategy": strategy, **ROOMY_STAGING})
    assert set(consumer.connect([producer.address])) == {strategy}
    src_pool, dst_pool = BlockPool(PREFILL.num_blocks, 1), BlockPool(DECODE.num_blocks, 2)

    late_wait = Request(f"late-wait-{strategy}", 1024, seed=10)
    late = Request(f"late-{strategy}", 1024, seed=11)
    straddling = Request(f"straddling-{strategy}", 4096, seed=12)
    requests = (late_wait, late, straddling)
    src = {r.request_id: src_pool.take(PREFILL.blocks_for(r.num_tokens)) for r in requests}
    dst = {r.request_id: dst_pool.take(DECODE.blocks_for(r.num_tokens)) for r in requests}

    consumer.fetch(late_wait, dst[late_wait.request_id], timeout=60.0, wait_timeout=GIVE_UP_S)
    consumer.fetch(late, dst[late.request_id], timeout=GIVE_UP_S)
    consumer.fetch(straddling, dst[straddling.request_id], timeout=GIVE_UP_S)
    producer.publish(straddling, src[straddling.request_id], delay=GIVE_UP_S - 0.3, deadline_s=5)
    results = {r.request_id: consumer.result(r.request_id, GIVE_UP_S + 5) for r in requests}

    for request in (late_wait, late):
        result = results[request.request_id]
        assert not result["ok"], f"{request.request_id} was not published: it cannot be ok"
        assert sorted(result["failed_block_ids"]) == sorted(dst[request.request_id].tolist())
    groups = settle_results(consumer, requests, dst, results)
    bad = consumer.model.mismatches()
    assert not bad, f"after the results (failed blocks re-poisoned): {describe(bad, groups)}"

    for request in (late_wait, late):
        producer.publish(request, src[request.request_id], deadline_s=2.0)
    late_bytes = watch_for_late_bytes([consumer], 2.5)
    assert not late_bytes, (
        "bytes landed after the fetch reported failure: "
        f"{describe(late_bytes[consumer.name], groups)}"
    )

    if not results[straddling.request_id]["ok"]:
        consumer.call("abort", straddling.request_id)  # the engine recomputes it
    problems = leaks([producer], [consumer], timeout=8.0)
    assert not problems, problems
