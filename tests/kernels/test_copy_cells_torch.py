"""The torch cell copy (the CPU backend) keeps each cache's row views between copies: the views
must follow the tensors they were made from, never outlive them, and never keep them alive.

Each test checks the bytes against `kvxfer.reference` on poisoned memory."""

from __future__ import annotations

import gc
import importlib

import numpy as np
import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from kvxfer import allocate_kv_caches
from kvxfer.kernels import KVBuffer, gather_kv_torch, scatter_kv_torch, wire_kv_buffer
from kvxfer.layout import layer_shape
from kvxfer.reference import random_global_kv, write_rank_cells
from kvxfer.testing import POISON, bits, side_specs

TOKENS = 11  # a partial last block


def _spec(layout: str = "HND", num_blocks: int = 6):
    (spec,) = side_specs(
        1, heads=2, block_size=4, layout=layout, head_dim=8, dtype="bfloat16",
        num_blocks=num_blocks,
    )  # fmt: skip
    return spec


def _poisoned(spec):
    caches = allocate_kv_caches(spec)
    for t in caches:
        bits(t).fill_(POISON)
    return caches


def _scatter(spec, caches, ids, wire):
    paged = KVBuffer(caches, spec.layout, spec.kv_placement, spec.mla, torch.from_numpy(ids), 0, 0)
    scatter_kv_torch(wire_kv_buffer(wire, 0), paged, 0, TOKENS, spec.heads_per_rank)


def _expected(spec, ids, kv):
    want = _poisoned(spec)
    write_rank_cells(spec, want, ids, kv, 0, TOKENS)
    return want


def _assert_holds(caches, want):
    for layer, (got, exp) in enumerate(zip(caches, want, strict=True)):
        assert torch.equal(bits(got), bits(exp)), f"layer {layer} differs from the reference"


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_a_cache_allocated_where_a_freed_one_was_gets_the_bytes(layout):
    """Caches freed and allocated again, round after round (their tensors often take the
    freed ones' ids and addresses): each round's copy lands in that round's cache, whole."""
    spec = _spec(layout)
    ids = np.array([4, 1, 3], dtype=np.int64)
    for seed in range(6):
        kv = random_global_kv(spec, TOKENS, seed=seed)
        caches = _poisoned(spec)
        _scatter(spec, caches, ids, kv.contiguous())
        _assert_holds(caches, _expected(spec, ids, kv))
        del caches


def test_a_layer_replaced_behind_the_same_first_layer_is_written():
    """Two copies through layer lists that share layer 0 and differ after it: the second
    copy writes the second list's layers, not the first's."""
    spec = _spec()
    ids = np.array([0, 5, 2], dtype=np.int64)
    kv = random_global_kv(spec, TOKENS, seed=3)
    first = _poisoned(spec)
    _scatter(spec, first, ids, kv.contiguous())
    second = [first[0], *_poisoned(spec)[1:]]
    bits(second[0]).fill_(POISON)
    _scatter(spec, second, ids, kv.contiguous())
    _assert_holds(second, _expected(spec, ids, kv))


def test_a_copy_keeps_no_cache_alive():
    """Once the engine drops its cache, its memory goes: the row views kept for it go too."""
    spec = _spec()
    ids = np.array([1, 2, 3], dtype=np.int64)
    caches = _poisoned(spec)
    wire = torch.empty((spec.num_layers, 2, TOKENS, spec.heads_per_rank, spec.head_dim),
                       dtype=torch.bfloat16)  # fmt: skip
    paged = KVBuffer(caches, spec.layout, spec.kv_placement, spec.mla, torch.from_numpy(ids))
    gather_kv_torch(paged, wire_kv_buffer(wire, 0), 0, TOKENS, spec.heads_per_rank)
    _scatter(spec, caches, ids, wire)
    storages = [StorageWeakRef(t.untyped_storage()) for t in caches]
    del caches, paged
    gc.collect()
    assert all(s.expired() for s in storages)


@pytest.mark.parametrize("gather_by", ["numpy", "torch"])
@pytest.mark.parametrize("src_layout,dst_layout", [("NHD", "HND"), ("HND", "NHD")])
def test_a_pack_then_unpack_lands_every_cell_whichever_library_gathers(
    monkeypatch, gather_by, src_layout, dst_layout
):
    """A pack into the wire (numpy gathers small layers, torch large ones) then an unpack into
    a poisoned cache of another layout: that cache holds what the reference writes."""
    limit = 1 << 30 if gather_by == "numpy" else 0
    module = importlib.import_module("kvxfer.kernels.copy_cells_torch")  # not the function
    monkeypatch.setattr(module, "_HOST_GATHER_BYTES", limit)
    src_spec, dst_spec = _spec(src_layout), _spec(dst_layout)
    src_ids = np.array([5, 0, 2], dtype=np.int64)
    dst_ids = np.array([3, 4, 1], dtype=np.int64)
    kv = random_global_kv(src_spec, TOKENS, seed=7)
    src = _poisoned(src_spec)
    write_rank_cells(src_spec, src, src_ids, kv, 0, TOKENS)
    wire = torch.empty((src_spec.num_layers, 2, TOKENS, src_spec.heads_per_rank,
                        src_spec.head_dim), dtype=torch.bfloat16)  # fmt: skip
    bits(wire).fill_(POISON)
    paged = KVBuffer(src, src_layout, "kv_first", False, torch.from_numpy(src_ids))
    gather_kv_torch(paged, wire_kv_buffer(wire, 0), 0, TOKENS, src_spec.heads_per_rank)
    dst = _poisoned(dst_spec)
    _scatter(dst_spec, dst, dst_ids, wire)
    _assert_holds(dst, _expected(dst_spec, dst_ids, kv))


def test_a_cache_of_mismatched_or_no_layers_is_refused_naming_it():
    """A cache's layers are checked once per set of layer tensors, not on every copy: a set
    with a layer of another dtype, or none, is still refused, naming the argument, and nothing
    is written."""
    spec = _spec()
    ids = np.array([1, 2, 3], dtype=np.int64)
    kv = random_global_kv(spec, TOKENS, seed=5)
    caches = _poisoned(spec)
    caches[1] = caches[1].to(torch.float16)
    before = [bits(t).clone() for t in caches]
    with pytest.raises(ValueError, match=r"dst\.layers\[1\]: shape, dtype and device"):
        _scatter(spec, caches, ids, kv.contiguous())
    assert all(torch.equal(bits(t), b) for t, b in zip(caches, before, strict=True))
    with pytest.raises(ValueError, match=r"dst\.layers: empty"):
        empty = KVBuffer([], "HND", "kv_first", False, torch.from_numpy(ids))
        scatter_kv_torch(wire_kv_buffer(kv.contiguous(), 0), empty, 0, TOKENS, 2)


@pytest.mark.parametrize("merge", [True, False], ids=["runs-merged", "row-by-row"])
def test_a_blocks_consecutive_rows_move_as_one_row_bit_exact(monkeypatch, merge):
    """Between a dense wire and a cache whose blocks hold consecutive rows (NHD, whole blocks),
    a large copy moves each aligned run of rows as one row: the cache then holds what the
    reference writes, the poison elsewhere, whether runs are merged or not."""
    module = importlib.import_module("kvxfer.kernels.copy_cells_torch")  # not the function
    monkeypatch.setattr(module, "_COARSE_BYTES", 0 if merge else 1 << 60)
    merged: list[bool] = []
    real = module._coarse

    def recording(reads, writes, grain):
        out = real(reads, writes, grain)
        merged.append(out is not None and grain > 1)
        return out

    monkeypatch.setattr(module, "_coarse", recording)
    tokens = 12  # three whole blocks of 4
    spec = _spec("NHD")
    src_ids = np.array([5, 0, 2], dtype=np.int64)
    dst_ids = np.array([3, 4, 1], dtype=np.int64)
    kv = random_global_kv(spec, tokens, seed=11)
    src = _poisoned(spec)
    write_rank_cells(spec, src, src_ids, kv, 0, tokens)
    wire = torch.empty((spec.num_layers, 2, tokens, spec.heads_per_rank, spec.head_dim),
                       dtype=torch.bfloat16)  # fmt: skip
    bits(wire).fill_(POISON)
    heads = spec.heads_per_rank
    paged = KVBuffer(src, "NHD", "kv_first", False, torch.from_numpy(src_ids))
    gather_kv_torch(paged, wire_kv_buffer(wire, 0), 0, tokens, heads)
    dst = _poisoned(spec)
    into = KVBuffer(dst, "NHD", "kv_first", False, torch.from_numpy(dst_ids), 0, 0)
    scatter_kv_torch(wire_kv_buffer(wire, 0), into, 0, tokens, heads)
    want = _poisoned(spec)
    write_rank_cells(spec, want, dst_ids, kv, 0, tokens)
    _assert_holds(dst, want)
    assert merged == ([True, True] if merge else [])  # the pack and the unpack


def _wire(spec, tokens: int, heads: int) -> torch.Tensor:
    wire = torch.empty((spec.num_layers, 2, tokens, heads, spec.head_dim), dtype=torch.bfloat16)
    bits(wire).fill_(POISON)
    return wire


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_a_short_copys_plan_serves_every_block_table_of_its_shape(monkeypatch, layout):
    """A short copy's rows are planned once per shape and cache (block ids 0, plus each
    request's own): round after round of new block tables on the same caches, the pack and
    the unpack are planned once each and the cache holds what the reference writes."""
    module = importlib.import_module("kvxfer.kernels.copy_cells_torch")  # not the function
    made: list[bool] = []
    real = module._make_short_copy

    def recording(*args):
        plan = real(*args)
        made.append(plan is not None)
        return plan

    monkeypatch.setattr(module, "_make_short_copy", recording)
    spec = _spec(layout, num_blocks=8)
    src, dst = _poisoned(spec), _poisoned(spec)
    heads = spec.heads_per_rank
    rng = np.random.default_rng(5)
    for seed in range(4):
        src_ids, dst_ids = rng.permutation(8)[:3], rng.permutation(8)[:3]
        kv = random_global_kv(spec, TOKENS, seed=seed)
        write_rank_cells(spec, src, src_ids, kv, 0, TOKENS)
        wire = _wire(spec, TOKENS, heads)
        paged = KVBuffer(src, layout, "kv_first", False, torch.from_numpy(src_ids))
        gather_kv_torch(paged, wire_kv_buffer(wire, 0), 0, TOKENS, heads)
        for t in dst:
            bits(t).fill_(POISON)
        _scatter(spec, dst, dst_ids, wire)
        _assert_holds(dst, _expected(spec, dst_ids, kv))
    assert made == [True, True]  # the pack's plan and the unpack's, then reused


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("heads,head_offset", [(1, 1), (2, 0)], ids=["one-head", "both"])
@pytest.mark.parametrize("start", [0, 5], ids=["from-0", "mid-block"])
def test_a_short_copy_moves_what_the_general_path_moves(
    monkeypatch, layout, heads, head_offset, start
):
    """A planned short copy and the general path, on the same poisoned buffers, some heads
    or all, from a block's start or its middle: the same bytes in the wire and the cache."""
    module = importlib.import_module("kvxfer.kernels.copy_cells_torch")  # not the function
    spec = _spec(layout, num_blocks=8)
    kv = random_global_kv(spec, TOKENS, seed=9)
    src_ids = np.array([6, 1, 4], dtype=np.int64)
    dst_ids = np.array([2, 7, 0], dtype=np.int64)
    real, made = module._make_short_copy, []
    monkeypatch.setattr(module, "_make_short_copy", lambda *a: made.append(real(*a)) or made[-1])
    outcomes = []
    for planned in (True, False):
        if not planned:
            monkeypatch.setattr(module, "_short_copy_plan", lambda *args: None)
        src, dst = _poisoned(spec), _poisoned(spec)
        write_rank_cells(spec, src, src_ids, kv, 0, TOKENS)
        wire = _wire(spec, TOKENS - start, heads)
        paged = KVBuffer(src, layout, "kv_first", False, torch.from_numpy(src_ids), 0, head_offset)
        gather_kv_torch(paged, wire_kv_buffer(wire, start), start, TOKENS, heads)
        into = KVBuffer(dst, layout, "kv_first", False, torch.from_numpy(dst_ids), 0, head_offset)
        scatter_kv_torch(wire_kv_buffer(wire, start), into, start, TOKENS, heads)
        outcomes.append([bits(wire).clone(), *(bits(t).clone() for t in dst)])
    assert len(made) == 2 and None not in made  # the planned run's pack and unpack were short
    planned_run, general_run = outcomes
    for got, want in zip(planned_run, general_run, strict=True):
        assert torch.equal(got, want)
    assert not torch.equal(planned_run[1], bits(_poisoned(spec)[0]))  # something moved


@pytest.mark.parametrize(
    "layout,mla", [("NHD", False), ("HND", False), ("NHD", True)], ids=["NHD", "HND", "MLA"]
)
def test_short_copies_of_many_shapes_on_one_cache_move_what_the_general_path_moves(
    monkeypatch, layout, mla
):
    """One cache, forty copies of random shapes (heads and their offset, the cache's token
    shift, where the range starts in a block, its length, gather or scatter, block ids
    repeated): each planned copy, with the plans of every earlier shape kept on that cache,
    leaves the wire and the cache as the general path leaves a copy of them."""
    module = importlib.import_module("kvxfer.kernels.copy_cells_torch")  # not the function
    real_plan, real_run = module._short_copy_plan, module._run_short_copy
    planned: list[bool] = []
    monkeypatch.setattr(module, "_run_short_copy", lambda *a: planned.append(True) or real_run(*a))
    heads, head_dim, block_size, blocks, layers = (1 if mla else 3), 8, 4, 8, 2
    shape = layer_shape(blocks, block_size, heads, head_dim, layout, "kv_first", mla)
    gen = torch.Generator().manual_seed(17)

    def random_bits(size):
        return torch.randint(-(1 << 15), 1 << 15, size, dtype=torch.int16, generator=gen)

    caches = [random_bits(shape).view(torch.bfloat16) for _ in range(layers)]
    rng = np.random.default_rng(17)
    for _ in range(40):
        num_heads = int(rng.integers(1, heads + 1))
        offset, shift = int(rng.integers(0, heads - num_heads + 1)), int(rng.integers(0, 6))
        start = shift + int(rng.integers(0, 2 * block_size))
        end = start + int(rng.integers(1, 3 * block_size))
        ids = torch.from_numpy(rng.integers(0, blocks, (end - 1 - shift) // block_size + 1))
        wire_shape = (layers, end - start, head_dim) if mla else (
            layers, 2, end - start, num_heads, head_dim)  # fmt: skip
        wire = random_bits(wire_shape).view(torch.bfloat16)
        gather = bool(rng.integers(0, 2))
        before = [t.clone() for t in caches]
        outcomes = []
        # the planned path on the cache itself (its plans kept), the general one on a copy
        for plan, layer_set in ((real_plan, caches), (lambda *a: None, before)):
            monkeypatch.setattr(module, "_short_copy_plan", plan)
            moved = wire.clone()
            cache = KVBuffer(layer_set, layout, "kv_first", mla, ids, shift, offset)
            staging = wire_kv_buffer(moved, start, mla)
            src, dst = (cache, staging) if gather else (staging, cache)
            copy = gather_kv_torch if gather else scatter_kv_torch
            copy(src, dst, start, end, num_heads)
            outcomes.append([bits(moved), *(bits(t) for t in layer_set)])
        for got, want in zip(*outcomes, strict=True):
            assert torch.equal(got, want)
    assert len(planned) >= 20  # most copies took the planned path


def test_a_dense_buffer_on_the_caches_own_layers_is_planned_apart_both_ways():
    """A gather into a dense buffer made of the cache's own layer tensors, then a scatter back
    (both sides then share one `_Side`): each direction has its own plan, and the scatter
    moves the gathered bytes back where the general path would."""
    layers = [torch.arange(512.0).view(4, 2, 4, 2, 8) + i for i in range(2)]  # NHD, blocks_first
    paged = KVBuffer(layers, "NHD", "blocks_first", False, torch.tensor([2]))
    dense = KVBuffer(layers, "NHD", "blocks_first", False, None)
    want = [t.clone() for t in layers]
    want_paged = KVBuffer(want, "NHD", "blocks_first", False, torch.tensor([2]))
    want_dense = KVBuffer(want, "NHD", "blocks_first", False, None)
    module = importlib.import_module("kvxfer.kernels.copy_cells_torch")
    module.copy_cells_torch(paged, dense, 0, 4, 2)
    module.copy_cells_torch(dense, paged, 0, 4, 2)
    for src, dst in ((want_paged, want_dense), (want_dense, want_paged)):
        module.copy_elements_torch(src, dst, torch.arange(4), 2, None)
    for got, exp in zip(layers, want, strict=True):
        assert torch.equal(got, exp)


def test_a_short_copy_refuses_block_ids_outside_the_cache_naming_them():
    """A block id past the cache's blocks, or a negative one (numpy would wrap it), is refused
    before any byte moves, naming the ids."""
    spec = _spec("HND", num_blocks=6)
    caches = _poisoned(spec)
    wire = _wire(spec, TOKENS, spec.heads_per_rank)
    for ids in ([0, 6, 1], [0, -1, 1]):
        paged = KVBuffer(caches, "HND", "kv_first", False, torch.tensor(ids))
        with pytest.raises(ValueError, match=r"outside the cache's 6 blocks") as raised:
            scatter_kv_torch(wire_kv_buffer(wire, 0), paged, 0, TOKENS, spec.heads_per_rank)
        assert str(ids[1]) in str(raised.value)
    assert all(bits(t).eq(POISON).all() for t in caches)
