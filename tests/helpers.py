"""Scenario builders shared by the tests: ranks filled from a global KV, poisoned outputs."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch
from hypothesis import strategies as st

from kvxfer import STRATEGIES, KVCacheSpec, allocate_kv_caches, reshard
from kvxfer.reference import random_global_kv, rank_heads, rank_layers, write_rank_cells
from kvxfer.spec import KV_PLACEMENTS, pp_layer_ranges

POISON_BYTE = 0xA5


def side_specs(
    tp: int,
    *,
    heads: int = 4,
    block_size: int = 16,
    layout: str = "NHD",
    placement: str = "kv_first",
    mla: bool = False,
    num_layers: int = 2,
    head_dim: int = 8,
    dtype: str = "float16",
    num_blocks: int = 64,
    pp: int = 1,
    layer_ranges: list[tuple[int, int]] | None = None,
) -> list[KVCacheSpec]:
    """Every rank's spec of one engine, by engine rank (pp-major). With `pp > 1`, the model's
    `num_layers` layers are split over the stages as `layer_ranges` says (default: vLLM's
    default split)."""
    ranges = layer_ranges or [(r.start, r.stop) for r in pp_layer_ranges(num_layers, pp)]
    return KVCacheSpec(
        num_layers=ranges[0][1] if pp > 1 else num_layers,
        num_kv_heads=1 if mla else heads,
        head_dim=head_dim,
        dtype=dtype,  # type: ignore[arg-type]
        tp_size=tp,
        tp_rank=0,
        block_size=block_size,
        num_blocks=num_blocks,
        layout=layout,  # type: ignore[arg-type]
        kv_placement=placement,  # type: ignore[arg-type]
        mla=mla,
        pp_size=pp,
        total_layers=num_layers if pp > 1 else 0,
    ).engine_ranks(ranges if pp > 1 else None)


def block_table(spec: KVCacheSpec, num_tokens: int, rng: np.random.Generator, contiguous: bool):
    """A request's block ids on one rank: a random permutation, or a run from a random start."""
    needed = -(-num_tokens // spec.block_size)
    if contiguous:
        start = int(rng.integers(0, spec.num_blocks - needed + 1))
        return np.arange(start, start + needed, dtype=np.int64)
    return rng.permutation(spec.num_blocks)[:needed].astype(np.int64)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor, for exact comparison."""
    return t.contiguous().view(torch.uint8)


@dataclass
class Scenario:
    """Source ranks holding a request, poisoned destination ranks, and what they must become."""

    src: list
    dst: list
    expected: list[list[torch.Tensor]]
    num_tokens: int
    start_token: int

    def assert_exact(self) -> None:
        """Every destination layer equals its expectation bit for bit, untouched cells too."""
        for (spec, caches, _), expected in zip(self.dst, self.expected, strict=True):
            for layer, (got, want) in enumerate(zip(caches, expected, strict=True)):
                if not torch.equal(bits(got), bits(want)):
                    diff = (bits(got) != bits(want)).nonzero()
                    raise AssertionError(
                        f"destination {spec.rank_name} layer {layer}: "
                        f"{diff.shape[0]} bytes differ, first at byte {diff[0].tolist()}"
                    )

    def assert_untouched(self) -> None:
        """Every destination byte still holds the poison."""
        for spec, caches, _ in self.dst:
            for layer, got in enumerate(caches):
                assert (bits(got) == POISON_BYTE).all(), f"{spec.rank_name} layer {layer}"


def make_scenario(
    src_specs: list[KVCacheSpec],
    dst_specs: list[KVCacheSpec],
    num_tokens: int,
    start_token: int = 0,
    seed: int = 0,
    contiguous: bool = False,
) -> Scenario:
    """Fill sources with noise plus the request's KV; poison destinations; compute expectations."""
    rng = np.random.default_rng(seed)
    kv = random_global_kv(src_specs[0], num_tokens, seed=seed)
    src = []
    for spec in src_specs:
        caches = allocate_kv_caches(spec)
        for t in caches:
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(seed + 7)))
        ids = block_table(spec, num_tokens, rng, contiguous)
        write_rank_cells(spec, caches, ids, kv, 0, num_tokens)
        src.append((spec, caches, ids))
    dst, expected = [], []
    for spec in dst_specs:
        caches = allocate_kv_caches(spec)
        for t in caches:
            bits(t).fill_(POISON_BYTE)
        ids = block_table(spec, num_tokens, rng, contiguous)
        want = [t.clone() for t in caches]
        write_rank_cells(spec, want, ids, kv, start_token, num_tokens)
        dst.append((spec, caches, ids))
        expected.append(want)
    return Scenario(src, dst, expected, num_tokens, start_token)


def _valid_tp(heads: int) -> st.SearchStrategy[int]:
    options = [
        t for t in range(1, 9) if (heads >= t and heads % t == 0) or (heads < t and t % heads == 0)
    ]
    return st.sampled_from(options)


@st.composite
def geometries(draw: st.DrawFn) -> dict:
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
def pp_geometries(draw: st.DrawFn) -> dict:
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


def geometry_specs(g: dict) -> list[list[KVCacheSpec]]:
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


def reshard_random_geometry(g: dict, backend: str) -> None:
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


def assert_fed_once(result, dst_specs: list[KVCacheSpec]) -> None:
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
