"""Host time of one kernel launch: everything `copy_cells` does on the CPU before the launch.

Run: `make bench` (or `.venv/bin/pytest benchmarks/test_bench_launch.py --benchmark-enable`).
Target (issue 13): under 50 us for a 64-layer cache. Layer tables are built once per cache set
and cached, staging buffers need none, and nothing is copied to the device, so the cost must
not grow with the layers or the tokens: compare the rows.
"""

from __future__ import annotations

import pytest
import torch

from kvxfer.kernels import KVBuffer, StackedLayers, prepare_cell_copy, wire_kv_buffer

HEADS, HEAD_DIM, BLOCK = 8, 128, 16


def _cache(layers: int, tokens: int) -> KVBuffer:
    blocks = tokens // BLOCK
    caches = [torch.empty(2, blocks, BLOCK, HEADS, HEAD_DIM, dtype=torch.bfloat16)] * layers
    # One tensor repeated: the launch reads addresses only, and 64 real layers of 32k tokens
    # would take 8 GiB of this machine's memory.
    return KVBuffer(caches, "NHD", "kv_first", False, torch.randperm(blocks), 0, 0)


def _wire(layers: int, tokens: int) -> KVBuffer:
    flat = torch.empty(layers * 2 * tokens * HEADS * HEAD_DIM, dtype=torch.bfloat16)
    return wire_kv_buffer(flat.view(layers, 2, tokens, HEADS, HEAD_DIM), 0)


def _mirror(layers: int, tokens: int) -> KVBuffer:
    shape = (2, tokens // 64, HEADS, 64, HEAD_DIM)
    flat = torch.empty(layers * 2 * tokens * HEADS * HEAD_DIM, dtype=torch.bfloat16)
    return KVBuffer(StackedLayers(flat, layers, shape), "HND", "kv_first", False, None, 0, 0)


@pytest.mark.parametrize("layers", [32, 64], ids=lambda n: f"{n}layers")
@pytest.mark.parametrize("tokens", [1024, 32768], ids=lambda n: f"{n}tok")
@pytest.mark.parametrize("direction", ["pack", "unpack", "land"])
def test_launch_host_time(benchmark, direction, tokens, layers):
    benchmark.group = f"host time of one launch: {direction}"
    cache, staging = (
        _cache(layers, tokens),
        (_mirror if direction == "land" else _wire)(layers, tokens),
    )
    src, dst = (cache, staging) if direction == "pack" else (staging, cache)
    prepare_cell_copy(src, dst, 0, tokens, HEADS)  # the layer table, built once per cache set
    launch = benchmark(prepare_cell_copy, src, dst, 5, tokens, HEADS)
    assert launch.grid == (-(-tokens // launch.arguments["BLOCK_T"]), layers * 2)
