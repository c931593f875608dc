"""A chunk is planned from its own blocks: `PairChunk`'s programs and copies see only the block
ids of the chunk's tokens (`chunk_blocks`), and a request moved chunk by chunk lands the same
bytes as the request moved whole, for every strategy, layout, block size and pipeline split."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer import reshard
from kvxfer.plan import STRATEGIES, plan_pairs
from kvxfer.plan.program import PairChunk, chunk_block_count
from kvxfer.plan.sizing import chunk_alignment, chunk_bounds, max_chunk_tokens
from kvxfer.reference import random_global_kv, write_rank_cells
from kvxfer.spec import allocate_kv_caches
from kvxfer.testing import POISON, bits, side_specs
from kvxfer.testing.strategies import geometry_specs, pp_geometries


def _table(spec, tokens: int, rng: np.random.Generator) -> np.ndarray:
    needed = -(-tokens // spec.block_size)
    return rng.permutation(spec.num_blocks)[:needed].astype(np.int64)


def _other_blocks_changed(table, block_size, lo, hi, rng) -> np.ndarray:
    """The same table for the chunk's blocks, other (still distinct) ids everywhere else."""
    other = table.copy()
    first, last = lo // block_size, (hi - 1) // block_size
    outside = [i for i in range(len(table)) if not first <= i <= last]
    other[outside] = table[rng.permutation(outside)] if outside else other[outside]
    return other


def _copy_key(copy):
    if copy is None:
        return None
    views = (copy.src, copy.dst)
    return tuple((v.region, v.token_shift, v.block_ids.tolist()) for v in views)


def _assert_same_program(a, b) -> None:
    for field in ("src_region", "src_offset", "dst_region", "dst_offset", "length"):
        assert np.array_equal(getattr(a.segments, field), getattr(b.segments, field))
    assert (a.src_staging, a.dst_staging) == (b.src_staging, b.dst_staging)
    assert _copy_key(a.pack) == _copy_key(b.pack)
    assert _copy_key(a.unpack) == _copy_key(b.unpack)


@given(g=pp_geometries(), cut=st.integers(1, 40), data=st.data())
@settings(max_examples=120, deadline=None)
def test_a_chunk_is_planned_from_its_own_blocks_alone(g, cut, data):
    src_specs, dst_specs = geometry_specs(g)
    rng = np.random.default_rng(g["seed"])
    tokens, start = g["tokens"], min(g["start"], g["tokens"] - 1)
    strategy = g["strategy"] or data.draw(st.sampled_from(STRATEGIES))
    landing = data.draw(st.booleans())
    for plan in plan_pairs(src_specs, dst_specs, strategy=strategy, landing=landing):
        s, d = src_specs[plan.src_rank], dst_specs[plan.dst_rank]
        src_ids, dst_ids = _table(s, tokens, rng), _table(d, tokens, rng)
        for lo, hi in chunk_bounds(start, tokens, cut):
            chunk = PairChunk(plan.route, strategy, s, d, lo, hi, landing)
            s_chunk, d_chunk = chunk.source_blocks(src_ids), chunk.destination_blocks(dst_ids)
            assert len(s_chunk) == chunk_block_count(s.block_size, lo, hi)
            assert len(d_chunk) == chunk_block_count(d.block_size, lo, hi)
            program = chunk.program(s_chunk, d_chunk)
            other_src = _other_blocks_changed(src_ids, s.block_size, lo, hi, rng)
            other_dst = _other_blocks_changed(dst_ids, d.block_size, lo, hi, rng)
            again = chunk.program(
                chunk.source_blocks(other_src), chunk.destination_blocks(other_dst)
            )
            _assert_same_program(program, again)
            assert _copy_key(program.pack) == _copy_key(chunk.pack(s_chunk))
            assert _copy_key(program.unpack) == _copy_key(chunk.unpack(d_chunk))


def _poisoned(specs):
    caches = [allocate_kv_caches(spec) for spec in specs]
    for rank in caches:
        for t in rank:
            bits(t).fill_(POISON)
    return caches


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
def test_a_request_moved_chunk_by_chunk_lands_what_it_lands_moved_whole(strategy, src, dst):
    """Bit for bit: every chunk's programs (cache views shifted to the chunk's first block)
    write what the whole request's do, and that is the reference's, the rest poisoned."""
    specs = side_specs(2, heads=4, layout=src[0], block_size=src[1], num_blocks=40, head_dim=4)
    dspecs = side_specs(2, heads=4, layout=dst[0], block_size=dst[1], num_blocks=40, head_dim=4)
    rng = np.random.default_rng(3)
    tokens, first = 150, 7
    kv = random_global_kv(specs[0], tokens, seed=5)
    src_caches = [allocate_kv_caches(spec) for spec in specs]
    src_ids = [_table(spec, tokens, rng) for spec in specs]
    dst_ids = [_table(spec, tokens, rng) for spec in dspecs]
    for spec, caches, ids in zip(specs, src_caches, src_ids, strict=True):
        write_rank_cells(spec, caches, ids, kv, 0, tokens)
    source = list(zip(specs, src_caches, src_ids, strict=True))
    whole, chunked, expected = _poisoned(dspecs), _poisoned(dspecs), _poisoned(dspecs)
    reshard(source, list(zip(dspecs, whole, dst_ids, strict=True)), tokens, first, strategy)
    unit = chunk_alignment(strategy, specs[0], dspecs[0], landing=True)
    for lo, hi in chunk_bounds(first, tokens, unit * max(1, 48 // unit)):
        reshard(source, list(zip(dspecs, chunked, dst_ids, strict=True)), hi, lo, strategy)
    for spec, caches, ids in zip(dspecs, expected, dst_ids, strict=True):
        write_rank_cells(spec, caches, ids, kv, first, tokens)
    for got_whole, got_chunked, want in zip(whole, chunked, expected, strict=True):
        for a, b, c in zip(got_whole, got_chunked, want, strict=True):
            assert torch.equal(bits(a), bits(c)) and torch.equal(bits(b), bits(c))


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
