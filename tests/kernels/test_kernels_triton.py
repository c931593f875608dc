"""gather_kv, scatter_kv and remap_kv: Triton against torch and against the layout contract,
bit for bit, outputs poisoned first. Runs on CPU tensors under TRITON_INTERPRET=1."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from kvxfer import allocate_kv_caches
from kvxfer.kernels import (
    KVBuffer,
    copy_cells,
    gather_kv,
    gather_kv_torch,
    remap_kv,
    remap_kv_torch,
    scatter_kv,
    scatter_kv_torch,
    wire_kv_buffer,
)
from kvxfer.reference import random_global_kv, write_rank_cells
from kvxfer.spec import KV_PLACEMENTS
from kvxfer.testing import POISON, bits, side_specs

# Runs the Triton kernels: on CUDA, or on CPU under TRITON_INTERPRET=1 (tests/conftest.py).
pytestmark = pytest.mark.interpreter

DTYPES = ["float16", "bfloat16", "float32"]
GEOMETRIES = [
    pytest.param(layout, placement, False, id=f"{layout}-{placement}")
    for layout, placement in itertools.product(["NHD", "HND"], KV_PLACEMENTS)
] + [pytest.param("NHD", "kv_first", True, id="MLA")]
TOKENS, START = 13, 2  # odd sizes on purpose: partial first and last blocks
# head_dim 5: rows of 10 or 20 bytes, the narrow variant; 8: 16-byte rows, the aligned variant
HEAD_DIMS = [pytest.param(5, id="d5"), pytest.param(8, id="d8")]


def _cache(layout, placement, mla, dtype, block_size=4, heads=3, seed=0, poison=False, head_dim=5):
    """A one-rank cache holding a random request (or only poison), with a scattered table."""
    (spec,) = side_specs(
        1,
        heads=heads,
        block_size=block_size,
        layout=layout,
        placement=placement,
        mla=mla,
        head_dim=head_dim,
        dtype=dtype,
        num_blocks=9,
    )
    caches = allocate_kv_caches(spec)
    ids = np.random.default_rng(seed).permutation(spec.num_blocks)[: -(-TOKENS // block_size)]
    kv = random_global_kv(spec, TOKENS, seed=1)
    for t in caches:
        bits(t).fill_(POISON) if poison else t.copy_(torch.randn(t.shape))
    if not poison:
        write_rank_cells(spec, caches, ids, kv, 0, TOKENS)
    return spec, caches, ids, kv


def _paged(spec, caches, ids, head_offset=0):
    return KVBuffer(
        caches,
        spec.layout,
        spec.kv_placement,
        spec.mla,
        torch.from_numpy(ids),
        0,
        head_offset,
    )


def _poisoned_like(tensors):
    out = [torch.empty_like(t) for t in tensors]
    for t in out:
        bits(t).fill_(POISON)
    return out


def _wire(kv, heads, mla):
    layers = kv.shape[0]
    shape = (
        (layers, TOKENS - START, kv.shape[-1])
        if mla
        else (layers, 2, TOKENS - START, heads, kv.shape[-1])
    )
    wire = torch.empty(shape, dtype=kv.dtype)
    bits(wire).fill_(POISON)
    return wire


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout,placement,mla", GEOMETRIES)
def test_gather_to_wire_matches_contract_and_torch(layout, placement, mla, dtype, head_dim):
    spec, caches, ids, kv = _cache(layout, placement, mla, dtype, head_dim=head_dim)
    n = 1 if mla else 2  # heads [1, 3) of 3
    offset = 0 if mla else 1
    outs = {}
    for name, op in (("triton", gather_kv), ("torch", gather_kv_torch)):
        wire = _wire(kv, n, mla)
        op(_paged(spec, caches, ids, offset), wire_kv_buffer(wire, START, mla), START, TOKENS, n)
        outs[name] = wire
    want = kv[:, START:TOKENS] if mla else kv[:, :, START:TOKENS, offset : offset + n]
    assert torch.equal(bits(outs["triton"]), bits(want.contiguous()))
    assert torch.equal(bits(outs["torch"]), bits(want.contiguous()))


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout,placement,mla", GEOMETRIES)
def test_scatter_from_wire_matches_contract_and_torch(layout, placement, mla, dtype, head_dim):
    spec, poisoned, ids, kv = _cache(layout, placement, mla, dtype, poison=True, head_dim=head_dim)
    heads = spec.heads_per_rank
    wire = (kv[:, START:TOKENS] if mla else kv[:, :, START:TOKENS]).contiguous()
    want = [t.clone() for t in poisoned]
    write_rank_cells(spec, want, ids, kv, START, TOKENS)
    for op in (scatter_kv, scatter_kv_torch):
        caches = [t.clone() for t in poisoned]
        op(wire_kv_buffer(wire, START, mla), _paged(spec, caches, ids), START, TOKENS, heads)
        for got, exp in zip(caches, want, strict=True):
            assert torch.equal(bits(got), bits(exp)), op.__name__


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "src_geometry,dst_geometry",
    [
        pytest.param(a.values, b.values, id=f"{a.id}-to-{b.id}")
        for a, b in itertools.product(GEOMETRIES, GEOMETRIES)
        if (a.id == "MLA") == (b.id == "MLA")
    ],
)
@pytest.mark.parametrize(
    "sizes", [pytest.param((4, 3), id="bs4-bs3"), pytest.param((4, 8), id="bs4-bs8")]
)
def test_remap_between_block_sizes_matches_contract_and_torch(
    src_geometry, dst_geometry, dtype, sizes
):
    # bs 4 -> 3: one-token tiles and 10-byte rows; 4 -> 8: four-token tiles and 16-byte rows
    head_dim = 5 if sizes == (4, 3) else 8
    src_spec, src_caches, src_ids, kv = _cache(
        *src_geometry, dtype, block_size=sizes[0], head_dim=head_dim
    )
    dst_spec, poisoned, dst_ids, _ = _cache(
        *dst_geometry, dtype, block_size=sizes[1], seed=5, poison=True, head_dim=head_dim
    )
    want = [t.clone() for t in poisoned]
    write_rank_cells(dst_spec, want, dst_ids, kv, START, TOKENS)
    heads = src_spec.heads_per_rank
    for op in (remap_kv, remap_kv_torch):
        caches = [t.clone() for t in poisoned]
        op(
            _paged(src_spec, src_caches, src_ids),
            _paged(dst_spec, caches, dst_ids),
            START,
            TOKENS,
            heads,
        )
        for got, exp in zip(caches, want, strict=True):
            assert torch.equal(bits(got), bits(exp)), op.__name__


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout,placement,mla", GEOMETRIES[:4])
def test_head_offsets_on_both_sides_match_torch(layout, placement, mla, dtype):
    src_spec, src_caches, src_ids, _ = _cache(layout, placement, mla, dtype, heads=3)
    dst_spec, poisoned, dst_ids, _ = _cache(
        "HND", "blocks_first", mla, dtype, heads=3, block_size=5, seed=3, poison=True
    )
    results = []
    for op in (remap_kv, remap_kv_torch):
        caches = [t.clone() for t in poisoned]
        op(
            _paged(src_spec, src_caches, src_ids, head_offset=1),
            _paged(dst_spec, caches, dst_ids, head_offset=0),
            START,
            TOKENS,
            2,
        )
        results.append(caches)
    for a, b, untouched in zip(*results, poisoned, strict=True):
        assert torch.equal(bits(a), bits(b))
        assert not torch.equal(bits(a), bits(untouched))  # something was written
        # head 2 of the destination ([blocks, 2, heads, slots, dim]) was not copied: poison
        assert (bits(a[:, :, 2].contiguous()) == POISON).all()


@pytest.mark.parametrize("block_t", [1, 2, 4])
def test_every_tile_size_gives_the_same_bits(block_t):
    spec, caches, ids, kv = _cache("HND", "kv_first", False, "bfloat16")
    wire = _wire(kv, 3, False)
    copy_cells(
        _paged(spec, caches, ids), wire_kv_buffer(wire, START), START, TOKENS, 3, block_t=block_t
    )
    assert torch.equal(bits(wire), bits(kv[:, :, START:TOKENS].contiguous()))


def test_a_tile_that_would_straddle_blocks_is_refused():
    spec, caches, ids, kv = _cache("HND", "kv_first", False, "bfloat16")
    with pytest.raises(ValueError, match=r"block_t: 8 must divide the block sizes \[4\]"):
        copy_cells(
            _paged(spec, caches, ids),
            wire_kv_buffer(_wire(kv, 3, False), START),
            START,
            TOKENS,
            3,
            block_t=8,
        )


def test_gather_refuses_a_dense_cache():
    _, caches, _, kv = _cache("NHD", "kv_first", False, "float16")
    dense = KVBuffer(caches, "NHD", "kv_first", False, None)
    with pytest.raises(ValueError, match="cache: gather reads a paged cache"):
        gather_kv(dense, wire_kv_buffer(_wire(kv, 3, False), START), START, TOKENS, 3)


def test_head_range_outside_the_buffer_is_refused():
    spec, caches, ids, kv = _cache("NHD", "kv_first", False, "float16")
    with pytest.raises(ValueError, match=r"src.head_offset: heads \[2, 5\) exceed"):
        gather_kv(
            _paged(spec, caches, ids, head_offset=2),
            wire_kv_buffer(_wire(kv, 3, False), START),
            START,
            TOKENS,
            3,
        )


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_of_heads_that_straddle_rows(dtype):
    # Heads [1, 3) of 3 in NHD: a token's moved heads are contiguous but do not start on a
    # multiple of 2 heads, so the torch path reads overlapping windows.
    spec, caches, ids, kv = _cache("NHD", "kv_first", False, dtype, heads=3)
    for op in (gather_kv, gather_kv_torch):
        wire = _wire(kv, 2, False)
        op(_paged(spec, caches, ids, head_offset=1), wire_kv_buffer(wire, START), START, TOKENS, 2)
        assert torch.equal(bits(wire), bits(kv[:, :, START:TOKENS, 1:3].contiguous())), op.__name__


def test_k_transposed_is_refused_by_the_kernels_and_moved_by_torch():
    """vLLM CPU attention's layout exists on CPU engines only: the Triton kernels refuse it,
    naming the torch backend, and the torch gather moves it exactly."""
    _, caches, ids, kv = _cache("HND", "k_transposed", False, "float32", head_dim=8)
    cache = KVBuffer(caches, "HND", "k_transposed", block_ids=torch.as_tensor(ids))
    wire = torch.full((len(caches), 2, TOKENS - START, 3, 8), float("nan"))
    with pytest.raises(ValueError, match=r"k_transposed.*backend='torch'"):
        gather_kv(cache, wire_kv_buffer(wire, START), START, TOKENS, 3)
    gather_kv_torch(cache, wire_kv_buffer(wire, START), START, TOKENS, 3)
    assert torch.equal(bits(wire), bits(kv[:, :, START:TOKENS].contiguous()))
