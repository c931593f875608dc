"""Planning cost per request: transfer programs for every rank pair, from block tables.

Run: `make bench` (or `.venv/bin/pytest benchmarks/test_bench_plan.py --benchmark-enable`).
The cost must grow linearly with tokens: compare the rows of one rank count.
"""

from __future__ import annotations

import pytest
from scenarios import scattered_blocks, specs

from kvxfer.plan import build_program, plan_pairs


def plan_request(src, dst, pairs, num_tokens, src_ids, dst_ids):
    return [
        build_program(
            p.route,
            p.strategy,
            src[p.src_rank],
            dst[p.dst_rank],
            src_ids[p.src_rank],
            dst_ids[p.dst_rank],
            0,
            num_tokens,
        )
        for p in pairs
    ]


@pytest.mark.parametrize("ranks", [1, 2, 4, 8], ids=lambda r: f"TP{r}to{r}")
@pytest.mark.parametrize("num_tokens", [1024, 4096, 16384, 32768], ids=lambda t: f"{t}tok")
def test_plan_request(benchmark, num_tokens, ranks):
    benchmark.group = f"plan TP {ranks}->{ranks}, bs16 NHD -> bs64 HND"
    src = specs(ranks, num_tokens=num_tokens, block_size=16, layout="NHD")
    dst = specs(ranks, num_tokens=num_tokens, block_size=64, layout="HND")
    pairs = plan_pairs(src, dst, reference_tokens=num_tokens)  # at handshake, not per request
    src_ids = [scattered_blocks(s, num_tokens, 1) for s in src]
    dst_ids = [scattered_blocks(s, num_tokens, 2) for s in dst]
    programs = benchmark(plan_request, src, dst, pairs, num_tokens, src_ids, dst_ids)
    assert sum(p.nbytes for p in programs) == 32 * 2 * num_tokens * 8 * 128 * 2


@pytest.mark.parametrize("num_tokens", [1024, 4096, 16384, 32768], ids=lambda t: f"{t}tok")
def test_plan_handshake(benchmark, num_tokens):
    benchmark.group = "handshake: choose strategies for 8 -> 8 ranks"
    src = specs(8, num_tokens=num_tokens, block_size=16, layout="NHD")
    dst = specs(8, num_tokens=num_tokens, block_size=64, layout="HND")
    plans = benchmark(plan_pairs, src, dst, reference_tokens=num_tokens)
    assert len(plans) == 8
