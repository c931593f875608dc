"""Mamba state (`kvxfer.state`) through the Triton kernels: on CPU tensors under the
interpreter (`make test`), on the GPU when there is one. The state groups' layers are views
whose blocks sit a page apart (`block_stride`). The SSM groups' rows (two 32-byte halves, at
16-byte aligned offsets) take the 16-byte variant, whose alignment hints only a GPU checks;
the conv groups' rows (6 or 16 bytes: halves of 3 or 8) the narrow one. Every strategy, TP 2 ->
4 and 4 -> 2, every page byte compared with independently packed pages."""

from __future__ import annotations

import pytest
import torch
from state_cases import global_states, layout, pages, write_state

from kvxfer import reshard
from kvxfer.testing import POISON

# Runs the Triton kernels: on CUDA, or on CPU under TRITON_INTERPRET=1 (tests/conftest.py).
pytestmark = pytest.mark.interpreter

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("state_len", [3, 8])
@pytest.mark.parametrize(("src_tp", "dst_tp"), [(2, 4), (4, 2)])
@pytest.mark.parametrize("strategy", ["direct", "pack", "unpack", "pack+unpack"])
def test_triton_moves_state_exactly(src_tp, dst_tp, strategy, state_len):
    states = global_states(seed=5, state_len=state_len)
    src_pages = []
    for rank in range(src_tp):
        layer_pages = pages(seed=rank, device=DEVICE)
        write_state(layer_pages, states, src_tp, rank, 3)
        src_pages.append(layer_pages)
    dst_pages = [pages(POISON, device=DEVICE) for _ in range(dst_tp)]
    src_groups = [layout(src_tp, r, state_len).groups(p) for r, p in enumerate(src_pages)]
    dst_groups = [layout(dst_tp, r, state_len).groups(p) for r, p in enumerate(dst_pages)]
    for g in range(len(src_groups[0])):
        reshard(
            [(gs[g].spec, gs[g].caches, [3]) for gs in src_groups],
            [(gs[g].spec, gs[g].caches, [0]) for gs in dst_groups],
            1,
            strategy=strategy,
            backend="triton",
        )
    for rank, got in enumerate(dst_pages):
        want = pages(POISON, device=DEVICE)
        write_state(want, states, dst_tp, rank, 0)
        for layer, (g, w) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(g, w), f"rank {rank} layer {layer}"
