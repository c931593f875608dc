"""The consumer's pure planning, alone (no sockets, no transport): fitting a pair's plan to the
staging slots (`kvxfer.plan.fitting`) and checking a producer's answer while building a chunk's
read program (`kvxfer.plan.reads`). The same rules, end to end: tests/connector/test_chunking.py."""

from __future__ import annotations

import numpy as np
import pytest

from kvxfer.plan import CostModel, plan_pairs
from kvxfer.plan.cost import choose_chunking
from kvxfer.plan.fitting import fit_pair
from kvxfer.plan.program import PairChunk, build_program, chunk_blocks
from kvxfer.plan.reads import chunk_read_program, chunk_source_blocks, reads_from_staging
from kvxfer.plan.sizing import max_chunk_tokens
from kvxfer.testing import side_specs

(SRC,) = side_specs(1, heads=4, block_size=16, num_blocks=40)
(DST,) = side_specs(1, heads=4, block_size=32, layout="HND", num_blocks=40)
SLOTS = (16 << 10, 16 << 10)  # 64 tokens of this geometry's wire buffer
TCP = CostModel.tcp_loopback()


def plan(strategy=None):
    (only,) = plan_pairs([SRC], [DST], strategy=strategy, cost_model=TCP, landing=True)
    return only


@pytest.mark.parametrize("strategy", ["direct", "unpack", "pack", "pack+unpack"])
def test_a_forced_strategy_is_cut_by_the_cost_model_within_a_slot(strategy):
    fitted = fit_pair(plan(strategy), SRC, DST, SLOTS, model=TCP, staging_slots=4, forced=True)
    cap = max_chunk_tokens(strategy, fitted.plan.route, SRC, DST, *SLOTS, landing=True)
    assert cap is not None
    assert fitted.plan.strategy == strategy and fitted.src_rank == 0
    assert fitted.chunking == choose_chunking(strategy, fitted.plan.route, SRC, DST, TCP, cap, 4)
    assert (fitted.chunk_tokens, fitted.depth) == (fitted.chunking.tokens, fitted.chunking.depth)


def test_the_cheapest_strategy_that_takes_a_forced_size_is_chosen():
    fitted = fit_pair(plan(), SRC, DST, SLOTS, model=TCP, staging_slots=4, chunk_tokens=48)
    assert fitted.chunk_tokens == 48
    assert fitted.plan.strategy in ("unpack", "pack+unpack")  # 48: not whole 32-token blocks
    costs = {e.strategy: e.seconds for e in plan().estimates}
    takers = [s for s in ("unpack", "pack+unpack") if s in costs]
    assert fitted.plan.strategy == min(takers, key=costs.__getitem__)


def test_sizes_and_slots_that_fit_nothing_say_what_to_change():
    with pytest.raises(ValueError, match=r"chunk_tokens: 48 tokens .* multiples of 32"):
        fit_pair(
            plan("pack"), SRC, DST, SLOTS, model=TCP, staging_slots=4, forced=True, chunk_tokens=48
        )
    with pytest.raises(ValueError, match=r"staging_bytes: a slot cannot hold one token of pair"):
        fit_pair(plan(), SRC, DST, (128, 128), model=TCP, staging_slots=4)  # half a token


def test_a_producers_block_ids_are_checked_against_the_chunk():
    assert chunk_source_blocks(SRC, [5, 3], 16, 48).tolist() == [5, 3]
    for ids, why in [
        ([5], "it sent 1 block ids for tokens \\[16, 48\\)"),
        ([5, 40], "outside its 40 blocks"),
        ([5, -1], "outside its 40 blocks"),
        ([5, 5], "twice"),
    ]:
        with pytest.raises(ValueError, match=why):
            chunk_source_blocks(SRC, ids, 16, 48)


@pytest.mark.parametrize("strategy", ["direct", "unpack", "pack", "pack+unpack"])
def test_a_read_program_is_the_chunks_part_of_the_whole_program(strategy):
    pair = plan(strategy)
    src_ids, dst_ids = np.arange(10, 20, dtype=np.int64), np.arange(5, dtype=np.int64)
    lo, hi = 64, 128
    staged = reads_from_staging(strategy)
    assert staged == (strategy in ("pack", "pack+unpack"))
    given = None if staged else chunk_blocks(src_ids, SRC.block_size, lo, hi).tolist()
    program = chunk_read_program(pair.route, strategy, SRC, DST, dst_ids, lo, hi, given)
    whole = build_program(pair.route, strategy, SRC, DST, src_ids, dst_ids, lo, hi, landing=True)
    assert program.segments.nbytes == whole.segments.nbytes
    assert len(program.segments) == len(whole.segments)
    with pytest.raises(ValueError, match=r"it offered its (staging|cache) for a chunk of strategy"):
        chunk_read_program(pair.route, strategy, SRC, DST, dst_ids, lo, hi, [] if staged else None)


def _view_fields(view):
    """A cell view as comparable values (its block ids as a list)."""
    block_ids = view.block_ids.tolist()
    return [
        view.geometry,
        block_ids,
        view.token_shift,
        view.head_offset,
        view.region,
        view.layer_offset,
    ]


def _fields(copy):
    """A cell copy as comparable values (its arrays as lists)."""
    if copy is None:
        return None
    scalars = [copy.num_heads, copy.token_start, copy.token_end, copy.num_layers, copy.scales]
    return [_view_fields(copy.src), _view_fields(copy.dst), *scalars]


@pytest.mark.parametrize("strategy", ["pack", "pack+unpack"])
def test_a_staged_chunks_program_is_made_once_per_shape_and_unpacks_into_its_own_blocks(
    strategy,
):
    pair = plan(strategy)
    lo, hi = 64, 128
    programs = []
    for dst_ids in (np.arange(5, dtype=np.int64), np.array([9, 2, 7, 4, 30], dtype=np.int64)):
        program = chunk_read_program(pair.route, strategy, SRC, DST, dst_ids, lo, hi, None)
        src_ids = np.zeros(4, dtype=np.int64)  # what a staged source's ids are: none read
        chunk = PairChunk(pair.route, strategy, SRC, DST, lo, hi, landing=True)
        fresh = chunk.program(src_ids, chunk.destination_blocks(dst_ids))
        for name in ("src_region", "src_offset", "dst_region", "dst_offset", "length"):
            assert (
                getattr(program.segments, name).tolist() == getattr(fresh.segments, name).tolist()
            )
        assert _fields(program.unpack) == _fields(fresh.unpack)
        assert _fields(program.pack) == _fields(fresh.pack)
        assert (program.num_layers, program.src_staging, program.dst_staging) == (
            fresh.num_layers, fresh.src_staging, fresh.dst_staging,
        )  # fmt: skip
        programs.append(program)
    first, second = programs
    assert first.segments is second.segments  # shared by every chunk of this shape
    assert not first.segments.length.flags.writeable  # so nobody may change it
    if first.unpack is not None:
        assert first.unpack.dst.block_ids.tolist() != second.unpack.dst.block_ids.tolist()
