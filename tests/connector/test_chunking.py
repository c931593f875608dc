"""A fetch is planned once and cut by the cost model: the consumer's chunk size and chunks in
flight come from `choose_chunking` (or a forced `chunk_tokens`), each chunk's answer carries
only that chunk's block ids (none when it is read from staging), and an answer whose blocks do
not belong to the chunk is refused before anything is read. One producer rank and one consumer
rank over real Mooncake TCP on 127.0.0.1, every destination byte checked."""

from __future__ import annotations

import contextlib
import dataclasses

import msgspec
import numpy as np
import pytest

from kvxfer.connector import KVConsumer, KVProducer
from kvxfer.connector.messages import ChunkReady, RegionInfo
from kvxfer.plan import CostModel, plan_pairs
from kvxfer.plan.cost import Chunking, choose_chunking
from kvxfer.plan.program import chunk_blocks
from kvxfer.plan.sizing import chunk_bounds, max_chunk_tokens
from kvxfer.testing import make_scenario, side_specs

STAGING = {"staging_bytes": 1 << 16, "staging_slots": 4}  # 16 KiB slots: 64 tokens of wire
TOKENS, START = 200, 7
TCP = CostModel.tcp_loopback()


@contextlib.contextmanager
def rig(strategy=None, tokens=TOKENS, start=START, **consumer_options):
    """A producer and a consumer (1 -> 1, 4 heads, 16 -> 32 tokens a block, NHD -> HND) and
    the scenario they move; the request is published."""
    src = side_specs(1, heads=4, block_size=16, num_blocks=40)
    dst = side_specs(1, heads=4, block_size=32, layout="HND", num_blocks=40)
    scenario = make_scenario(src, dst, tokens, start)
    (src_spec, src_caches, src_ids), (dst_spec, dst_caches, _) = scenario.src + scenario.dst
    producer = KVProducer(src_spec, src_caches, "prefill", **STAGING)
    consumer = KVConsumer(
        dst_spec, dst_caches, "decode", strategy=strategy, **{**STAGING, **consumer_options}
    )
    try:
        producer.publish("req", src_ids, tokens)
        yield producer, consumer, scenario
    finally:
        consumer.close()
        producer.close()


def fetch(consumer, scenario, timeout=20.0):
    (_, _, dst_ids) = scenario.dst[0]
    handle = consumer.fetch("req", dst_ids, scenario.num_tokens, scenario.start_token, timeout)
    return handle, handle.wait()


def expected_chunking(scenario, strategy, model, slots=4, tokens=None) -> Chunking:
    (s, _, _), (d, _, _) = scenario.src[0], scenario.dst[0]
    (plan,) = plan_pairs([s], [d], strategy=strategy, landing=True)
    slot = STAGING["staging_bytes"] // STAGING["staging_slots"]
    cap = max_chunk_tokens(strategy, plan.route, s, d, slot, slot, landing=True)
    return choose_chunking(strategy, plan.route, s, d, model, cap, slots, tokens=tokens)


@pytest.mark.parametrize("strategy", ["pack+unpack", "direct"])
def test_the_cost_model_chooses_chunks_and_depth(strategy):
    # Slow bytes make any chunk amortize its fixed costs: the smallest, whole blocks of both
    # sides (32 tokens); the measured loopback constants make the slot's worth the choice.
    slow_link = dataclasses.replace(TCP, link_bytes_per_second=1e5)
    for model in (slow_link, TCP):
        with rig(strategy, cost_model=model) as (producer, consumer, scenario):
            consumer.connect([producer.address])
            want = expected_chunking(scenario, strategy, model)
            assert consumer.chunking() == {0: want}
            handle, result = fetch(consumer, scenario)
            assert result.ok, result.errors
            assert handle.chunks_total == len(chunk_bounds(START, TOKENS, want.tokens))
            scenario.assert_exact()
        # direct reads 16-byte cells here: its operations grow with its tokens, so no size
        # amortizes them and the slot's worth is taken.
        smallest = model is slow_link and strategy == "pack+unpack"
        assert want.tokens == (32 if smallest else 64)


def test_a_forced_chunk_size_is_used_and_checked():
    with rig("pack+unpack", chunk_tokens=48) as (producer, consumer, scenario):
        consumer.connect([producer.address])
        assert consumer.chunking()[0].tokens == 48
        handle, result = fetch(consumer, scenario)
        assert result.ok and handle.chunks_total == len(chunk_bounds(START, TOKENS, 48))
        scenario.assert_exact()
    # A mirror of 32-token blocks needs whole blocks; 16 KiB slots hold 64 tokens of wire.
    for strategy, size, why in [("pack", 48, "multiples of 32"), ("pack+unpack", 65, "at most")]:
        with (
            rig(strategy, chunk_tokens=size) as (producer, consumer, _),
            pytest.raises(ValueError, match=f"chunk_tokens: {size}.*{why}"),
        ):
            consumer.connect([producer.address])
    # Without a forced strategy, the cheapest one that takes the size is used.
    with rig(None, cost_model=TCP, chunk_tokens=48) as (producer, consumer, scenario):
        (plan,) = consumer.connect([producer.address])
        assert consumer.chunking()[0].tokens == 48
        assert plan.strategy in ("unpack", "pack+unpack")  # 48: not whole 32-token blocks
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="chunk_tokens"):
            KVConsumer(scenario.dst[0][0], scenario.dst[0][1], "d", chunk_tokens=bad)


@pytest.mark.parametrize("strategy", ["direct", "unpack", "pack", "pack+unpack"])
def test_a_chunk_answer_carries_its_own_blocks_only(strategy):
    sent: list[ChunkReady] = []
    with rig(strategy, chunk_tokens=32) as (producer, consumer, scenario):
        send = producer._chunks.send

        def record(session, message):
            if isinstance(message, ChunkReady):
                sent.append(message)
            send(session, message)

        producer._chunks.send = record
        consumer.connect([producer.address])
        _, result = fetch(consumer, scenario)
        assert result.ok, result.errors
        scenario.assert_exact()
    src_ids = scenario.src[0][2]
    bounds = chunk_bounds(START, TOKENS, 32)
    assert len(sent) == len(bounds)
    for (lo, hi), ready in zip(bounds, sorted(sent, key=lambda r: r.chunk_id), strict=True):
        if strategy in ("pack", "pack+unpack"):
            assert ready.src_block_ids == [] and ready.staging is not None
        else:
            assert ready.src_block_ids == chunk_blocks(src_ids, 16, lo, hi).tolist()


TAMPER = {
    "the whole table": lambda r, ids: msgspec.structs.replace(r, src_block_ids=ids.tolist()),
    "an id beyond the cache": lambda r, ids: msgspec.structs.replace(
        r, src_block_ids=[*r.src_block_ids[:-1], 40]
    ),
    "an id twice": lambda r, ids: msgspec.structs.replace(
        r, src_block_ids=[r.src_block_ids[0]] * len(r.src_block_ids)
    ),
    "a staging slot": lambda r, ids: msgspec.structs.replace(
        r, src_block_ids=[], staging=RegionInfo(0, 4096, 1 << 16)
    ),
}


@pytest.mark.parametrize("tamper", TAMPER, ids=list(TAMPER))
def test_an_answer_outside_its_chunk_is_refused_before_any_read(tamper):
    """A producer that names blocks not of the chunk (or a staging slot for a chunk read from
    its cache) gets the chunk failed, with its blocks listed and nothing written."""
    with rig("direct", chunk_tokens=64) as (producer, consumer, scenario):
        src_ids = scenario.src[0][2]
        send = producer._chunks.send

        def forge(session, message):
            if isinstance(message, ChunkReady) and message.chunk_id % 2 == 0:
                message = TAMPER[tamper](message, np.asarray(src_ids))
            send(session, message)

        producer._chunks.send = forge
        consumer.connect([producer.address])
        reads = []
        read = consumer.transport.read
        consumer.transport.read = lambda segments, peer: reads.append(1) or read(segments, peer)
        _, result = fetch(consumer, scenario)
        assert not result.ok and result.failed_block_ids
        assert any("block id" in e or "staging" in e for e in result.errors), result.errors
    bounds = chunk_bounds(START, TOKENS, 64)
    assert len(reads) == len(bounds) // 2  # the forged (even) chunks were never read
    dst_ids = scenario.dst[0][2]
    forged = {
        int(b)
        for i, (lo, hi) in enumerate(bounds)
        if i % 2 == 0
        for b in dst_ids[lo // 32 : (hi - 1) // 32 + 1]
    }
    assert forged <= set(result.failed_block_ids)
