"""Mamba state (`kvxfer.state`) through the Triton kernels (interpreter on CPU tensors): the
state groups' layers are views whose blocks sit a page apart (`block_stride`), and rows of
6 bytes take the narrow-word variant. Every strategy, TP 2 -> 4 and 4 -> 2, every page byte
compared with independently packed pages."""

from __future__ import annotations

import pytest
import torch
from state_cases import POISON, global_states, layout, pages, write_state

from kvxfer import reshard


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(2, 4), (4, 2)])
@pytest.mark.parametrize("strategy", ["direct", "pack", "unpack", "pack+unpack"])
def test_triton_moves_state_exactly(src_tp, dst_tp, strategy):
    states = global_states(seed=5)
    src_pages = []
    for rank in range(src_tp):
        layer_pages = pages(seed=rank)
        write_state(layer_pages, states, src_tp, rank, 3)
        src_pages.append(layer_pages)
    dst_pages = [pages(POISON) for _ in range(dst_tp)]
    src_groups = [layout(src_tp, r).groups(p) for r, p in enumerate(src_pages)]
    dst_groups = [layout(dst_tp, r).groups(p) for r, p in enumerate(dst_pages)]
    for g in range(len(src_groups[0])):
        reshard(
            [(gs[g].spec, gs[g].caches, [3]) for gs in src_groups],
            [(gs[g].spec, gs[g].caches, [0]) for gs in dst_groups],
            1,
            strategy=strategy,
            backend="triton",
        )
    for rank, got in enumerate(dst_pages):
        want = pages(POISON)
        write_state(want, states, dst_tp, rank, 0)
        for layer, (g, w) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(g, w), f"rank {rank} layer {layer}"
