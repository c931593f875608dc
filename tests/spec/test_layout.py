"""`kvxfer.layout`, the layout contract's one module, against docs/design.md's table and against
`kvxfer.reference`, which indexes every layout by hand (the independent oracle)."""

from __future__ import annotations

import inspect
import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer import KVCacheSpec, allocate_kv_caches, reference
from kvxfer.kernels import canonical_kv_view
from kvxfer.layout import (
    KV_PLACEMENTS,
    LAYOUTS,
    canonical_strides,
    canonical_view,
    layer_shape,
)
from kvxfer.plan.paged import BlockGeometry
from kvxfer.reference import random_global_kv, rank_heads, write_rank_cells

B, S, H, D = 3, 5, 2, 4  # blocks, slots (block_size), heads per rank, head_dim: all distinct

# docs/design.md's table (docs/kernels-and-layouts.md's for kv_inner), written out:
# (layout, placement, mla) -> shape.
DESIGN_TABLE = {
    ("NHD", "kv_first", False): (2, B, S, H, D),
    ("HND", "kv_first", False): (2, B, H, S, D),
    ("NHD", "blocks_first", False): (B, 2, S, H, D),
    ("HND", "blocks_first", False): (B, 2, H, S, D),
    ("NHD", "kv_inner", False): (B, S, H, 2 * D),
    ("HND", "kv_inner", False): (B, H, S, 2 * D),
    **{(lay, pl, True): (B, S, D) for lay, pl in itertools.product(LAYOUTS, KV_PLACEMENTS)},
}

# Element strides of (plane, block, slot, head) in a contiguous layer, worked out by hand.
ROW = 2 * D  # a kv_inner row: K then V
EXPECTED_STRIDES = {
    ("NHD", "kv_first", False): (B * S * H * D, S * H * D, H * D, D),
    ("HND", "kv_first", False): (B * H * S * D, H * S * D, D, S * D),
    ("NHD", "blocks_first", False): (S * H * D, 2 * S * H * D, H * D, D),
    ("HND", "blocks_first", False): (H * S * D, 2 * H * S * D, D, S * D),
    ("NHD", "kv_inner", False): (D, S * H * ROW, H * ROW, ROW),
    ("HND", "kv_inner", False): (D, H * S * ROW, ROW, S * ROW),
    **{(lay, pl, True): (0, S * D, D, 0) for lay, pl in itertools.product(LAYOUTS, KV_PLACEMENTS)},
}

COMBOS = [
    pytest.param(lay, pl, mla, id=f"{'MLA-' if mla else ''}{lay}-{pl}")
    for lay, pl, mla in itertools.product(LAYOUTS, KV_PLACEMENTS, (False, True))
]


def _spec(layout: str, placement: str, mla: bool, **kw) -> KVCacheSpec:
    fields = dict(
        num_layers=2,
        num_kv_heads=1 if mla else 2 * H,
        head_dim=D,
        dtype="float16",
        tp_size=1 if mla else 2,
        tp_rank=0 if mla else 1,
        block_size=S,
        num_blocks=B,
        layout=layout,
        kv_placement=placement,
        mla=mla,
    )
    return KVCacheSpec(**{**fields, **kw})


@pytest.mark.parametrize("layout,placement,mla", COMBOS)
def test_shape_is_the_design_table(layout, placement, mla):
    heads = 1 if mla else H
    want = DESIGN_TABLE[layout, placement, mla]
    assert layer_shape(B, S, heads, D, layout, placement, mla) == want
    spec = _spec(layout, placement, mla)
    assert spec.layer_shape == want
    assert BlockGeometry.of_spec(spec).shape == want
    assert [tuple(t.shape) for t in allocate_kv_caches(spec)] == [want, want]


@pytest.mark.parametrize("layout,placement,mla", COMBOS)
def test_canonical_view_of_a_real_tensor(layout, placement, mla):
    tensor = torch.empty(DESIGN_TABLE[layout, placement, mla], dtype=torch.float16)
    view = canonical_view(tensor, layout, placement, mla)
    heads = 1 if mla else H
    assert tuple(view.shape) == (1 if mla else 2, B, S, heads, D)
    assert view.stride() == (*EXPECTED_STRIDES[layout, placement, mla], 1)
    assert view.data_ptr() == tensor.data_ptr()  # a view, not a copy
    # The kernels' name for it is the same view.
    kernels_view = canonical_kv_view(tensor, layout, placement, mla)
    assert kernels_view.shape == view.shape and kernels_view.stride() == view.stride()


@settings(max_examples=200, deadline=None)
@given(
    layout=st.sampled_from(LAYOUTS),
    placement=st.sampled_from(KV_PLACEMENTS),
    mla=st.booleans(),
    sizes=st.tuples(*[st.integers(1, 6)] * 4),
)
def test_integer_strides_are_torchs_strides_of_the_canonical_view(layout, placement, mla, sizes):
    blocks, slots, heads, dim = sizes
    heads = 1 if mla else heads
    shape = layer_shape(blocks, slots, heads, dim, layout, placement, mla)
    view = canonical_view(torch.empty(shape, dtype=torch.uint8), layout, placement, mla)
    strides = canonical_strides(blocks, slots, heads, dim, layout, placement, mla)
    assert view.stride() == (*strides, 1)
    geometry = BlockGeometry(layout, placement, mla, blocks, slots, heads, dim, 1)
    assert geometry.strides == strides and geometry.shape == shape


@pytest.mark.parametrize("layout,placement,mla", COMBOS)
def test_a_cell_written_through_the_view_lands_where_the_reference_puts_it(layout, placement, mla):
    spec = _spec(layout, placement, mla)
    tokens = B * S - 2  # the last block partly filled
    kv = random_global_kv(spec, tokens, seed=3)
    block_ids = np.asarray([2, 0, 1], dtype=np.int64)
    want = [t.view(torch.uint8).fill_(0xA5).view(t.dtype) for t in allocate_kv_caches(spec)]
    got = [t.clone() for t in want]
    write_rank_cells(spec, want, block_ids, kv, 0, tokens)
    heads = rank_heads(spec)
    for layer, tensor in enumerate(got):
        view = canonical_view(tensor, spec.layout, spec.kv_placement, spec.mla)
        for t in range(tokens):
            block, slot = int(block_ids[t // S]), t % S
            if mla:
                view[0, block, slot, 0] = kv[layer, t]
                continue
            for plane, (local, head) in itertools.product((0, 1), enumerate(heads)):
                view[plane, block, slot, local] = kv[layer, plane, t, head]
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))


def test_canonical_view_refuses_wrong_tensors():
    with pytest.raises(ValueError, match="an MLA layer is 3-D"):
        canonical_view(torch.empty(2, 3, 4, 5, 6), "NHD", "kv_first", True)
    with pytest.raises(ValueError, match="5-D"):
        canonical_view(torch.empty(3, 4, 5, 6), "HND", "blocks_first", False)
    with pytest.raises(ValueError, match="even last axis"):
        canonical_view(torch.empty(3, 4, 5, 7), "NHD", "kv_inner", False)
    with pytest.raises(ValueError, match="not in the layout contract"):
        canonical_view(torch.empty(3, 4, 5, 6), "NDH", "kv_first", False)


def test_the_reference_stays_independent_of_the_layout_module():
    """The oracle indexes docs/design.md's table itself: it must not derive from what it checks."""
    source = inspect.getsource(reference)
    assert "kvxfer.layout" not in source and "canonical" not in source
    assert "layer_shape" not in source
