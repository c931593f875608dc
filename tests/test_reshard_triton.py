"""`reshard(..., backend="triton")` passes the torch backend's property tests."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from kvxfer import reshard
from kvxfer.testing import make_scenario, side_specs
from kvxfer.testing.strategies import geometries, reshard_random_geometry

# Runs the Triton kernels: on CUDA, or on CPU under TRITON_INTERPRET=1 (tests/conftest.py).
pytestmark = pytest.mark.interpreter


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(geometries())
def test_triton_reshard_matches_reference_on_random_geometries(g):
    reshard_random_geometry(g, backend="triton")


@pytest.mark.parametrize("strategy", ["pack", "unpack", "pack+unpack"])
@pytest.mark.parametrize(
    "src_tp,dst_tp,heads,mla",
    [
        pytest.param(3, 4, 12, False, id="P3-D4"),
        pytest.param(4, 6, 12, False, id="P4-D6"),
        pytest.param(1, 8, 2, False, id="P1-D8-replicated"),
        pytest.param(4, 2, 1, True, id="P4-D2-MLA"),
    ],
)
def test_triton_reshard_kernel_strategies(src_tp, dst_tp, heads, mla, strategy):
    src = side_specs(src_tp, heads=heads, block_size=16, layout="NHD", mla=mla, dtype="bfloat16")
    dst = side_specs(
        dst_tp,
        heads=heads,
        block_size=48,
        layout="HND",
        placement="blocks_first",
        mla=mla,
        dtype="bfloat16",
    )
    sc = make_scenario(src, dst, 53, start_token=7)
    result = reshard(sc.src, sc.dst, 53, 7, strategy=strategy, backend="triton")
    assert result.backend == "triton"
    sc.assert_exact()
