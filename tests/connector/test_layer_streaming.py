"""Transfer overlapped with the prefill (issue 23): a decode rank fetches a request before it
is published, streamed (`fetch(streamed=True)`), and the prefill marks each layer ready as it
writes it (`mark_ready(..., layers=)`). The fetch completes layer by layer, bit-exact; a prefill
killed after half its layers fails the fetch with exactly the blocks it had not written, and no
late byte lands.

Real processes over Mooncake TCP on 127.0.0.1 (`kvxfer.testing.Rig`): the prefill rank's blocks
hold `SOURCE_FILL` until each layer is written, so a chunk read before its layer was marked would
show; the decode caches start poisoned and are compared with `kvxfer.reference`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
import torch

from kvxfer.plan.cost import CostModel
from kvxfer.testing import (
    BlockPool,
    Request,
    Rig,
    describe,
    leaks,
    wait_until,
    watch_for_late_bytes,
)
from kvxfer.testing.geometry import Geometry
from kvxfer.testing.memory import POISON, bits, by_block
from kvxfer.testing.rig import Consumer

LAYERS = 4
PREFILL = Geometry(head_dim=32, block_size=16, num_blocks=256, layers=LAYERS)
DECODE = Geometry(head_dim=32, block_size=32, layout="HND", num_blocks=128, layers=LAYERS)
TOKENS = 512
WAIT_S = 60.0
# A slow link and cheap round trips and operations in the consumer's cost model make one layer
# of a 128-token chunk worth its fixed costs for every strategy (`choose_stream_layers` picks
# one layer per chunk; direct's thousands of per-token segments would otherwise ask for all
# four): chunks of 32 tokens (one decode block) become 128 tokens of one layer each.
CONSUMER = {
    "chunk_tokens": 32,
    "staging_bytes": 128 << 10,
    "staging_slots": 2,
    "cost_model": CostModel(
        link_bytes_per_second=100e6, seconds_per_chunk=1e-6, seconds_per_op=1e-9
    ),
}


@pytest.fixture
def rig() -> Iterator[Rig]:
    with Rig() as r:
        yield r


def layer_blocks(consumer: Consumer, layer: int, blocks: Sequence[int]) -> tuple[torch.Tensor, ...]:
    """(the cache's, the model's) bytes of `blocks` in one layer."""
    ids = torch.as_tensor([int(b) for b in blocks])
    got = bits(by_block(consumer.spec, consumer.caches[layer])[ids])
    want = bits(by_block(consumer.spec, consumer.model.model[layer])[ids])
    return got, want


def exact(consumer: Consumer, layers: range, blocks: Sequence[int]) -> bool:
    """Whether `blocks` hold the request's KV in every layer of `layers`."""
    return all(torch.equal(*layer_blocks(consumer, layer, blocks)) for layer in layers)


def poisoned(consumer: Consumer, layers: range, blocks: Sequence[int]) -> bool:
    """Whether `blocks` still hold the poison in every layer of `layers`."""
    return all(bool((layer_blocks(consumer, n, blocks)[0] == POISON).all()) for n in layers)


def streamed_pair(rig: Rig, strategy: str | None = None) -> tuple:
    producer = rig.producer(PREFILL)
    options = dict(CONSUMER, strategy=strategy) if strategy else CONSUMER
    consumer = rig.consumer(DECODE, options=options)
    consumer.connect([producer.address])
    src = BlockPool(PREFILL.num_blocks, 1).take(PREFILL.blocks_for(TOKENS))
    dst = BlockPool(DECODE.num_blocks, 2).take(DECODE.blocks_for(TOKENS))
    return producer, consumer, src, dst.tolist()


@pytest.mark.parametrize("strategy", ["pack+unpack", "pack", "unpack", "direct"])
def test_a_streamed_fetch_completes_layer_by_layer_as_layers_are_marked(rig, strategy):
    producer, consumer, src, dst = streamed_pair(rig, strategy)
    request = Request("streamed", TOKENS, seed=3)
    consumer.fetch(request, dst, timeout=WAIT_S, streamed=True)  # before the publish
    producer.publish_computing(request, src)
    consumer.model.land(dst, request)  # what the blocks must hold in the end
    for layer in range(LAYERS):
        producer.compute(request, src, TOKENS, (layer, layer + 1))
        wait_until(
            lambda n=layer + 1: exact(consumer, range(n), dst), WAIT_S, f"layers < {layer + 1}"
        )
        # Nothing of a layer not marked yet: the producer holds its chunks.
        assert poisoned(consumer, range(layer + 1, LAYERS), dst)
    result = consumer.result(request.request_id, timeout=WAIT_S)
    assert result["ok"], result["errors"][:3]
    bad = consumer.model.mismatches()
    assert not bad, describe(bad, {"request": dst})
    assert not leaks([producer], [consumer], timeout=10.0)


def test_a_prefill_killed_after_half_its_layers_fails_exactly_the_blocks_not_written(rig):
    producer, consumer, src, dst = streamed_pair(rig)
    request = Request("killed", TOKENS, seed=4)
    consumer.fetch(request, dst, timeout=WAIT_S, streamed=True)
    producer.publish_computing(request, src)
    consumer.model.land(dst, request)
    half = TOKENS // 2
    written = dst[: half // DECODE.block_size]  # tokens [0, 256): every layer
    partial = dst[half // DECODE.block_size :]  # tokens [256, 512): layers 0 and 1 only
    producer.compute(request, src, half, (0, LAYERS))
    producer.compute(request, src, TOKENS, (0, LAYERS // 2))
    wait_until(lambda: exact(consumer, range(LAYERS), written), WAIT_S, "the first half's blocks")
    wait_until(
        lambda: exact(consumer, range(LAYERS // 2), partial), WAIT_S, "the rest's first layers"
    )
    producer.kill()
    result = consumer.result(request.request_id, timeout=WAIT_S)
    assert not result["ok"]
    assert result["failed_block_ids"] == sorted(partial), result["errors"][:3]
    # The consumer re-poisoned the failed blocks when `wait` returned; the rest is exact, and
    # stays so: no byte of the dead prefill lands later.
    consumer.model.settle(dst, request, result["failed_block_ids"])
    groups = {"failed": partial, "written": written}
    bad = consumer.model.mismatches()
    assert not bad, describe(bad, groups)
    late = watch_for_late_bytes([consumer], 1.5)
    assert not late, describe(late[consumer.name], groups)
    assert not leaks([], [consumer], timeout=10.0)
