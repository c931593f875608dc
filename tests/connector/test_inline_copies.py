"""Where the copies of a chunk run on CPU caches: a small one (at most 4 MiB) is packed on the
producer's side-channel thread when staging has room at once, and unpacked on the consumer's
loop, with no hand-over to a worker and back; a larger one is packed on the session's worker
(which may wait for room) and unpacked on the consumer's copy pool. Every byte lands either
way, checked against `kvxfer.reference` on poisoned caches, in one process over the local
transport (where copies run is the connector's choice, whatever moves the bytes)."""

from __future__ import annotations

import threading

import pytest

from kvxfer.connector import KVConsumer, KVProducer
from kvxfer.connector import streams as streams_mod
from kvxfer.connector.consumer import copies as copies_mod
from kvxfer.connector.producer import packing as producer_mod
from kvxfer.testing import make_scenario, side_specs

NUM_TOKENS = 1024
TOKEN_BYTES = 2 * 2 * 8 * 128 * 2  # layers x K/V x heads x head_dim x fp16


@pytest.mark.parametrize(
    "chunk_tokens,inline",
    [(32, True), (1024, False)],  # 256 KiB and 8 MiB chunks
)
def test_a_small_chunk_is_copied_on_the_message_threads_a_large_one_by_workers(
    monkeypatch, chunk_tokens, inline
):
    assert (chunk_tokens * TOKEN_BYTES <= streams_mod.INLINE_COPY_BYTES) == inline
    packed_on: list[str] = []
    unpacked_on: list[str] = []

    def recording(real, threads):
        def copy(cell_copy, src, dst, backend):
            threads.append(threading.current_thread().name)
            real(cell_copy, src, dst, backend)

        return copy

    monkeypatch.setattr(
        producer_mod, "run_cell_copy", recording(producer_mod.run_cell_copy, packed_on)
    )
    monkeypatch.setattr(
        copies_mod, "run_cell_copy", recording(copies_mod.run_cell_copy, unpacked_on)
    )
    src = side_specs(1, heads=8, head_dim=128, block_size=16, num_blocks=80)
    dst = side_specs(1, heads=8, head_dim=128, block_size=32, layout="HND", num_blocks=40)
    scenario = make_scenario(src, dst, NUM_TOKENS)
    ((spec, caches, ids),) = scenario.src
    ((dspec, dcaches, dids),) = scenario.dst
    pool = {"staging_bytes": 16 << 20, "staging_slots": 2, "transport": "local"}
    producer = KVProducer(spec, caches, "prefill", **pool)
    consumer = KVConsumer(
        dspec, dcaches, "decode", strategy="pack+unpack", chunk_tokens=chunk_tokens, **pool
    )
    try:
        consumer.connect([producer.address])
        producer.publish("r", ids, NUM_TOKENS)
        result = consumer.fetch("r", dids, NUM_TOKENS, timeout=60).wait()
        assert result.ok, result.errors
        scenario.assert_exact()
    finally:
        consumer.close()
        producer.close()
    assert len(packed_on) == len(unpacked_on) == NUM_TOKENS // chunk_tokens
    if inline:
        assert set(packed_on) == {"kvxfer-producer"}, packed_on  # the side channel's thread
        assert set(unpacked_on) == {"kvxfer-consumer"}, unpacked_on  # the consumer's loop
    else:
        assert all(name.startswith("kvxfer-producer-peer") for name in packed_on), packed_on
        assert all(name.startswith("kvxfer-copy") for name in unpacked_on), unpacked_on
