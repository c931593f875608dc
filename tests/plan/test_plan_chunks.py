"""A chunk is planned from its own blocks: `chunk_program`, `chunk_pack_copy` and
`chunk_unpack_copy` see only the block ids of the chunk's tokens (`chunk_blocks`) and give the
same segments and the same bytes as the whole-table `build_program`, `pack_copy` and
`unpack_copy`, for every strategy, layout, block size and pipeline split."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import REPO
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.execute import run_cell_copy
from kvxfer.plan import STRATEGIES, plan_pairs
from kvxfer.plan.program import (
    CellCopy,
    build_program,
    chunk_block_count,
    chunk_blocks,
    chunk_pack_copy,
    chunk_program,
    chunk_unpack_copy,
    pack_copy,
    unpack_copy,
)
from kvxfer.plan.sizing import chunk_alignment, chunk_bounds, max_chunk_tokens
from kvxfer.spec import allocate_kv_caches
from kvxfer.testing import POISON, bits, side_specs
from kvxfer.testing.strategies import geometry_specs, pp_geometries


def _table(spec, tokens: int, rng: np.random.Generator) -> np.ndarray:
    needed = -(-tokens // spec.block_size)
    return rng.permutation(spec.num_blocks)[:needed].astype(np.int64)


def _run(copy: CellCopy, src_spec, dst_spec, seed: int) -> list[torch.Tensor]:
    """Run a pack (source cache -> staging) or an unpack (staging -> destination cache) from
    random bytes into poisoned buffers; the destination's bytes."""
    gen = torch.Generator().manual_seed(seed)
    layers = copy.num_layers or src_spec.num_layers
    packs = copy.src.region == "cache"
    cache = allocate_kv_caches(src_spec if packs else dst_spec)
    staging_view = copy.dst if packs else copy.src
    staging = [torch.empty(layers * staging_view.geometry.layer_elements, dtype=cache[0].dtype)]
    src, dst = (cache, staging) if packs else (staging, cache)
    for t in src:
        b = bits(t)
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=gen))
    for t in dst:
        bits(t).fill_(POISON)
    run_cell_copy(copy, src, dst, "torch")
    return [bits(t).clone() for t in dst]


@given(g=pp_geometries(), cut=st.integers(1, 40), data=st.data())
@settings(max_examples=120, deadline=None)
def test_chunk_programs_equal_whole_table_programs(g, cut, data):
    src_specs, dst_specs = geometry_specs(g)
    rng = np.random.default_rng(g["seed"])
    tokens, start = g["tokens"], min(g["start"], g["tokens"] - 1)
    strategy = g["strategy"] or data.draw(st.sampled_from(STRATEGIES))
    landing = data.draw(st.booleans())
    for plan in plan_pairs(src_specs, dst_specs, strategy=strategy, landing=landing):
        s, d = src_specs[plan.src_rank], dst_specs[plan.dst_rank]
        src_ids, dst_ids = _table(s, tokens, rng), _table(d, tokens, rng)
        for lo, hi in chunk_bounds(start, tokens, cut):
            s_chunk = chunk_blocks(src_ids, s.block_size, lo, hi)
            d_chunk = chunk_blocks(dst_ids, d.block_size, lo, hi)
            assert len(s_chunk) == chunk_block_count(s.block_size, lo, hi)
            assert len(d_chunk) == chunk_block_count(d.block_size, lo, hi)
            whole = build_program(plan.route, strategy, s, d, src_ids, dst_ids, lo, hi, landing)
            part = chunk_program(plan.route, strategy, s, d, s_chunk, d_chunk, lo, hi, landing)
            for field in ("src_region", "src_offset", "dst_region", "dst_offset", "length"):
                assert np.array_equal(getattr(whole.segments, field), getattr(part.segments, field))
            assert (whole.src_staging, whole.dst_staging) == (part.src_staging, part.dst_staging)
            assert (whole.pack is None) == (part.pack is None)
            assert (whole.unpack is None) == (part.unpack is None)


@pytest.mark.parametrize(
    "strategy,src,dst",
    [
        pytest.param(st_, src, dst, id=f"{st_}-{src[0]}{src[1]}-{dst[0]}{dst[1]}")
        for st_ in STRATEGIES
        for src, dst in [
            (("NHD", 16), ("HND", 32)),
            (("HND", 48), ("NHD", 16)),
            (("NHD", 5), ("NHD", 8)),
        ]
    ],
)
def test_chunk_copies_move_the_same_bytes(strategy, src, dst):
    """Bit for bit: the pack and unpack of every chunk, from the chunk's block ids only, write
    exactly what the whole-table copies write (and leave the rest poisoned alike)."""
    (s,) = side_specs(1, heads=3, layout=src[0], block_size=src[1], num_blocks=40, head_dim=4)
    (d,) = side_specs(1, heads=3, layout=dst[0], block_size=dst[1], num_blocks=40, head_dim=4)
    (plan,) = plan_pairs([s], [d], strategy=strategy, landing=True)
    rng = np.random.default_rng(3)
    tokens = 150
    src_ids, dst_ids = _table(s, tokens, rng), _table(d, tokens, rng)
    unit = chunk_alignment(strategy, s, d, landing=True)
    for lo, hi in chunk_bounds(7, tokens, unit * max(1, 48 // unit)):
        route = plan.route
        whole = pack_copy(strategy, route, s, d, src_ids, lo, hi)
        part = chunk_pack_copy(
            strategy, route, s, d, chunk_blocks(src_ids, s.block_size, lo, hi), lo, hi
        )
        if whole is not None:
            assert part is not None
            for a, b in zip(_run(whole, s, d, lo), _run(part, s, d, lo), strict=True):
                assert torch.equal(a, b), (lo, hi)
        whole = unpack_copy(strategy, route, s, d, dst_ids, lo, hi, landing=True)
        part = chunk_unpack_copy(
            strategy, route, s, d, chunk_blocks(dst_ids, d.block_size, lo, hi), lo, hi, True
        )
        assert whole is not None and part is not None
        for a, b in zip(_run(whole, s, d, lo), _run(part, s, d, lo), strict=True):
            assert torch.equal(a, b), (lo, hi)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_chunk_alignment_matches_max_chunk_tokens(strategy):
    """`max_chunk_tokens` always returns a multiple of `chunk_alignment`."""
    (s,) = side_specs(1, heads=4, block_size=48, num_blocks=64)
    (d,) = side_specs(1, heads=4, block_size=32, num_blocks=64)
    (plan,) = plan_pairs([s], [d], strategy=strategy, landing=True)
    unit = chunk_alignment(strategy, s, d, landing=True)
    for slot in (1 << 12, 1 << 14, 12345, 1 << 17):
        cap = max_chunk_tokens(strategy, plan.route, s, d, slot, slot, landing=True)
        assert cap is not None and cap % unit == 0, (slot, cap, unit)


def test_chunk_copies_compile_the_warm_up_variant():
    """A chunk's cache views start at its first block (a token shift): the shift is a runtime
    argument, so every chunk's pack and unpack reuse the variant the handshake compiled
    (Triton's key, computed on the host as in tests/kernels/test_kernel_variants.py)."""
    import importlib.util
    import sys

    from kvxfer.execute import kv_buffer, scratch_copy
    from kvxfer.kernels import prepare_cell_copy

    script = REPO / "benchmarks" / "kernel_codegen.py"
    spec = importlib.util.spec_from_file_location("kernel_codegen", script)
    assert spec is not None and spec.loader is not None
    codegen = sys.modules.get("kernel_codegen") or importlib.util.module_from_spec(spec)
    if "kernel_codegen" not in sys.modules:
        sys.modules["kernel_codegen"] = codegen
        spec.loader.exec_module(codegen)

    def key(copy, src, dst):
        a, b = kv_buffer(copy.src, src), kv_buffer(copy.dst, dst)
        launch = prepare_cell_copy(a, b, copy.token_start, copy.token_end, copy.num_heads)
        return codegen.specialization_key(launch)

    (s,) = side_specs(1, heads=8, head_dim=128, block_size=16, num_blocks=64, dtype="bfloat16")
    (d,) = side_specs(
        1, heads=8, head_dim=128, block_size=48, layout="HND", num_blocks=64, dtype="bfloat16"
    )
    src_caches, dst_caches = allocate_kv_caches(s), allocate_kv_caches(d)
    rng = np.random.default_rng(1)
    src_ids, dst_ids = _table(s, 1000, rng), _table(d, 1000, rng)
    for strategy in STRATEGIES:
        (plan,) = plan_pairs([s], [d], strategy=strategy, landing=True)
        seen: dict[str, set] = {"pack": set(), "unpack": set()}
        warm: dict[str, object] = {}
        for lo, hi in chunk_bounds(5, 1000, 96):
            copies = {
                "pack": chunk_pack_copy(
                    strategy, plan.route, s, d, chunk_blocks(src_ids, 16, lo, hi), lo, hi
                ),
                "unpack": chunk_unpack_copy(
                    strategy, plan.route, s, d, chunk_blocks(dst_ids, 48, lo, hi), lo, hi, True
                ),
            }
            for side, copy in copies.items():
                if copy is None:
                    continue
                caches = src_caches if side == "pack" else dst_caches
                layers = copy.num_layers or len(caches)
                staging_view = copy.dst if side == "pack" else copy.src
                staging = [
                    torch.empty(
                        layers * staging_view.geometry.layer_elements, dtype=caches[0].dtype
                    )
                ]
                src, dst = (caches, staging) if side == "pack" else (staging, caches)
                seen[side].add(key(copy, src, dst))
                if side not in warm:  # what the connectors compile at the handshake
                    one_id = np.zeros(1, np.int64)
                    first = (
                        pack_copy(strategy, plan.route, s, d, one_id, 0, 1)
                        if side == "pack"
                        else unpack_copy(strategy, plan.route, s, d, one_id, 0, 1, True)
                    )
                    assert first is not None
                    one, a, b = scratch_copy(first, caches[0].dtype, caches[0].device)
                    warm[side] = key(one, a, b)
        for side, keys in seen.items():
            assert not keys or keys == {warm[side]}, (strategy, side, len(keys))
