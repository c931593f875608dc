"""The GPU correctness checks, bit for bit on poisoned memory: `pytest -m cuda`.

1. The cell-copy kernels. For each kernel variant that benchmarks/gpu_kernels.py times
   (head_dim, dtype, heads moved, MLA; its default grid), at 3 layers and 1,037 tokens from
   token 5, for each op (pack, unpack, remaps between blocks of 16 and of 48), every
   implementation the benchmark times must give the torch twin's bytes (`gather_kv_torch`...),
   cells not moved included: the public call (`gather_kv`...), its prepared launch
   (`prepare_cell_copy(...).launch()`), the `index_select` baseline and the per-block
   baseline. The converting variants (a bf16 cache and an fp8 wire: pack quantizes, unpack
   dequantizes, with a scale per layer and plane) check the public call and the prepared
   launch against the torch twin, which converts with torch's float ops (the others only copy
   bits).
2. `kvxfer.reshard` end to end on the device's tensors, Triton backend, each strategy forced
   in turn: the demo's sharding (prefill TP 3, blocks of 16, NHD/kv_first -> decode TP 4,
   blocks of 48, HND/blocks_first; 4 layers, 24 KV heads, head_dim 64) at the demo's 300
   tokens (bf16, and fp8 e4m3) and at 32,768 tokens after a 1,024-token prefix, and an MLA
   cache (576, TP 2 -> TP 4). Destinations are poisoned; every destination byte must equal
   what `kvxfer.reference.write_rank_cells` writes.

On a CUDA device at those sizes; under TRITON_INTERPRET=1 on CPU tensors at toy sizes (the
benchmark's `--tiny` grid; `make unit` runs them so, which keeps these checks from rotting);
skipped otherwise. `KVXFER_REQUIRE_CUDA=1` turns the skip into a failure: scripts/gpu_vllm_e2e.sh
sets it, so that a machine whose GPU torch cannot see fails instead of passing.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pytest
import torch
from helpers import load_benchmark

import kvxfer.kernels as kernels
from kvxfer import STRATEGIES, KVCacheSpec, allocate_kv_caches, reshard
from kvxfer.kernels import KVBuffer, wire_kv_buffer
from kvxfer.kernels.copy_cells import INTERPRETED
from kvxfer.reference import random_global_kv, write_rank_cells
from kvxfer.testing import poison

CUDA = torch.cuda.is_available() and not INTERPRETED
TINY = not CUDA  # the interpreter on CPU tensors: toy sizes
DEVICE = torch.device("cuda" if CUDA else "cpu")
CHECK_REMAP_BLOCK = 48  # the other side of a remap check: another block size too
IMPLS = ("new", "new_prepared", "index_select", "per_block")
MAX_BLOCK_COPIES = 16384  # the benchmark's default --max-block-copies


bench = load_benchmark("gpu_kernels")

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def _a_device() -> None:
    """Run on CUDA or under the interpreter; else skip (fail with KVXFER_REQUIRE_CUDA=1)."""
    if CUDA or INTERPRETED:
        return
    if os.environ.get("KVXFER_REQUIRE_CUDA") == "1":
        pytest.fail("KVXFER_REQUIRE_CUDA=1, but torch.cuda.is_available() is False")
    pytest.skip(
        "needs a CUDA device; make unit runs these under TRITON_INTERPRET=1 at toy sizes on CPU"
    )


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def _snapshot(buf: KVBuffer) -> list[torch.Tensor]:
    return [t.view(torch.uint8).clone() for t in buf.layers]


# ---- 1. the cell-copy kernels ---------------------------------------------------------------

GRID = bench.tiny_grid() if TINY else bench.default_grid()
VARIANTS = list({g.kernel_variant(): g for g in GRID}.values())
LAYERS, TOKENS, START = (2, 37, 3) if TINY else (3, 1037, 5)


def _variant_id(g: Any) -> str:
    return str(bench._label(replace(g, layers=LAYERS, tokens=TOKENS))).replace(" ", "-")


@functools.cache
def cell_copy_cases(index: int) -> dict[str, Any]:
    """The four ops (two for MLA) of one kernel variant, on buffers of random bits."""
    g = replace(VARIANTS[index], layers=LAYERS, tokens=TOKENS)
    gen = torch.Generator(device=DEVICE).manual_seed(index)
    n, off = g.heads_moved, g.head_offset
    nhd = bench.make_cache(g, DEVICE, gen, head_offset=off, spare_blocks=3)
    wire_src = bench.make_wire(g, DEVICE, START)
    bench.fill_random(wire_src, gen)
    wire_dst = wire_kv_buffer(bench.make_wire(g, DEVICE, START), START, g.mla)
    unpack_dst = bench.make_cache(g, DEVICE, gen, head_offset=off, spare_blocks=3)
    scales = bench.conversion_scales(g, DEVICE) if g.wire_dtype else None
    wire_in = wire_kv_buffer(wire_src, START, g.mla)
    cases = {
        "pack": bench._case("pack", nhd, wire_dst, START, TOKENS, n, scales),
        "unpack": bench._case("unpack", wire_in, unpack_dst, START, TOKENS, n, scales),
    }
    if not g.mla:
        hnd = bench.make_cache(
            g, DEVICE, gen, layout="HND", block=CHECK_REMAP_BLOCK, spare_blocks=2
        )
        nhd_dst = bench.make_cache(g, DEVICE, gen, head_offset=off, spare_blocks=3)
        cases["remap_nhd_to_hnd"] = bench._case("remap_nhd_to_hnd", nhd, hnd, START, TOKENS, n)
        cases["remap_hnd_to_nhd"] = bench._case("remap_hnd_to_nhd", hnd, nhd_dst, START, TOKENS, n)
    return cases


def _implementation(name: str, case: Any) -> Callable[[], object]:
    """The launch of one implementation, its host preparation done."""
    if name == "new":
        return lambda: case.public(*case.args)
    if name == "new_prepared":
        if not hasattr(kernels, "prepare_cell_copy"):
            pytest.skip("kvxfer.kernels has no prepare_cell_copy")
        return bench.prepare_new(case)
    if name == "index_select":
        return bench.prepare_index_copy(case)
    return bench.prepare_block_copies(case, MAX_BLOCK_COPIES)


CELL_COPY = [
    pytest.param(index, op, impl, id=f"{_variant_id(g)}-{op}-{impl}")
    for index, g in enumerate(VARIANTS)
    for op in g.ops
    for impl in (IMPLS if g.wire_dtype is None else IMPLS[:2])  # the others copy bits only
]


@pytest.mark.parametrize("index,op,impl", CELL_COPY)
def test_cell_copy_matches_the_torch_twin_bit_for_bit(index, op, impl):
    case = cell_copy_cases(index)[op]
    poison(case.dst.layers)
    case.torch_twin(*case.args)
    _sync()
    want = _snapshot(case.dst)
    try:
        launch = _implementation(impl, case)
    except bench.Skipped as why:
        pytest.skip(str(why))
    poison(case.dst.layers)
    _sync()
    launch()
    _sync()
    got = _snapshot(case.dst)
    for layer, (a, b) in enumerate(zip(got, want, strict=True)):
        if not torch.equal(a, b):
            where = (a != b).nonzero()
            raise AssertionError(
                f"{op} {impl}: layer {layer}: {where.shape[0]} destination bytes differ from "
                f"the torch twin's, first at {where[0].tolist()}"
            )


# ---- 2. kvxfer.reshard end to end --------------------------------------------------------------


@dataclass(frozen=True)
class Side:
    """One engine's sharding and cache layout."""

    tp: int
    block_size: int
    layout: str
    placement: str


@dataclass(frozen=True)
class ReshardCase:
    """One request moved between two shardings of one model."""

    name: str
    tokens: int
    start_token: int
    layers: int
    heads: int
    head_dim: int
    dtype: str
    src: Side
    dst: Side
    mla: bool = False


DEMO_SRC, DEMO_DST = Side(3, 16, "NHD", "kv_first"), Side(4, 48, "HND", "blocks_first")
BF16, FP8 = "bfloat16", "float8_e4m3fn"


def reshard_cases() -> list[ReshardCase]:
    """The demo's sharding at its size and at 32k tokens, fp8, and MLA (toys when TINY)."""
    layers, heads, dim, mla_dim = (2, 12, 8, 64) if TINY else (4, 24, 64, 576)
    demo, long, prefix = (37, 70, 5) if TINY else (300, 32768, 1024)
    kv: dict[str, Any] = dict(layers=layers, heads=heads, head_dim=dim, src=DEMO_SRC, dst=DEMO_DST)
    mla: dict[str, Any] = dict(layers=layers, heads=1, head_dim=mla_dim, mla=True)
    return [
        ReshardCase("demo", demo, 0, dtype=BF16, **kv),
        # Decode already holds a prefix: slots before `prefix` must keep their poison.
        ReshardCase(f"{long} tokens", long, prefix, dtype=BF16, **kv),
        ReshardCase("demo fp8", demo, 0, dtype=FP8, **kv),
        ReshardCase(
            "demo MLA",
            demo,
            5,
            dtype=BF16,
            src=Side(2, 16, "NHD", "kv_first"),
            dst=Side(4, 48, "NHD", "kv_first"),
            **mla,
        ),
    ]


CASES = {case.name: case for case in reshard_cases()}


def _specs(case: ReshardCase, side: Side) -> list[KVCacheSpec]:
    needed = -(-case.tokens // side.block_size)
    return KVCacheSpec(
        num_layers=case.layers,
        num_kv_heads=case.heads,
        head_dim=case.head_dim,
        dtype=case.dtype,  # type: ignore[arg-type]
        tp_size=side.tp,
        tp_rank=0,
        block_size=side.block_size,
        num_blocks=needed + 3,
        layout=side.layout,  # type: ignore[arg-type]
        kv_placement=side.placement,  # type: ignore[arg-type]
        mla=case.mla,
    ).engine_ranks()


def _global_kv(spec: KVCacheSpec, tokens: int) -> torch.Tensor:
    shape = (spec.num_layers, tokens, spec.head_dim)
    if not spec.mla:
        shape = (spec.num_layers, 2, tokens, spec.num_kv_heads, spec.head_dim)
    if math.prod(shape) <= 1 << 24:
        return random_global_kv(spec, tokens, seed=1, device=DEVICE)
    # randn of hundreds of millions of elements on the host takes seconds: random bits on the
    # device serve the same purpose (every cell distinct with near certainty).
    kv = torch.empty(shape, dtype=spec.torch_dtype, device=DEVICE)
    bench.fill_random(kv, torch.Generator(device=DEVICE).manual_seed(1))
    return kv


@functools.cache
def reshard_ranks(name: str) -> tuple[list[Any], list[Any], list[list[torch.Tensor]]]:
    """Sources holding the request amid noise, destinations, and the bytes each destination
    layer must hold afterwards (from `kvxfer.reference`)."""
    case = CASES[name]
    src_specs, dst_specs = _specs(case, case.src), _specs(case, case.dst)
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    rng = np.random.default_rng(0)
    kv = bench.int_view(_global_kv(src_specs[0], case.tokens))
    src, dst, expected = [], [], []
    for spec in src_specs:
        caches = allocate_kv_caches(spec, DEVICE)
        for t in caches:
            bench.fill_random(t, gen)
        ids = rng.permutation(spec.num_blocks)[: -(-case.tokens // spec.block_size)]
        write_rank_cells(spec, [bench.int_view(t) for t in caches], ids, kv, 0, case.tokens)
        src.append((spec, caches, ids))
    for spec in dst_specs:
        caches = allocate_kv_caches(spec, DEVICE)
        poison(caches)
        ids = rng.permutation(spec.num_blocks)[: -(-case.tokens // spec.block_size)]
        want = [t.clone() for t in caches]
        views = [bench.int_view(t) for t in want]
        write_rank_cells(spec, views, ids, kv, case.start_token, case.tokens)
        dst.append((spec, caches, ids))
        expected.append([t.view(torch.uint8) for t in want])
    return src, dst, expected


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", list(CASES))
def test_reshard_on_the_device_is_bit_exact(name, strategy):
    case = CASES[name]
    try:
        src, dst, expected = reshard_ranks(name)
    except ValueError as exc:
        if case.dtype == FP8 and "KVCacheSpec.dtype" in str(exc):
            pytest.skip(f"KVCacheSpec rejects dtype {case.dtype!r}: {exc}")
        raise
    for _, caches, _ in dst:
        poison(caches)
    _sync()
    result = reshard(src, dst, case.tokens, case.start_token, strategy=strategy, backend="triton")
    _sync()
    assert result.nbytes > 0 and result.pairs
    bad = [
        f"rank {spec.tp_rank} layer {layer}"
        for (spec, caches, _), want in zip(dst, expected, strict=True)
        for layer, (got, exp) in enumerate(zip(caches, want, strict=True))
        if not torch.equal(got.view(torch.uint8), exp)
    ]
    assert not bad, f"destination bytes differ from kvxfer.reference: {bad[:4]}"
