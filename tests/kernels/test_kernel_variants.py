"""Compile once: the warm-up at handshake and every request share one Triton variant.

Triton's cache key is computed for each launch exactly as its launcher does
(`benchmarks/kernel_codegen.py: specialization_key`), on CPU tensors: no GPU or interpreter is
needed, only the host's launch preparation, which is what decides the variant.
"""

from __future__ import annotations

import importlib.util
import itertools
import sys

import numpy as np
import pytest
import torch
from helpers import REPO

from kvxfer import allocate_kv_caches
from kvxfer.execute import kv_buffer, scratch_copy
from kvxfer.kernels import KVBuffer, prepare_cell_copy, wire_kv_buffer
from kvxfer.plan import plan_pairs
from kvxfer.plan.program import STRATEGIES, PairChunk
from kvxfer.plan.sizing import chunk_bounds
from kvxfer.testing import side_specs

_SCRIPT = REPO / "benchmarks" / "kernel_codegen.py"
_spec = importlib.util.spec_from_file_location("kernel_codegen", _SCRIPT)
assert _spec is not None and _spec.loader is not None
codegen = importlib.util.module_from_spec(_spec)
sys.modules["kernel_codegen"] = codegen  # dataclasses look their module up
_spec.loader.exec_module(codegen)

BLOCKS = 64


def _launch(copy, src_tensors, dst_tensors):
    src, dst = kv_buffer(copy.src, src_tensors), kv_buffer(copy.dst, dst_tensors)
    return prepare_cell_copy(src, dst, copy.token_start, copy.token_end, copy.num_heads)


def _tensors(view, caches, pool: torch.Tensor, offset_bytes: int) -> list[torch.Tensor]:
    """A cache's layers, or a staging slot at `offset_bytes` inside a shared pool (as the
    connectors hand slots out)."""
    if view.region == "cache":
        return caches
    start = offset_bytes // pool.element_size()
    return [pool[start : start + len(caches) * view.geometry.layer_elements]]


NHD16, HND48 = dict(layout="NHD", block_size=16), dict(layout="HND", block_size=48)
HND64 = dict(layout="HND", block_size=64)
NHD16_BLOCKS_FIRST = dict(layout="NHD", block_size=16, placement="blocks_first")
KV_INNER16, NHD32 = dict(NHD16, placement="kv_inner"), dict(layout="NHD", block_size=32)
MLA64, MLA16 = dict(mla=True, block_size=64), dict(mla=True, block_size=16)
FP8 = dict(dtype="float8_e4m3fn")
GEOMETRIES = [
    pytest.param(NHD16, HND48, id="NHD16-HND48"),
    pytest.param(HND64, NHD16_BLOCKS_FIRST, id="HND64-NHD16bf"),
    pytest.param(KV_INNER16, NHD32, id="kvinner16-NHD32"),
    pytest.param(MLA64, MLA16, id="MLA64-MLA16"),
    pytest.param(dict(NHD16, **FP8), dict(HND48, **FP8), id="fp8-NHD16-HND48"),
]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("src_geometry,dst_geometry", GEOMETRIES)
def test_warm_up_and_requests_share_one_variant(src_geometry, dst_geometry, strategy):
    heads = 1 if src_geometry.get("mla") else 8
    src_side = side_specs(2, heads=heads, head_dim=128, num_blocks=BLOCKS, **src_geometry)
    dst_side = side_specs(4, heads=heads, head_dim=128, num_blocks=BLOCKS, **dst_geometry)
    pair = plan_pairs(src_side, dst_side, reference_tokens=512)[-1]
    src_spec, dst_spec = src_side[pair.src_rank], dst_side[pair.dst_rank]
    src_caches, dst_caches = allocate_kv_caches(src_spec), allocate_kv_caches(dst_spec)
    pool = torch.empty(8 << 20, dtype=src_caches[0].dtype)
    rng = np.random.default_rng(0)
    # Requests of varied lengths, starts (a decode that holds a prefix), chunkings, block
    # tables and staging slots: none of it may pick another variant.
    requests = [(0, 1), (0, 17), (5, 300), (33, 1000), (1000, 1001), (64, 1024)]
    chunkings = [None, 48, 256]
    keys: dict[str, set[str]] = {"pack": set(), "unpack": set()}
    warm: dict[str, str] = {}
    # The connectors' warm-up copies: one token over block 0 (producer/packing.py,
    # consumer/copies.py).
    one_token = PairChunk(pair.route, strategy, src_spec, dst_spec, 0, 1, landing=True)
    block_0 = np.zeros(1, np.int64)
    handshake = {"pack": one_token.pack(block_0), "unpack": one_token.unpack(block_0)}
    for (start, end), chunk in itertools.product(requests, chunkings):
        src_ids = rng.permutation(BLOCKS)[: -(-end // src_spec.block_size)].astype(np.int64)
        dst_ids = rng.permutation(BLOCKS)[: -(-end // dst_spec.block_size)].astype(np.int64)
        bounds = chunk_bounds(start, end, chunk) if chunk else [(start, end)]
        for (lo, hi), slot in zip(bounds, itertools.cycle([0, 1 << 20, 3 << 20]), strict=False):
            piece = PairChunk(pair.route, strategy, src_spec, dst_spec, lo, hi, landing=True)
            copies = {
                "pack": piece.pack(piece.source_blocks(src_ids)),
                "unpack": piece.unpack(piece.destination_blocks(dst_ids)),
            }
            for side, copy in copies.items():
                if copy is None:
                    continue
                caches = src_caches if side == "pack" else dst_caches
                launch = _launch(
                    copy,
                    _tensors(copy.src, caches, pool, slot),
                    _tensors(copy.dst, caches, pool, slot),
                )
                keys[side].add(codegen.specialization_key(launch))
                if side not in warm:  # what the connectors compile at the handshake
                    first = handshake[side]
                    assert first is not None
                    one, src, dst = scratch_copy(first, caches[0].dtype, caches[0].device)
                    warm[side] = codegen.specialization_key(_launch(one, src, dst))
    for side, seen in keys.items():
        if not seen:
            continue
        assert seen == {warm[side]}, f"{side}: {len(seen)} variants, warm-up compiled another"


def _nhd_cache(offset_elements: int) -> KVBuffer:
    """Two NHD layers of 8 heads x 128 bf16, starting `offset_elements` into their storage."""
    layers = []
    for _ in range(2):
        storage = torch.empty(2 * 4 * 16 * 8 * 128 + offset_elements, dtype=torch.bfloat16)
        layers.append(storage[offset_elements:].view(2, 4, 16, 8, 128))
    return KVBuffer(layers, "NHD", "kv_first", False, torch.arange(4), 0, 0)


def _wire(tokens: int, offset_elements: int = 0) -> KVBuffer:
    storage = torch.empty(2 * 2 * tokens * 8 * 128 + offset_elements, dtype=torch.bfloat16)
    return wire_kv_buffer(storage[offset_elements:].view(2, 2, tokens, 8, 128), 0)


def test_aligned_buffers_get_the_16_byte_variant():
    launch = prepare_cell_copy(_nhd_cache(0), _wire(64), 0, 64, 8)
    assert launch.arguments["ALIGNED"] is True
    assert launch.arguments["src_ptr"].dtype == torch.int32  # 4-byte words, 4 per access


@pytest.mark.parametrize("side", ["cache", "wire"])
def test_a_misaligned_buffer_gets_the_narrow_variant(side):
    # One bf16 element in: 2-byte aligned, so 16-byte accesses would fault on a GPU.
    cache = _nhd_cache(1 if side == "cache" else 0)
    wire = _wire(64, 1 if side == "wire" else 0)
    launch = prepare_cell_copy(cache, wire, 0, 64, 8)
    assert launch.arguments["ALIGNED"] is False
    assert launch.arguments["src_ptr"].dtype == torch.int16
    aligned = prepare_cell_copy(_nhd_cache(0), _wire(64), 0, 64, 8)
    assert codegen.specialization_key(launch) != codegen.specialization_key(aligned)


def test_rows_of_8_bytes_get_8_byte_words_without_the_hint():
    layers = [torch.empty(2, 4, 16, 8, 4, dtype=torch.bfloat16) for _ in range(2)]
    cache = KVBuffer(layers, "NHD", "kv_first", False, torch.arange(4), 0, 0)
    wire = wire_kv_buffer(torch.empty(2, 2, 64, 8, 4, dtype=torch.bfloat16), 0)
    launch = prepare_cell_copy(cache, wire, 0, 64, 8)
    assert launch.arguments["ALIGNED"] is False
    assert launch.arguments["src_ptr"].dtype == torch.int64


def test_layer_tables_are_built_once_per_cache_set():
    cache = _nhd_cache(0)
    first = prepare_cell_copy(cache, _wire(64), 0, 64, 8).arguments["src_layers_ptr"]
    again = prepare_cell_copy(cache, _wire(32), 3, 35, 8).arguments["src_layers_ptr"]
    assert again is first
    assert first.tolist() == [t.data_ptr() for t in cache.layers]
