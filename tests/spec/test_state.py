"""Mamba state resharded across TP, bit for bit: `StateLayout` turns each rank's pages into one
cache group per (state, sub-projection), and `reshard` (every strategy, torch backend) and the
connectors over Mooncake TCP move a request's state block from TP `a` to TP `b`. Destinations
are poisoned first; every byte of every page is compared with pages packed independently
(`state_cases.rank_page`): the request's block gets exactly the rank's slices, everything else
(other blocks, the page's padding) keeps its poison."""

from __future__ import annotations

import pytest
import torch
from state_cases import (
    NUM_BLOCKS,
    PAGE_BYTES,
    components,
    global_states,
    layout,
    pages,
    rank_page,
    write_state,
)

from kvxfer import reshard
from kvxfer.connector import GroupedConsumer, GroupedProducer
from kvxfer.state import StateComponent, StateLayout
from kvxfer.testing import POISON

SRC_BLOCK, DST_BLOCK = 4, 1
TP_PAIRS = [(2, 4), (4, 2), (1, 2), (2, 2)]


def _side(tp: int, poisoned: bool, states, grouped: bool = False):
    """Every rank's (layout, pages) of one engine, the request's state in SRC_BLOCK unless
    poisoned (`grouped`: one Mamba group, B and C whole on every rank)."""
    ranks = []
    for rank in range(tp):
        layer_pages = pages(POISON if poisoned else None, seed=rank)
        if not poisoned:
            write_state(layer_pages, states, tp, rank, SRC_BLOCK, grouped)
        ranks.append((layout(tp, rank, grouped=grouped), layer_pages))
    return ranks


def _expected(tp: int, states, grouped: bool = False) -> list[list[torch.Tensor]]:
    expected = []
    for rank in range(tp):
        layer_pages = pages(POISON)
        write_state(layer_pages, states, tp, rank, DST_BLOCK, grouped)
        expected.append(layer_pages)
    return expected


def _reshard_groups(src, dst, strategy: str) -> None:
    src_groups = [lay.groups(p) for lay, p in src]
    dst_groups = [lay.groups(p) for lay, p in dst]
    for g in range(len(src_groups[0])):
        reshard(
            [(gs[g].spec, gs[g].caches, [SRC_BLOCK]) for gs in src_groups],
            [(gs[g].spec, gs[g].caches, [DST_BLOCK]) for gs in dst_groups],
            1,
            strategy=strategy,
            backend="torch",
        )


def _assert_pages(dst, expected) -> None:
    for rank, ((_, got), want) in enumerate(zip(dst, expected, strict=True)):
        for layer, (g, w) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(g, w), f"rank {rank} layer {layer}: {int((g != w).sum())} bytes"


@pytest.mark.parametrize(("src_tp", "dst_tp"), TP_PAIRS)
@pytest.mark.parametrize("strategy", ["direct", "pack", "unpack", "pack+unpack"])
def test_reshard_moves_state_exactly(src_tp, dst_tp, strategy):
    states = global_states(seed=src_tp * 10 + dst_tp)
    src, dst = _side(src_tp, False, states), _side(dst_tp, True, states)
    _reshard_groups(src, dst, strategy)
    _assert_pages(dst, _expected(dst_tp, states))


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1)])
@pytest.mark.parametrize("strategy", ["direct", "pack+unpack"])
def test_reshard_moves_a_replicated_mamba_group_exactly(src_tp, dst_tp, strategy):
    """One Mamba group (B and C whole on every rank beyond TP 1): each destination rank gets
    its x slice and the whole of B and C, from whichever source holds them."""
    states = global_states(seed=src_tp * 10 + dst_tp + 5)
    src = _side(src_tp, False, states, grouped=True)
    dst = _side(dst_tp, True, states, grouped=True)
    _reshard_groups(src, dst, strategy)
    _assert_pages(dst, _expected(dst_tp, states, grouped=True))


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(2, 4), (4, 2)])
def test_connectors_move_state_over_mooncake(src_tp, dst_tp):
    states = global_states(seed=7)
    src, dst = _side(src_tp, False, states), _side(dst_tp, True, states)
    producers = [GroupedProducer(lay.groups(p), "prefill") for lay, p in src]
    consumers = [GroupedConsumer(lay.groups(p), "decode") for lay, p in dst]
    try:
        n_groups = len(producers[0].groups)
        for consumer in consumers:
            consumer.connect([p.addresses for p in producers], timeout=10)
        # The state is token 0 of the table's first block, whatever the request's length.
        for producer in producers:
            producer.publish("r", [[SRC_BLOCK, 0, 0]] * n_groups, 37)
        results = [c.fetch("r", [[DST_BLOCK, 0, 0]] * n_groups, 37).wait(30) for c in consumers]
        assert all(r.ok for r in results), [r.errors for r in results]
        _assert_pages(dst, _expected(dst_tp, states))
    finally:
        for c in consumers:
            c.close()
        for p in producers:
            p.close()


def test_slices_follow_vllm_page_packing():
    lay = layout(2, 1)
    # x, B, C of the conv state (6 bytes a row), then the SSM heads (64 bytes a row).
    assert lay.slices() == [(0, 16, 6), (48, 8, 6), (72, 8, 6), (96, 8, 64)]
    assert lay.rank_bytes == 96 + 4 * 64
    spec = lay.specs(2, NUM_BLOCKS)[3]
    assert (spec.num_kv_heads, spec.heads_per_rank, spec.block_stride) == (8, 4, PAGE_BYTES)


def test_layouts_that_cannot_be_moved_are_refused():
    with pytest.raises(ValueError, match="cannot split evenly or replicate"):
        StateLayout(components(), PAGE_BYTES, 3, 0)
    with pytest.raises(ValueError, match="cannot split evenly or replicate"):
        StateLayout((StateComponent(2, (3,), torch.bfloat16),), PAGE_BYTES, 3, 0)
    with pytest.raises(ValueError, match="do not add up"):
        StateLayout((StateComponent(10, (3,), torch.bfloat16, (4, 4)),), PAGE_BYTES, 2, 0)
    with pytest.raises(ValueError, match="more than the"):
        StateLayout(components(), 64, 2, 0)
    with pytest.raises(ValueError, match="bytes apart"):
        layout(2, 0).groups([torch.zeros(NUM_BLOCKS, PAGE_BYTES // 2, dtype=torch.uint8)])


def test_a_replicated_group_takes_one_row_on_every_rank():
    lay = layout(4, 3, grouped=True)
    # x's quarter (4 channels of 6 bytes), B and C whole (8 channels of 6 bytes), SSM heads.
    assert lay.slices() == [(0, 16, 6), (24, 1, 48), (72, 1, 48), (120, 8, 64)]
    spec = lay.specs(2, NUM_BLOCKS)[1]
    assert (spec.num_kv_heads, spec.heads_per_rank, spec.first_head) == (1, 1, 0)


def test_rank_page_packs_sub_projections_per_rank():
    """The oracle itself: rank 1 of 2 holds the second half of x, of B and of C."""
    conv, ssm = global_states(seed=3)[0]
    data = rank_page(conv, ssm, 2, 1)
    local = data[: 32 // 2 * 6].view(torch.bfloat16).view(16, 3)
    assert torch.equal(local[:8], conv[8:16])
    assert torch.equal(local[8:12], conv[20:24])
    assert torch.equal(local[12:16], conv[28:32])
