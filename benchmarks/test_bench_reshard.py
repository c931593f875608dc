"""CPU reshard throughput against a plain `copy_` of the same bytes, in the same run.

Run: `make bench`. Geometry: 8 layers, 8 KV heads, head_dim 128, bf16; prefill TP 2, blocks of
16, NHD -> decode TP 4, blocks of 64, HND; scattered block tables.
"""

from __future__ import annotations

import pytest
import torch
from scenarios import filled_side, request_kv, specs

from kvxfer import reshard
from kvxfer.reference import write_rank_cells

LAYERS = 8


def _sides(num_tokens):
    src_specs = specs(2, num_tokens=num_tokens, block_size=16, layout="NHD", num_layers=LAYERS)
    dst_specs = specs(4, num_tokens=num_tokens, block_size=64, layout="HND", num_layers=LAYERS)
    kv = request_kv(src_specs[0], num_tokens)
    src = filled_side(src_specs, num_tokens, kv, seed=1)
    dst = filled_side(dst_specs, num_tokens, None, seed=2)
    return src, dst, kv


def _assert_exact(dst, kv, num_tokens):
    """Every decode rank holds what the reference writes there, and nothing else changed."""
    for spec, caches, ids in dst:
        want = [torch.empty_like(c) for c in caches]
        for t in want:
            t.view(torch.uint8).fill_(0xA5)  # `filled_side`'s poison
        write_rank_cells(spec, want, ids, kv, 0, num_tokens)
        for got, expected in zip(caches, want, strict=True):
            assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8)), spec.rank_name


@pytest.mark.parametrize("num_tokens", [1024, 4096], ids=lambda t: f"{t}tok")
@pytest.mark.parametrize("strategy", [None, "pack", "direct"], ids=lambda s: s or "auto")
def test_reshard_cpu(benchmark, num_tokens, strategy):
    benchmark.group = f"reshard {num_tokens} tokens"
    src, dst, kv = _sides(num_tokens)
    result = benchmark(reshard, src, dst, num_tokens, strategy=strategy, backend="torch")
    benchmark.extra_info["bytes"] = result.nbytes
    benchmark.extra_info["segments"] = result.num_segments
    _assert_exact(dst, kv, num_tokens)


@pytest.mark.parametrize("num_tokens", [1024, 4096], ids=lambda t: f"{t}tok")
def test_plain_copy_of_same_bytes(benchmark, num_tokens):
    benchmark.group = f"reshard {num_tokens} tokens"
    nbytes = LAYERS * 2 * num_tokens * 8 * 128 * 2
    src = torch.randn(nbytes // 2, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    benchmark(dst.copy_, src)
    benchmark.extra_info["bytes"] = nbytes
    assert torch.equal(dst, src)
