"""`kvxfer.reshard` moves exactly the requested cells between any two shardings."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from kvxfer import STRATEGIES, reshard
from kvxfer.reference import rank_heads
from kvxfer.testing import make_scenario, side_specs
from kvxfer.testing.strategies import geometries, reshard_random_geometry


def _case(
    p_tp,
    d_tp,
    p_bs,
    d_bs,
    p_lay="NHD",
    d_lay="NHD",
    p_pl="kv_first",
    d_pl="kv_first",
    heads=4,
    mla=False,
    tokens=37,
    start=0,
):
    label = f"P{p_tp}-D{d_tp}-bs{p_bs}-bs{d_bs}-{p_lay}-{d_lay}-{p_pl}-{d_pl}-H{heads}"
    label += "-MLA" if mla else ""
    label += f"-start{start}" if start else ""
    return pytest.param(
        p_tp, d_tp, p_bs, d_bs, p_lay, d_lay, p_pl, d_pl, heads, mla, tokens, start, id=label
    )


CASES = [
    _case(2, 4, 16, 16),
    _case(4, 2, 16, 16),
    _case(3, 4, 16, 48, "NHD", "HND", heads=12),
    _case(4, 6, 48, 32, "HND", "NHD", "blocks_first", "kv_first", heads=12),
    _case(6, 4, 5, 7, "HND", "HND", "kv_first", "blocks_first", heads=12, start=11),
    _case(1, 8, 16, 64, heads=2),  # destination replicates heads
    _case(8, 1, 64, 16, heads=2),  # source replicates heads
    _case(8, 4, 4, 4, "NHD", "HND", heads=2),  # replicated on both sides
    _case(2, 2, 16, 16, "NHD", "NHD", "blocks_first", "blocks_first"),
    _case(2, 3, 16, 32, "NHD", "HND", "kv_inner", "kv_inner", heads=6),  # vLLM 0.33's layout
    _case(4, 2, 16, 16, "HND", "NHD", "kv_first", "kv_inner", heads=4, start=5),
    _case(4, 2, 16, 48, mla=True),
    _case(3, 5, 3, 8, mla=True, start=9),
]


@pytest.mark.parametrize("p_tp,d_tp,p_bs,d_bs,p_lay,d_lay,p_pl,d_pl,heads,mla,tokens,start", CASES)
@pytest.mark.parametrize("strategy", [None, *STRATEGIES])
def test_reshard_is_exact(
    p_tp, d_tp, p_bs, d_bs, p_lay, d_lay, p_pl, d_pl, heads, mla, tokens, start, strategy
):
    src = side_specs(p_tp, heads=heads, block_size=p_bs, layout=p_lay, placement=p_pl, mla=mla)
    dst = side_specs(d_tp, heads=heads, block_size=d_bs, layout=d_lay, placement=d_pl, mla=mla)
    sc = make_scenario(src, dst, tokens, start)
    result = reshard(sc.src, sc.dst, tokens, start, strategy=strategy)
    sc.assert_exact()
    if strategy is not None:
        assert {p.strategy for p in result.pairs} == {strategy}
    # Every destination head is fed by exactly one pair, and the bytes add up.
    planes = 1 if mla else 2
    head_bytes = planes * (tokens - start) * 8 * 2 * 2  # head_dim 8, fp16, 2 layers
    fed = sorted((p.dst_rank, h) for p in result.pairs for h in p.heads)
    assert fed == sorted((s.tp_rank, h) for s in dst for h in rank_heads(s))
    assert result.nbytes == len(fed) * head_bytes


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_every_dtype_is_bit_exact(dtype):
    src = side_specs(2, heads=4, block_size=8, dtype=dtype)
    dst = side_specs(4, heads=4, block_size=16, layout="HND", dtype=dtype)
    sc = make_scenario(src, dst, 29)
    reshard(sc.src, sc.dst, 29)
    sc.assert_exact()


def test_start_equal_to_num_tokens_writes_nothing():
    src, dst = side_specs(2), side_specs(4)
    sc = make_scenario(src, dst, 20, start_token=20)
    result = reshard(sc.src, sc.dst, 20, start_token=20)
    assert result.pairs == []
    sc.assert_exact()


def test_contiguous_blocks_coalesce_into_long_runs():
    src = side_specs(2, heads=4, block_size=16, num_blocks=8)
    dst = side_specs(2, heads=4, block_size=16, num_blocks=8)
    sc = make_scenario(src, dst, 64, contiguous=True)
    result = reshard(sc.src, sc.dst, 64, strategy="direct")
    sc.assert_exact()
    # Same geometry, consecutive blocks: one run per K/V plane per layer.
    assert [p.num_segments for p in result.pairs] == [2 * 2, 2 * 2]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(geometries())
def test_reshard_matches_reference_on_random_geometries(g):
    reshard_random_geometry(g, backend="torch")
