"""Readiness finer than the request (issue 23): a producer publishes a request while its prefill
still runs (`ready_tokens`), marks chunks of tokens computed (`mark_ready`, as a chunked prefill
advances), and a fetch asked for at once is served chunk by chunk as they become ready; a
prefill that fails half-way (`fail`) fails the fetch with exactly the blocks it had not written,
no late byte lands, and the request is released once.

In one process over the local transport (readiness is the connector's; the transport's own
no-late-byte contract is tests/transport/test_contract.py's, over every kind), decode blocks of
32 tokens fetched in chunks of 32 (a chunk is a decode block), every byte compared with
`kvxfer.reference`.
"""

from __future__ import annotations

import time

import pytest
import torch

from kvxfer.testing import POISON, bits, make_scenario, side_specs
from kvxfer.testing.scenario import ScenarioEngines

NUM_TOKENS = 128
CHUNK = 32
WAIT_S = 30.0


class Streamed(ScenarioEngines):
    """Two prefill ranks (blocks of 16, NHD) -> two decode ranks (blocks of 32, HND), connected,
    recording the requests each prefill rank releases."""

    def __init__(self) -> None:
        src = side_specs(2, heads=4, block_size=16, num_blocks=40)
        dst = side_specs(2, heads=4, block_size=32, layout="HND", num_blocks=40)
        self.released: list[str] = []
        pool = {"staging_bytes": 1 << 16, "staging_slots": 2, "transport": "local"}
        producer = {"release": lambda rid, _: self.released.append(rid), **pool}
        super().__init__(
            make_scenario(src, dst, NUM_TOKENS), producer, {"chunk_tokens": CHUNK, **pool}
        )
        self.connect()

    def mark_ready(self, tokens: int) -> None:
        for producer in self.producers:
            producer.mark_ready("r", tokens)


@pytest.fixture
def streamed():
    with Streamed() as engines:
        yield engines


def wait_for_chunks(handles: list, count: int) -> None:
    """Until every handle has `count` chunks in its cache (a state to reach, not a delay)."""
    deadline = time.monotonic() + WAIT_S
    while not all(h.chunks_done >= count for h in handles):
        assert time.monotonic() < deadline, [h.chunks_done for h in handles]
        time.sleep(0.005)


def wait_for_releases(streamed: Streamed, count: int) -> None:
    """Until the producers released `count` requests in all (a state to reach, not a delay)."""
    deadline = time.monotonic() + WAIT_S
    while len(streamed.released) < count:
        assert time.monotonic() < deadline, streamed.released
        time.sleep(0.005)


def blocks_hold(streamed: Streamed, first: int, last: int, expected: bool) -> bool:
    """Whether decode blocks `[first, last)` of the request hold what they must (or, with
    `expected` False, still the poison) on every decode rank, every layer."""
    for (_, caches, ids), want in zip(
        streamed.scenario.dst, streamed.scenario.expected, strict=True
    ):
        for got, ref in zip(caches, want, strict=True):
            for block in ids[first:last].tolist():
                got_block = bits(got.select(1, block))  # HND kv_first: [2, blocks, ...]
                if expected and not torch.equal(got_block, bits(ref.select(1, block))):
                    return False
                if not expected and not bool((got_block == POISON).all()):
                    return False
    return True


def test_a_fetch_asked_early_is_served_chunk_by_chunk_as_tokens_are_marked(streamed):
    streamed.publish("r", ready_tokens=0)
    handles = streamed.fetch("r", timeout=WAIT_S)
    streamed.mark_ready(CHUNK)
    wait_for_chunks(handles, 1)
    assert not any(h.done() for h in handles)  # the other chunks are not computed yet
    assert blocks_hold(streamed, 0, 1, expected=True)
    streamed.mark_ready(100)  # completes the chunks of tokens [32, 96)
    wait_for_chunks(handles, 3)
    assert not any(h.done() for h in handles)  # [96, 128) needs token 127
    streamed.mark_ready(NUM_TOKENS)
    results = [h.wait(WAIT_S) for h in handles]
    assert all(r.ok for r in results), [r.errors for r in results]
    streamed.scenario.assert_exact()


def test_a_prefill_that_fails_half_way_fails_exactly_the_blocks_not_written(streamed):
    streamed.publish("r", ready_tokens=0)
    handles = streamed.fetch("r", timeout=WAIT_S)
    streamed.mark_ready(2 * CHUNK)
    wait_for_chunks(handles, 2)
    # The decode ranks asked for the other two chunks, which their producers hold.
    deadline = time.monotonic() + WAIT_S
    while not all(p.stats_snapshot()["waiting_chunks"] == 2 for p in streamed.producers):
        assert time.monotonic() < deadline, [p.stats_snapshot() for p in streamed.producers]
        time.sleep(0.005)
    for producer in streamed.producers:
        producer.fail("r", "the prefill engine aborted the request")
    results = [h.wait(WAIT_S) for h in handles]
    for result, (_, _, ids) in zip(results, streamed.scenario.dst, strict=True):
        assert not result.ok
        assert result.failed_block_ids == sorted(ids[2:].tolist())
        assert any("aborted the request" in e for e in result.errors), result.errors
    assert blocks_hold(streamed, 0, 2, expected=True)
    assert blocks_hold(streamed, 2, 4, expected=False)  # nothing landed, nor lands later
    # The release follows the failed answers on the producer's side-channel thread (`fail`
    # promises it later, once), so wait for it rather than expect it with the results.
    wait_for_releases(streamed, 2)
    assert sorted(streamed.released) == ["r", "r"]  # once per prefill rank
    for producer in streamed.producers:
        assert producer.pending_requests == []


def test_readiness_errors_name_the_problem(streamed):
    with pytest.raises(ValueError, match="ready_tokens 200 is outside"):
        streamed.producers[0].publish(
            "x", streamed.scenario.src[0][2], NUM_TOKENS, ready_tokens=200
        )
    streamed.publish("r", ready_tokens=64)
    with pytest.raises(ValueError, match="readiness only grows"):
        streamed.producers[0].mark_ready("r", 32)
    with pytest.raises(ValueError, match="not published"):
        streamed.producers[0].mark_ready("nobody", 32)
    streamed.mark_ready(NUM_TOKENS)
    results = [h.wait(WAIT_S) for h in streamed.fetch("r", timeout=WAIT_S)]
    assert all(r.ok for r in results)
    streamed.scenario.assert_exact()


def test_a_chunked_prefill_publishes_its_first_blocks_and_extends_the_table_as_it_allocates():
    """A chunked prefill's block table grows step by step: published with the blocks of its
    first chunk, extended with the next chunk's before that chunk is marked computed."""
    engines = Streamed()
    try:
        for producer, (s, _, ids) in zip(engines.producers, engines.scenario.src, strict=True):
            first = ids[: 64 // s.block_size]  # the first step's 64 tokens
            producer.publish("r", first, NUM_TOKENS, ready_tokens=0)
            with pytest.raises(ValueError, match="extend the table first"):
                producer.mark_ready("r", 100)
        handles = engines.fetch("r", timeout=WAIT_S)
        engines.mark_ready(64)
        wait_for_chunks(handles, 2)
        assert not any(h.done() for h in handles)
        for producer, (_, _, ids) in zip(engines.producers, engines.scenario.src, strict=True):
            with pytest.raises(ValueError, match="must start with the published one"):
                producer.extend("r", ids[::-1].copy())
            producer.extend("r", ids)
        engines.mark_ready(NUM_TOKENS)
        results = [h.wait(WAIT_S) for h in handles]
        assert all(r.ok for r in results), [r.errors for r in results]
        engines.scenario.assert_exact()
    finally:
        engines.close()
