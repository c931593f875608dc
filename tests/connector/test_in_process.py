"""A prefill and a decode engine in one process over the local transport (no Mooncake): the
connector's whole path, handshake to cache, on a transport chosen by name, bit for bit on
poisoned caches; and a pair whose transports differ is refused at handshake, naming both."""

from __future__ import annotations

import re

import pytest

from kvxfer.connector import KVConsumer, KVProducer
from kvxfer.plan import STRATEGIES
from kvxfer.testing import make_scenario, side_specs

MISMATCH = "its transport is 'local' and this side's is 'mooncake'; set the same `transport`"
LOCAL = {"transport": "local", "staging_bytes": 1 << 16, "staging_slots": 2}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_moves_the_kv_exactly_over_the_local_transport(strategy):
    src = side_specs(2, heads=4, block_size=16, num_blocks=24)
    dst = side_specs(4, heads=4, block_size=32, layout="HND", num_blocks=24)
    scenario = make_scenario(src, dst, 150)
    producers = [KVProducer(s, c, "prefill", **LOCAL) for s, c, _ in scenario.src]
    consumers = [KVConsumer(s, c, "decode", strategy=strategy, **LOCAL) for s, c, _ in scenario.dst]
    try:
        assert {p.transport.kind for p in producers} == {"local"}
        for consumer in consumers:
            consumer.connect([p.address for p in producers])
        for producer, (_, _, ids) in zip(producers, scenario.src, strict=True):
            producer.publish("r", ids, 150)
        handles = [
            c.fetch("r", ids, 150, timeout=60)
            for c, (_, _, ids) in zip(consumers, scenario.dst, strict=True)
        ]
        results = [h.wait() for h in handles]
        assert all(r.ok for r in results), results
        scenario.assert_exact()
    finally:
        for consumer in consumers:
            consumer.close()
        for producer in producers:
            producer.close()


def test_a_consumer_on_another_transport_is_refused_naming_both():
    src, dst = side_specs(1, heads=4, num_blocks=8), side_specs(1, heads=4, num_blocks=8)
    scenario = make_scenario(src, dst, 20)
    (s, c, _), (d, dc, _) = scenario.src[0], scenario.dst[0]
    producer = KVProducer(s, c, "prefill", **LOCAL)
    consumer = KVConsumer(d, dc, "decode", staging_bytes=1 << 16, staging_slots=2)
    try:
        with pytest.raises(Exception, match=re.escape(MISMATCH)):
            consumer.connect([producer.address], timeout=30)
    finally:
        consumer.close()
        producer.close()
