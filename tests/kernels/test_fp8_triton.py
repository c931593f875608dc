"""fp8 caches through the Triton kernels (one-byte words), bit for bit against the reference.
Tiny cases: they run on CPU tensors under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest

from kvxfer import reshard
from kvxfer.testing import make_scenario, side_specs

# Runs the Triton kernels: on CUDA, or on CPU under TRITON_INTERPRET=1 (tests/conftest.py).
pytestmark = pytest.mark.interpreter


@pytest.mark.parametrize("strategy", ["pack", "unpack", "pack+unpack"])
@pytest.mark.parametrize(
    "src,dst",
    [
        pytest.param(
            dict(tp=2, heads=4, block_size=4, head_dim=3),
            dict(tp=4, heads=4, block_size=6, head_dim=3, layout="HND", placement="kv_inner"),
            id="P2-D4-bs4-bs6-d3-NHD-HND",
        ),
        pytest.param(
            dict(tp=2, mla=True, block_size=4, head_dim=16),
            dict(tp=1, mla=True, block_size=8, head_dim=16, placement="blocks_first"),
            id="MLA-P2-D1-d16",
        ),
    ],
)
@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_triton_reshard_fp8_is_bit_exact(dtype, src, dst, strategy):
    src_specs = side_specs(dtype=dtype, num_layers=2, num_blocks=8, **src)
    dst_specs = side_specs(dtype=dtype, num_layers=2, num_blocks=8, **dst)
    sc = make_scenario(src_specs, dst_specs, 19, start_token=3, seed=2)
    result = reshard(sc.src, sc.dst, 19, 3, strategy=strategy, backend="triton")
    assert result.backend == "triton"
    assert {p.strategy for p in result.pairs} == {strategy}
    sc.assert_exact()  # uint8 comparison; destinations were poisoned with 0xA5
