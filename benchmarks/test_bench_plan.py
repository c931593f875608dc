"""Planning cost per request: transfer programs for every rank pair, from block tables.

Run: `make bench` (or `.venv/bin/pytest benchmarks/test_bench_plan.py --benchmark-enable`).

The kernel strategies' programs (pack+unpack, and pack landing in a mirror of the destination's
blocks) are one segment per pair whatever the request's length: their rows must not grow with
tokens (compare the rows of one rank count). Strategies whose segments are per block (direct,
unpack, pack into the cache) grow linearly with tokens; `test_plan_request_forced` shows them.
"""

from __future__ import annotations

import pytest
from scenarios import connector_chunks, connector_request, plan_request, scattered_blocks, specs

from kvxfer.plan import STRATEGIES, plan_pairs

TOKENS = [1024, 4096, 16384, 32768]


def _engines(ranks: int, num_tokens: int):
    src = specs(ranks, num_tokens=num_tokens, block_size=16, layout="NHD")
    dst = specs(ranks, num_tokens=num_tokens, block_size=64, layout="HND")
    src_ids = [scattered_blocks(s, num_tokens, 1) for s in src]
    dst_ids = [scattered_blocks(s, num_tokens, 2) for s in dst]
    return src, dst, src_ids, dst_ids


def _moved_bytes(num_tokens: int) -> int:
    return 32 * 2 * num_tokens * 8 * 128 * 2  # layers * planes * tokens * heads * head_dim * bf16


@pytest.mark.parametrize("ranks", [1, 2, 4, 8], ids=lambda r: f"TP{r}to{r}")
@pytest.mark.parametrize("num_tokens", TOKENS, ids=lambda t: f"{t}tok")
def test_plan_request(benchmark, num_tokens, ranks):
    """`build_program` for every pair, with the strategy the planner picks."""
    benchmark.group = f"plan TP {ranks}->{ranks}, bs16 NHD -> bs64 HND"
    src, dst, src_ids, dst_ids = _engines(ranks, num_tokens)
    pairs = plan_pairs(src, dst, reference_tokens=num_tokens)  # at handshake, not per request
    programs = benchmark(plan_request, src, dst, pairs, num_tokens, src_ids, dst_ids)
    assert sum(p.nbytes for p in programs) == _moved_bytes(num_tokens)


@pytest.mark.parametrize("num_tokens", TOKENS, ids=lambda t: f"{t}tok")
def test_plan_connector_request(benchmark, num_tokens):
    """What a producer and a consumer plan for one request in one chunk (landing programs):
    `PairChunk.pack` on the producer, `PairChunk.program` on the consumer."""
    benchmark.group = "connector request, one chunk: TP 8->8, bs16 NHD -> bs64 HND, landing"
    src, dst, src_ids, dst_ids = _engines(8, num_tokens)
    pairs = plan_pairs(src, dst, reference_tokens=num_tokens, landing=True)
    programs = benchmark(connector_request, src, dst, pairs, num_tokens, src_ids, dst_ids)
    assert sum(p.nbytes for p in programs) == _moved_bytes(num_tokens)


@pytest.mark.parametrize("num_tokens", TOKENS, ids=lambda t: f"{t}tok")
def test_plan_connector_chunks(benchmark, num_tokens):
    """The same request cut into the chunks of the connectors' default staging slots (32 MiB in
    4 slots): the cost grows with the number of chunks, each of which costs the same."""
    benchmark.group = "connector request, 8 MiB chunks: TP 8->8, bs16 NHD -> bs64 HND, landing"
    src, dst, src_ids, dst_ids = _engines(8, num_tokens)
    pairs = plan_pairs(src, dst, landing=True)  # the connectors' reference request
    programs = benchmark(connector_chunks, src, dst, pairs, num_tokens, src_ids, dst_ids, 8 << 20)
    assert sum(p.nbytes for p in programs) == _moved_bytes(num_tokens)


@pytest.mark.parametrize("landing", [False, True], ids=["cache", "landing"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_plan_request_forced(benchmark, strategy, landing):
    """Every strategy for a 32k-token request over 8 + 8 ranks."""
    benchmark.group = "plan 32768 tokens TP 8->8, bs16 NHD -> bs64 HND, forced strategy"
    num_tokens = 32768
    src, dst, src_ids, dst_ids = _engines(8, num_tokens)
    pairs = plan_pairs(src, dst, strategy=strategy, reference_tokens=1024)
    programs = benchmark(plan_request, src, dst, pairs, num_tokens, src_ids, dst_ids, landing)
    assert sum(p.nbytes for p in programs) == _moved_bytes(num_tokens)


@pytest.mark.parametrize("landing", [False, True], ids=["cache", "landing"])
@pytest.mark.parametrize("num_tokens", TOKENS, ids=lambda t: f"{t}tok")
def test_plan_handshake(benchmark, num_tokens, landing):
    benchmark.group = "handshake: choose strategies for 8 -> 8 ranks"
    src = specs(8, num_tokens=num_tokens, block_size=16, layout="NHD")
    dst = specs(8, num_tokens=num_tokens, block_size=64, layout="HND")
    plans = benchmark(plan_pairs, src, dst, reference_tokens=num_tokens, landing=landing)
    assert len(plans) == 8
