"""Pipeline parallelism on either side: routes cover layer ranges as well as heads, and every
destination rank ends up with exactly its layers, bit for bit."""

from __future__ import annotations

import dataclasses
import itertools

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from kvxfer import STRATEGIES, allocate_kv_caches, reshard
from kvxfer.plan import (
    build_program,
    check_pairable,
    check_side,
    plan_pairs,
    plan_pairs_into,
    route_heads,
    route_pair,
)
from kvxfer.plan.heads import heads_of_rank
from kvxfer.plan.program import PairChunk
from kvxfer.plan.sizing import max_chunk_tokens
from kvxfer.reference import random_global_kv, rank_heads, rank_layers, write_rank_cells
from kvxfer.spec import pp_layer_ranges
from kvxfer.testing import make_scenario, side_specs
from kvxfer.testing.strategies import (
    assert_fed_once,
    geometry_specs,
    pp_geometries,
    reshard_random_geometry,
)

# ---- vLLM's default split ------------------------------------------------------------------


@pytest.mark.parametrize(
    "layers,pp,sizes",
    [
        (32, 4, [8, 8, 8, 8]),
        (22, 4, [5, 6, 6, 5]),  # the remainder goes to the stages before the last
        (5, 3, [2, 2, 1]),
        (4, 3, [1, 2, 1]),
        (61, 2, [31, 30]),
        (61, 4, [15, 15, 16, 15]),
        (3, 1, [3]),
    ],
)
def test_pp_layer_ranges_split_as_vllm_does(layers, pp, sizes):
    ranges = pp_layer_ranges(layers, pp)
    assert [len(r) for r in ranges] == sizes
    assert ranges[0].start == 0 and ranges[-1].stop == layers
    assert all(a.stop == b.start for a, b in itertools.pairwise(ranges))


def test_pp_layer_ranges_need_a_layer_per_stage():
    with pytest.raises(ValueError, match="pp_size"):
        pp_layer_ranges(2, 3)


# ---- one engine's ranks --------------------------------------------------------------------


def test_side_checks_name_what_is_wrong():
    ranks = side_specs(2, pp=2, num_layers=5)  # stages hold layers 0-2 and 3-4
    assert [s.engine_rank for s in check_side(ranks[::-1], "source")] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"source: missing rank\(s\) \[2, 3\] of pp_size 2"):
        check_side(ranks[:2], "source")
    with pytest.raises(ValueError, match=r"source: duplicated rank\(s\) \[1\]"):
        check_side([*ranks, ranks[1]], "source")
    other = side_specs(2, pp=2, num_layers=5, layer_ranges=[(0, 2), (2, 5)])
    with pytest.raises(ValueError, match=r"rank 1 \(pp 0, tp 1\) has num_layers=2"):
        check_side([ranks[0], other[1], *ranks[2:]], "source")
    with pytest.raises(ValueError, match="pipeline stage 1 starts at layer 2"):
        check_side([*ranks[:2], *other[2:]], "source")
    bigger = side_specs(2, pp=2, num_layers=6)
    with pytest.raises(ValueError, match="has total_layers=6"):
        check_side([*ranks[:2], *bigger[2:]], "source")


def test_pairing_compares_the_models_layer_count():
    check_pairable(side_specs(2, pp=2, num_layers=5)[0], side_specs(4, num_layers=5)[0])
    with pytest.raises(ValueError, match="total_layers differs: source has 5, destination has 4"):
        check_pairable(side_specs(2, pp=2, num_layers=5)[0], side_specs(4, num_layers=4)[0])
    with pytest.raises(ValueError, match="num_layers differs"):
        check_pairable(side_specs(2, num_layers=5)[0], side_specs(4, num_layers=4)[0])


# ---- routes ----------------------------------------------------------------------------------

# (prefill pp, tp, decode pp, tp, KV heads, layers, prefill split, decode split)
ROUTED = [
    pytest.param(2, 2, 1, 4, 4, 4, None, None, id="P-PP2xTP2-D-PP1xTP4"),
    pytest.param(1, 2, 2, 1, 4, 4, None, None, id="P-PP1xTP2-D-PP2xTP1"),
    pytest.param(2, 4, 2, 2, 8, 5, [(0, 1), (1, 5)], [(0, 3), (3, 5)], id="PP2-PP2-staggered"),
    pytest.param(3, 1, 2, 2, 2, 7, None, None, id="PP3xTP1-PP2xTP2"),
    pytest.param(2, 8, 3, 2, 2, 6, None, [(0, 1), (1, 2), (2, 6)], id="replicated-src"),
    pytest.param(1, 1, 4, 8, 2, 4, None, None, id="replicated-dst"),
    pytest.param(2, 4, 2, 2, 1, 4, None, None, id="MLA-PP2xTP4-PP2xTP2"),
    pytest.param(1, 2, 2, 1, 1, 3, None, None, id="MLA-PP1xTP2-PP2xTP1"),
]


def _sides(p_pp, p_tp, d_pp, d_tp, heads, layers, p_split, d_split, **geometry):
    mla = heads == 1
    src = side_specs(
        p_tp, heads=heads, mla=mla, num_layers=layers, pp=p_pp, layer_ranges=p_split, **geometry
    )
    dst = side_specs(
        d_tp, heads=heads, mla=mla, num_layers=layers, pp=d_pp, layer_ranges=d_split, **geometry
    )
    return src, dst


@pytest.mark.parametrize("p_pp,p_tp,d_pp,d_tp,heads,layers,p_split,d_split", ROUTED)
def test_routes_cover_every_destination_layer_and_head_once_from_a_holder(
    p_pp, p_tp, d_pp, d_tp, heads, layers, p_split, d_split
):
    src, dst = _sides(p_pp, p_tp, d_pp, d_tp, heads, layers, p_split, d_split)
    plans = plan_pairs(src, dst)
    fed = []
    for plan in plans:
        r, s, d = plan.route, src[plan.src_rank], dst[plan.dst_rank]
        assert r.num_layers is not None and r.num_layers >= 1
        for layer in range(r.layer_start, r.layer_start + r.num_layers):
            assert layer in s.layers and layer in d.layers
            for i in range(r.num_heads):
                head = r.head_start + i
                assert heads_of_rank(heads, s.tp_size, s.tp_rank)[r.src_head_offset + i] == head
                assert heads_of_rank(heads, d.tp_size, d.tp_rank)[r.dst_head_offset + i] == head
                fed.append((d.engine_rank, layer, head))
    want = [(d.engine_rank, layer, h) for d in dst for layer in d.layers for h in rank_heads(d)]
    assert sorted(fed) == sorted(want)
    # One route per pair, sorted by destination rank.
    pairs = [(p.src_rank, p.dst_rank) for p in plans]
    assert len(set(pairs)) == len(pairs)
    assert [p.dst_rank for p in plans] == sorted(p.dst_rank for p in plans)


@pytest.mark.parametrize("p_pp,p_tp,d_pp,d_tp,heads,layers,p_split,d_split", ROUTED)
def test_a_producer_finds_the_route_its_consumer_plans(
    p_pp, p_tp, d_pp, d_tp, heads, layers, p_split, d_split
):
    """`route_pair` (the producer, from its spec and the consumer's) agrees with the plans, and
    a consumer planning alone (`plan_pairs_into`) plans what `plan_pairs` plans for it."""
    src, dst = _sides(p_pp, p_tp, d_pp, d_tp, heads, layers, p_split, d_split)
    plans = plan_pairs(src, dst, landing=True)
    routes = {(p.src_rank, p.dst_rank): p.route for p in plans}
    for s in src:
        for d in dst:
            assert route_pair(s, d) == routes.get((s.engine_rank, d.engine_rank))
    for d in dst:
        alone = plan_pairs_into(src[::-1], d, landing=True)
        assert alone == [p for p in plans if p.dst_rank == d.engine_rank]


@settings(max_examples=200, deadline=None)
@given(pp_geometries())
def test_routes_on_random_pipeline_geometries(g):
    """Every destination (layer, head) once, from a holder; producers find the same routes."""
    src, dst = geometry_specs(g)
    plans = plan_pairs(src, dst, strategy="pack+unpack")
    fed = []
    for plan in plans:
        r, s = plan.route, src[plan.src_rank]
        assert r.num_layers is not None
        layers = range(r.layer_start, r.layer_start + r.num_layers)
        heads = range(r.head_start, r.head_start + r.num_heads)
        assert set(layers) <= set(s.layers) and set(heads) <= set(rank_heads(s))
        fed += [(plan.dst_rank, layer, head) for layer in layers for head in heads]
        assert route_pair(s, dst[plan.dst_rank]) == r
    want = [(d.engine_rank, layer, h) for d in dst for layer in d.layers for h in rank_heads(d)]
    assert sorted(fed) == sorted(want)
    assert sum(route_pair(s, d) is not None for s in src for d in dst) == len(plans)


def test_a_route_must_lie_in_both_ranks_layers():
    src, dst = _sides(2, 1, 1, 1, 2, 4, None, None)
    ids = np.arange(2)
    (head_only,) = route_heads(2, 1, 1)  # knows TP sizes only: every layer
    with pytest.raises(ValueError, match="route: a route without layers"):
        build_program(head_only, "direct", src[1], dst[0], ids, ids, 0, 20)
    outside = dataclasses.replace(route_pair(src[1], dst[0]), layer_start=1)  # stage 1: 2-3
    with pytest.raises(ValueError, match=r"route: layers \[1, 3\) are not all held"):
        build_program(outside, "direct", src[1], dst[0], ids, ids, 0, 20)


def test_mla_destination_stages_read_different_replicas():
    # Every prefill rank holds the latent: decode stage p reads replica p, so both prefill
    # ranks serve one decode stage each.
    src, dst = _sides(1, 2, 2, 1, 1, 4, None, None)
    assert [(p.src_rank, p.dst_rank) for p in plan_pairs(src, dst)] == [(0, 0), (1, 1)]


def test_pipeline_fields_without_pipeline_change_no_plan():
    plain_src, plain_dst = side_specs(2, num_layers=3), side_specs(4, num_layers=3, layout="HND")
    explicit_src = [msgspec.structs.replace(s, total_layers=3) for s in plain_src]
    a, b = plan_pairs(plain_src, plain_dst), plan_pairs(explicit_src, plain_dst)
    assert [(p.route, p.strategy, p.estimates) for p in a] == [
        (p.route, p.strategy, p.estimates) for p in b
    ]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("landing", [False, True])
def test_programs_move_only_the_routes_layers(strategy, landing):
    # Prefill stage 1 holds layers 1-4; decode stage 0 holds 0-2: the pair moves layers 1-2,
    # local layers 0-1 on the source and 1-2 on the destination.
    src, dst = _sides(2, 1, 2, 1, 2, 5, [(0, 1), (1, 5)], [(0, 3), (3, 5)])
    (plan,) = [p for p in plan_pairs(src, dst) if (p.src_rank, p.dst_rank) == (1, 0)]
    assert (plan.route.layer_start, plan.route.num_layers) == (1, 2)
    s, d = src[1], dst[0]
    src_ids, dst_ids = np.arange(4) * 2, np.arange(4) * 3
    program = build_program(plan.route, strategy, s, d, src_ids, dst_ids, 3, 60, landing)
    assert program.num_layers == 2
    segments = program.segments
    cache_src = segments.src_region[segments.src_region >= 0]
    cache_dst = segments.dst_region[segments.dst_region >= 0]
    assert set(cache_src.tolist()) <= {0, 1}
    assert set(cache_dst.tolist()) <= {1, 2}
    one_layer = 2 * 57 * 2 * 8 * 2  # planes * tokens * heads * head_dim * fp16
    assert program.nbytes == 2 * one_layer
    for staging in (program.src_staging, program.dst_staging):
        if staging is not None:  # staging holds the route's 2 layers, not the rank's
            assert program.num_layers * staging.layer_bytes < s.num_layers * staging.layer_bytes
    for copy in (program.pack, program.unpack):
        if copy is not None:
            assert copy.num_layers == 2
            cache = copy.src if copy.src.region == "cache" else copy.dst
            assert cache.layer_offset == (0 if cache is copy.src else 1)
    # What a producer packs and a consumer unpacks alone: the same layers.
    chunk = PairChunk(plan.route, strategy, s, d, 3, 60, landing)
    pack = chunk.pack(chunk.source_blocks(src_ids))
    unpack = chunk.unpack(chunk.destination_blocks(dst_ids))
    for alone, within in ((pack, program.pack), (unpack, program.unpack)):
        assert (alone is None) == (within is None)
        if alone is not None and within is not None:
            assert alone.num_layers == within.num_layers == 2
            assert alone.src.layer_offset == within.src.layer_offset
            assert alone.dst.layer_offset == within.dst.layer_offset
    # Chunks are sized for the route's layers: rows of two layers, not of the rank's four.
    chunk = max_chunk_tokens(strategy, plan.route, s, d, 1 << 14, 1 << 14, landing=True)
    (every_layer,) = route_heads(2, 1, 1)
    two, four = side_specs(1, heads=2, num_layers=2)[0], side_specs(1, heads=2, num_layers=4)[0]
    args = (1 << 14, 1 << 14)
    assert chunk == max_chunk_tokens(strategy, every_layer, two, two, *args, landing=True)
    assert chunk == 2 * max_chunk_tokens(strategy, every_layer, four, four, *args, landing=True)


# ---- reshard -------------------------------------------------------------------------------


def _case(p_pp, p_tp, d_pp, d_tp, heads=4, layers=4, p_split=None, d_split=None, start=0, **kw):
    label = f"P-PP{p_pp}xTP{p_tp}-D-PP{d_pp}xTP{d_tp}-H{heads}-L{layers}"
    label += "-MLA" if heads == 1 else ""
    label += f"-{'-'.join(f'{k}{v}' for k, v in kw.items())}" if kw else ""
    label += f"-start{start}" if start else ""
    return pytest.param(
        p_pp, p_tp, d_pp, d_tp, heads, layers, p_split, d_split, start, kw, id=label
    )


CASES = [
    _case(2, 2, 1, 4),
    _case(1, 2, 2, 1),
    _case(1, 4, 2, 2, start=11),
    _case(2, 2, 2, 4, layers=5, p_split=[(0, 3), (3, 5)], d_split=[(0, 1), (1, 5)]),
    _case(3, 1, 1, 2, heads=2, layers=7, block_size=5, layout="HND"),
    _case(2, 8, 1, 4, heads=2, placement="kv_inner"),  # replicated source heads
    _case(1, 3, 3, 4, heads=12, layers=3, start=30),
    _case(2, 4, 1, 2, heads=1),  # MLA: one source per destination stage
    _case(1, 2, 2, 3, heads=1, layers=5, start=9),
]


@pytest.mark.parametrize("p_pp,p_tp,d_pp,d_tp,heads,layers,p_split,d_split,start,kw", CASES)
@pytest.mark.parametrize("strategy", [None, *STRATEGIES])
def test_reshard_across_pipeline_stages_is_exact(
    p_pp, p_tp, d_pp, d_tp, heads, layers, p_split, d_split, start, kw, strategy
):
    src, dst = _sides(p_pp, p_tp, d_pp, d_tp, heads, layers, p_split, d_split, **kw)
    tokens = 41
    sc = make_scenario(src, dst, tokens, start)
    result = reshard(sc.src, sc.dst, tokens, start, strategy=strategy)
    sc.assert_exact()
    assert_fed_once(result, dst)
    planes = 1 if heads == 1 else 2
    cell = planes * (tokens - start) * 8 * 2  # head_dim 8, fp16
    assert result.nbytes == sum(len(p.layers) * len(p.heads) for p in result.pairs) * cell


def test_only_overlapping_stages_pair():
    # Prefill PP 2 (layers 0-1, 2-3) to decode PP 2 with the same split: stage to stage only.
    src, dst = _sides(2, 1, 2, 1, 2, 4, None, None)
    sc = make_scenario(src, dst, 20)
    result = reshard(sc.src, sc.dst, 20)
    sc.assert_exact()
    assert sorted((p.src_rank, p.dst_rank, p.layers) for p in result.pairs) == [
        (0, 0, range(0, 2)),
        (1, 1, range(2, 4)),
    ]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pp_geometries())
def test_reshard_matches_reference_on_random_pipeline_geometries(g):
    reshard_random_geometry(g, backend="torch")


# ---- the reference ---------------------------------------------------------------------------


def test_reference_writes_a_stages_own_layers():
    src, _ = _sides(2, 2, 1, 1, 4, 5, [(0, 2), (2, 5)], None)
    plain = side_specs(2, num_layers=5)
    kv = random_global_kv(src[3], 9, seed=4)
    assert torch.equal(kv, random_global_kv(plain[0], 9, seed=4))  # any rank, either engine
    ids = np.array([3, 1, 0])
    stage = allocate_kv_caches(src[3])  # pp 1, tp 1: layers 2-4
    whole = allocate_kv_caches(plain[1])  # tp 1, every layer
    for t in (*stage, *whole):
        t.zero_()
    write_rank_cells(src[3], stage, ids, kv, 0, 9)
    write_rank_cells(plain[1], whole, ids, kv, 0, 9)
    assert rank_layers(src[3]) == [2, 3, 4]
    for local, layer in enumerate(rank_layers(src[3])):
        assert torch.equal(stage[local], whole[layer])
    with pytest.raises(ValueError, match="global_kv"):
        write_rank_cells(src[3], stage, ids, kv[:4], 0, 9)
