"""A prefill and a decode engine in one process over the local transport (no Mooncake): the
connector's whole path, handshake to cache, on a transport chosen by name, bit for bit on
poisoned caches; and a pair whose transports differ is refused at handshake, naming both."""

from __future__ import annotations

import re

import pytest

from kvxfer.plan import STRATEGIES
from kvxfer.testing import make_scenario, side_specs
from kvxfer.testing.scenario import ScenarioEngines

MISMATCH = "its transport is 'local' and this side's is 'mooncake'; set the same `transport`"
LOCAL = {"transport": "local", "staging_bytes": 1 << 16, "staging_slots": 2}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_moves_the_kv_exactly_over_the_local_transport(strategy):
    src = side_specs(2, heads=4, block_size=16, num_blocks=24)
    dst = side_specs(4, heads=4, block_size=32, layout="HND", num_blocks=24)
    scenario = make_scenario(src, dst, 150)
    with ScenarioEngines(scenario, LOCAL, dict(strategy=strategy, **LOCAL)) as engines:
        assert {p.transport.kind for p in engines.producers} == {"local"}
        engines.connect()
        engines.publish("r")
        results = [h.wait() for h in engines.fetch("r", timeout=60)]
        assert all(r.ok for r in results), results
        scenario.assert_exact()


def test_a_consumer_on_another_transport_is_refused_naming_both():
    src, dst = side_specs(1, heads=4, num_blocks=8), side_specs(1, heads=4, num_blocks=8)
    scenario = make_scenario(src, dst, 20)
    mooncake = {"staging_bytes": 1 << 16, "staging_slots": 2}
    refused = pytest.raises(Exception, match=re.escape(MISMATCH))
    with ScenarioEngines(scenario, LOCAL, mooncake) as engines, refused:
        engines.connect(timeout=30)
