"""The connectors with the Triton backend (interpreter on CPU tensors): kernels are warmed up
at handshake on scratch buffers, and every strategy moves KV exactly."""

from __future__ import annotations

import pytest

from kvxfer.testing import make_scenario, side_specs
from kvxfer.testing.scenario import ScenarioEngines

# Runs the Triton kernels: on CUDA, or on CPU under TRITON_INTERPRET=1 (tests/conftest.py).
pytestmark = pytest.mark.interpreter


@pytest.mark.parametrize("strategy", ["pack", "unpack", "pack+unpack"])
def test_triton_backend_end_to_end(strategy):
    src = side_specs(2, heads=4, block_size=16, dtype="bfloat16", num_blocks=12)
    dst = side_specs(
        2,
        heads=4,
        block_size=32,
        layout="HND",
        placement="blocks_first",
        dtype="bfloat16",
        num_blocks=8,
    )
    sc = make_scenario(src, dst, 70, start_token=5)
    roomy = {"staging_bytes": 1 << 16, "backend": "triton"}
    with ScenarioEngines(sc, roomy, dict(strategy=strategy, **roomy)) as engines:
        engines.connect()
        sc.assert_untouched()  # warm-up ran on scratch buffers, not on the caches
        engines.publish("r")
        assert all(h.wait().ok for h in engines.fetch("r", start_token=5))
        sc.assert_exact()
