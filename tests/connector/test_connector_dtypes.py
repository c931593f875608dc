"""KV dtype conversion through the connectors: a bf16 prefill (TP 2) and an fp8 decode (TP 4,
other block size and layout), and the reverse, over real Mooncake TCP on 127.0.0.1. The pair
meets at the handshake, every strategy that converts moves the request, and every decode byte
equals `kvxfer.reference.converted_global_kv` (vLLM's arithmetic with the fp8 side's scales) on
poisoned caches; the producer's staging is sized in the smaller dtype when it quantizes."""

from __future__ import annotations

import msgspec
import pytest

from kvxfer.testing import make_scenario, side_specs
from kvxfer.testing.scenario import ScenarioEngines

STAGING = {"staging_bytes": 8192, "staging_slots": 2}


def scaled(specs, base: float):
    return [
        msgspec.structs.replace(
            s,
            k_scales=tuple(base + 0.5 * i for i in range(s.num_layers)),
            v_scales=tuple(2 * base + i for i in range(s.num_layers)),
        )
        for s in specs
    ]


@pytest.mark.parametrize("strategy", ["pack", "unpack", "pack+unpack"])
@pytest.mark.parametrize(("src_dtype", "dst_dtype"), [("bfloat16", "float8_e4m3fn"),
                                                      ("float8_e5m2", "float16")])  # fmt: skip
def test_a_prefill_and_a_decode_of_other_dtypes_move_a_request_exactly(
    src_dtype, dst_dtype, strategy
):
    src = side_specs(2, heads=4, block_size=16, num_blocks=24, dtype=src_dtype, num_layers=3)
    dst = side_specs(4, heads=4, block_size=32, layout="HND", num_blocks=12, dtype=dst_dtype,
                     num_layers=3)  # fmt: skip
    src = scaled(src, 0.5) if src_dtype.startswith("float8") else src
    dst = scaled(dst, 0.125) if dst_dtype.startswith("float8") else dst
    num_tokens = 150
    sc = make_scenario(src, dst, num_tokens, start_token=5, seed=3)
    with ScenarioEngines(sc, STAGING, dict(strategy=strategy, **STAGING)) as engines:
        engines.connect()
        for consumer in engines.consumers:
            assert {pair.plan.strategy for pair in consumer._pairs} == {strategy}
        engines.publish("r1")
        results = [h.wait() for h in engines.fetch("r1", start_token=5, timeout=60.0)]
        assert all(r.ok for r in results), [r.errors for r in results]
        sc.assert_exact()
        # The wire carries the staging's dtype: the destination's after a pack, the source's
        # before an unpack, the narrower with both.
        sizes = {"float8_e4m3fn": 1, "float8_e5m2": 1, "bfloat16": 2, "float16": 2}
        src_size, dst_size = sizes[src_dtype], sizes[dst_dtype]
        wire = {"pack": dst_size, "unpack": src_size, "pack+unpack": min(src_size, dst_size)}
        cells = (num_tokens - 5) * 3 * 2 * 4 * 8  # tokens x layers x K/V x heads x head_dim
        assert sum(r.bytes for r in results) == cells * wire[strategy]
