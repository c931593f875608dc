"""`choose_chunking`: tokens per chunk and chunks in flight from the cost model's constants.

The rule: the smallest chunk (in whole blocks of both sides when a slot holds them) whose fixed
costs (`seconds_per_chunk`, operations, launches) are at most `chunk_overhead` of its byte time,
capped by what a staging slot holds; as many in flight as hide a chunk's lifetime behind its
slowest stage, within the slots. Its answers move the way the constants say they should."""

from __future__ import annotations

import dataclasses
import math

import pytest

from kvxfer.plan import STRATEGIES, CostModel, plan_pairs
from kvxfer.plan.cost import choose_chunking, chunk_cost
from kvxfer.plan.sizing import chunk_alignment, max_chunk_tokens
from kvxfer.testing import side_specs


def _pair(strategy: str, src_bs: int = 16, dst_bs: int = 32, heads: int = 4, layers: int = 8):
    (s,) = side_specs(1, heads=heads, block_size=src_bs, num_layers=layers, head_dim=128)
    (d,) = side_specs(
        1, heads=heads, block_size=dst_bs, layout="HND", num_layers=layers, head_dim=128
    )
    (plan,) = plan_pairs([s], [d], strategy=strategy, landing=True)
    return plan.route, s, d


def _tokens(strategy, model, cap=4096, slots=4, **pair):
    route, s, d = _pair(strategy, **pair)
    return choose_chunking(strategy, route, s, d, model, cap, slots)


TCP = CostModel.tcp_loopback()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_more_fixed_cost_per_chunk_never_gives_smaller_chunks(strategy):
    sizes = [
        _tokens(strategy, dataclasses.replace(TCP, seconds_per_chunk=f)).tokens
        for f in (0.0, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1)
    ]
    assert sizes == sorted(sizes), sizes
    assert sizes[-1] == 4096  # nothing amortizes 0.1 s: the slot's worth


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_costlier_operations_never_give_smaller_chunks(strategy):
    sizes = [
        _tokens(strategy, dataclasses.replace(TCP, seconds_per_op=op)).tokens
        for op in (1e-7, 1e-6, 1e-5, 45e-6, 1e-4)
    ]
    assert sizes == sorted(sizes), sizes


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_faster_links_and_memory_never_give_smaller_chunks(strategy):
    """Cheaper bytes: a chunk needs more of them to carry its fixed costs."""
    for field in ("link_bytes_per_second", "memory_bytes_per_second"):
        sizes = [
            _tokens(strategy, dataclasses.replace(TCP, **{field: rate})).tokens
            for rate in (1e8, 1e9, 1e10, 1e11)
        ]
        assert sizes == sorted(sizes), (field, sizes)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_larger_overhead_allowance_never_gives_larger_chunks(strategy):
    sizes = [
        _tokens(strategy, dataclasses.replace(TCP, chunk_overhead=f)).tokens
        for f in (0.01, 0.05, 0.1, 0.3, 1.0)
    ]
    assert sizes == sorted(sizes, reverse=True), sizes


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("src_bs,dst_bs", [(16, 32), (48, 32), (5, 8), (64, 16)])
def test_the_smallest_amortized_chunk_within_the_slot(strategy, src_bs, dst_bs):
    route, s, d = _pair(strategy, src_bs, dst_bs)
    unit = chunk_alignment(strategy, s, d, landing=True)
    for slot_bytes in (1 << 16, 1 << 20, 1 << 23):
        cap = max_chunk_tokens(strategy, route, s, d, slot_bytes, slot_bytes, landing=True)
        assert cap is not None
        if cap < 1:
            continue
        chosen = choose_chunking(strategy, route, s, d, TCP, cap, 4)
        assert 1 <= chosen.tokens <= cap and chosen.tokens % unit == 0
        cost = chunk_cost(strategy, route, s, d, TCP, chosen.tokens)
        amortized = cost.fixed <= TCP.chunk_overhead * cost.byte_time
        assert amortized or chosen.tokens == cap
        if amortized and chosen.tokens < cap:  # whole blocks of both sides below the cap
            both = math.lcm(src_bs, dst_bs)
            assert chosen.tokens % both == 0
            if chosen.tokens > both:  # one step smaller would not amortize
                smaller = chunk_cost(strategy, route, s, d, TCP, chosen.tokens - both)
                assert smaller.fixed > TCP.chunk_overhead * smaller.byte_time


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_larger_slots_never_give_smaller_chunks(strategy):
    sizes = [_tokens(strategy, TCP, cap=cap).tokens for cap in (64, 256, 1024, 4096, 16384)]
    assert sizes == sorted(sizes), sizes
    assert all(t <= cap for t, cap in zip(sizes, (64, 256, 1024, 4096, 16384), strict=True))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_depth_is_within_the_slots_and_grows_with_them(strategy):
    depths = [_tokens(strategy, TCP, slots=n).depth for n in (1, 2, 3, 4, 8, 16)]
    assert depths[0] == 1
    assert depths == sorted(depths) and all(
        1 <= x <= n for x, n in zip(depths, (1, 2, 3, 4, 8, 16), strict=True)
    )
    # The chunk's lifetime over its slowest stage: with fixed costs that outweigh its bytes,
    # more chunks are needed in flight.
    slow = dataclasses.replace(TCP, seconds_per_chunk=1e3)
    assert _tokens(strategy, slow, slots=16).depth == 16


def test_rdma_defaults_fill_the_slot_and_keep_a_few_chunks_in_flight():
    """On a 50 GB/s link the fixed cost of a chunk needs tens of MB to hide: a slot's worth."""
    model = CostModel()
    route, s, d = _pair("pack+unpack")
    cap = max_chunk_tokens("pack+unpack", route, s, d, 8 << 20, 8 << 20, landing=True)
    assert cap is not None
    chosen = choose_chunking("pack+unpack", route, s, d, model, cap, 4)
    assert chosen.tokens == cap and 2 <= chosen.depth <= 4


def test_a_given_size_is_kept_and_checked():
    route, s, d = _pair("pack")
    assert choose_chunking("pack", route, s, d, TCP, 512, 4, tokens=96).tokens == 96
    with pytest.raises(ValueError, match="tokens"):
        choose_chunking("pack", route, s, d, TCP, 512, 4, tokens=1024)
    with pytest.raises(ValueError, match="slots"):
        choose_chunking("pack", route, s, d, TCP, 512, 0)


# ---- streamed fetches: chunks of fewer layers -----------------------------------------------


def _fitted(model: CostModel, chunk_tokens: int = 64, layers: int = 8, cap: int = 4096):
    from kvxfer.plan.cost import Chunking
    from kvxfer.plan.fitting import FittedPair

    _, s, d = _pair("pack+unpack", layers=layers)
    (plan,) = plan_pairs([s], [d], strategy="pack+unpack", landing=True)
    return FittedPair(plan, Chunking(chunk_tokens, 2), s, d, model, cap)


def _cells(cuts) -> list[tuple[int, int]]:
    return sorted((t, layer) for c in cuts for t in range(*c[:2]) for layer in range(*c[2:]))


@pytest.mark.parametrize("streamed", [False, True])
def test_a_fetch_is_cut_into_chunks_that_cover_every_token_and_layer_once(streamed):
    pair = _fitted(TCP)
    cuts = pair.cuts(5, 3000, streamed)
    assert _cells(cuts) == [(t, layer) for t in range(5, 3000) for layer in range(8)]
    for cut in cuts:  # ends at multiples of the pair's chunk size, as a slot needs
        assert cut.token_end == 3000 or cut.token_end % pair.chunk_tokens == 0
        assert pair.route_of(cut).global_layers(pair.producer) == range(*cut[2:])
    if not streamed:
        assert {(c.layer_start, c.layer_end) for c in cuts} == {(0, 8)}


def test_a_long_streamed_fetch_has_one_layer_per_chunk_of_what_a_slot_holds():
    pair = _fitted(TCP, cap=1024)  # a slot holds 1024 tokens of 8 layers
    cuts = pair.cuts(0, 65536, streamed=True)
    assert {c.layer_end - c.layer_start for c in cuts} == {1}
    assert {c.token_end - c.token_start for c in cuts} == {1024 * 8}
    # In the order a prefill computes them: token ranges outer, layers inner.
    assert [(c.token_start, c.layer_start) for c in cuts] == sorted(
        (c.token_start, c.layer_start) for c in cuts
    )


def test_streamed_layers_per_chunk_grow_as_requests_shorten_and_round_trips_cost_more():
    from kvxfer.plan.cost import choose_stream_layers

    route, s, d = _pair("pack+unpack", layers=8)

    def layers(model: CostModel, tokens: int) -> int:
        return choose_stream_layers("pack+unpack", route, s, d, model, 64, 1024, tokens)[0]

    by_length = [layers(TCP, n) for n in (16, 128, 1024, 8192, 32768)]
    assert by_length == sorted(by_length, reverse=True)
    assert by_length[0] == 8 and by_length[-1] == 1  # too short to stream; long: every layer
    dearer = dataclasses.replace(TCP, seconds_per_chunk=TCP.seconds_per_chunk * 4)
    assert all(layers(dearer, n) >= layers(TCP, n) for n in (128, 1024, 8192))
    assert all(8 % layers(TCP, n) == 0 for n in (16, 128, 1024, 8192))  # equal groups
