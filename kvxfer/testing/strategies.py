"""Hypothesis strategies drawing random pairs of engine geometries, and the reshard check run on
each. Needs Hypothesis (the `test` extra): `kvxfer.testing` itself does not import this module.
"""

from __future__ import annotations

import itertools
from typing import Any

from hypothesis import strategies as st

from kvxfer.plan import STRATEGIES, strategies_for
from kvxfer.reference import rank_heads, rank_layers
from kvxfer.reshard import ReshardResult, reshard
from kvxfer.spec import KV_PLACEMENTS, KVCacheSpec
from kvxfer.testing.geometry import side_specs
from kvxfer.testing.scenario import make_scenario


def _valid_tp(heads: int) -> st.SearchStrategy[int]:
    options = [
        t for t in range(1, 9) if (heads >= t and heads % t == 0) or (heads < t and t % heads == 0)
    ]
    return st.sampled_from(options)


@st.composite
def geometries(draw: st.DrawFn) -> dict[str, Any]:
    """A random pair of shardings, request and strategy."""
    mla = draw(st.booleans())
    heads = 1 if mla else draw(st.sampled_from([1, 2, 3, 4, 6, 12]))
    sides = [
        dict(
            tp=draw(_valid_tp(heads)),
            block_size=draw(st.sampled_from([1, 2, 3, 5, 8, 16, 32, 48])),
            layout=draw(st.sampled_from(["NHD", "HND"])),
            placement=draw(st.sampled_from(KV_PLACEMENTS)),
        )
        for _ in range(2)
    ]
    tokens = draw(st.integers(1, 70))
    return dict(
        mla=mla,
        heads=heads,
        sides=sides,
        head_dim=draw(st.sampled_from([1, 3, 4, 8])),
        dtype=draw(st.sampled_from(["float16", "bfloat16", "float32"])),
        num_layers=draw(st.integers(1, 3)),
        tokens=tokens,
        start=draw(st.integers(0, tokens)),
        strategy=draw(st.sampled_from([None, *STRATEGIES])),
        contiguous=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


@st.composite
def pp_geometries(draw: st.DrawFn) -> dict[str, Any]:
    """`geometries` with pipeline parallelism on either side, or both: up to 3 stages per side,
    each holding a random, uneven, contiguous share of up to 5 layers."""
    g = draw(geometries())
    g["num_layers"] = draw(st.integers(1, 5))
    for side in g["sides"]:
        side["pp"] = draw(st.integers(1, min(3, g["num_layers"])))
        cuts = draw(
            st.lists(
                st.integers(1, g["num_layers"] - 1),
                min_size=side["pp"] - 1,
                max_size=side["pp"] - 1,
                unique=True,
            )
            if side["pp"] > 1
            else st.just([])
        )
        bounds = [0, *sorted(cuts), g["num_layers"]]
        side["layer_ranges"] = list(itertools.pairwise(bounds))
    return g


def geometry_specs(g: dict[str, Any]) -> list[list[KVCacheSpec]]:
    """Every rank's spec of both sides of a request `geometries()` drew (blocks to spare)."""
    specs = []
    for side in g["sides"]:
        needed = -(-g["tokens"] // side["block_size"])
        specs.append(
            side_specs(
                side["tp"],
                heads=g["heads"],
                block_size=side["block_size"],
                layout=side["layout"],
                placement=side["placement"],
                mla=g["mla"],
                num_layers=g["num_layers"],
                head_dim=g["head_dim"],
                dtype=g["dtype"],
                num_blocks=needed + 3,
                pp=side.get("pp", 1),
                layer_ranges=side.get("layer_ranges"),
            )
        )
    return specs


def movable_strategy(draw: st.DrawFn, g: dict[str, Any]) -> str | None:
    """A strategy that can move the pair `g` describes (`strategies_for` its first ranks), or
    None: the cost model's choice."""
    src, dst = (specs[0] for specs in geometry_specs(g))
    return draw(st.sampled_from([None, *strategies_for(src, dst)]))


def reshard_random_geometry(g: dict[str, Any], backend: str) -> None:
    """Reshard the request `g` describes with `backend`, and check every destination byte
    (and that every destination layer x head is fed exactly once)."""
    specs = geometry_specs(g)
    sc = make_scenario(specs[0], specs[1], g["tokens"], g["start"], g["seed"], g["contiguous"])
    result = reshard(
        sc.src, sc.dst, g["tokens"], g["start"], strategy=g["strategy"], backend=backend
    )
    sc.assert_exact()
    if g["start"] < g["tokens"]:
        assert_fed_once(result, specs[1])


def assert_fed_once(result: ReshardResult, dst_specs: list[KVCacheSpec]) -> None:
    """Every destination rank's every (layer, head) is moved by exactly one pair, from a
    source rank that holds it."""
    fed = sorted(
        (p.dst_rank, layer, head) for p in result.pairs for layer in p.layers for head in p.heads
    )
    want = sorted(
        (s.engine_rank, layer, head)
        for s in dst_specs
        for layer in rank_layers(s)
        for head in rank_heads(s)
    )
    assert fed == want
