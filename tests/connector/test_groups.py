"""Several KV cache groups per rank, in one process over the local transport (the groups are
the connector's; Mooncake moves the same segments in test_connector.py): a full-attention group
and a sliding-window group, each with its own block table, prefill TP 2 (blocks of 16, NHD)
-> decode TP 3 (blocks of 32, HND). Tables hold vLLM's null block (id 0) where the window
dropped blocks. Checked bit for bit on poisoned destinations: the full group gets every token,
the window group exactly the tokens the next query attends to and nothing else; a rank asking
a window group for tokens the prefill no longer holds fails with its blocks named, writing
nothing; a request is released once, when every group released it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import numpy as np
import pytest
import torch

from kvxfer import allocate_kv_caches
from kvxfer.connector import (
    CacheGroup,
    GroupedConsumer,
    GroupedProducer,
    ReleaseReason,
    window_start,
)
from kvxfer.connector.groups import _past_null_blocks, fetched_blocks, held_from
from kvxfer.reference import random_global_kv, write_rank_cells
from kvxfer.testing import POISON, bits, side_specs, wait_until

NULL_BLOCK = 0  # vLLM's null block: never holds a token of a request
LOCAL = {"transport": "local"}
NUM_TOKENS, WINDOW, HEADS = 70, 20, 6


def _table(spec, num_tokens: int, first_token: int, rng: np.random.Generator) -> np.ndarray:
    """A scattered block table whose blocks wholly before `first_token` are the null block."""
    needed = -(-num_tokens // spec.block_size)
    ids = rng.permutation(np.arange(1, spec.num_blocks))[:needed].astype(np.int64)
    ids[: first_token // spec.block_size] = NULL_BLOCK
    return ids


class Side:
    """One engine's ranks, each with a full-attention group and a window group."""

    def __init__(self, tp: int, block_size: int, layout: str, windows, seed: int) -> None:
        placement = "kv_first" if layout == "NHD" else "blocks_first"
        self.specs = side_specs(
            tp, heads=HEADS, block_size=block_size, layout=layout, placement=placement
        )
        self.windows = windows
        self.caches = [[allocate_kv_caches(s) for _ in windows] for s in self.specs]
        self.rng = np.random.default_rng(seed)

    def groups(self, rank: int) -> list[CacheGroup]:
        return [
            CacheGroup(self.specs[rank], caches, window)
            for caches, window in zip(self.caches[rank], self.windows, strict=True)
        ]


@pytest.fixture
def request_kv():
    """The request's global KV per group (layers 0 and 2 full, 1 and 3 windowed: two groups)."""
    (spec,) = side_specs(1, heads=HEADS)
    return [random_global_kv(spec, NUM_TOKENS, seed=seed) for seed in (1, 2)]


def _prefill(request_kv) -> tuple[Side, list[list[np.ndarray]]]:
    side = Side(2, 16, "NHD", [None, WINDOW], seed=3)
    tables = []
    for rank, spec in enumerate(side.specs):
        per_group = []
        for caches, window, kv in zip(side.caches[rank], side.windows, request_kv, strict=True):
            for tensor in caches:
                tensor.copy_(torch.randn(tensor.shape))  # other requests' bytes
            first = held_from(NUM_TOKENS, window)
            ids = _table(spec, NUM_TOKENS, first, side.rng)
            write_rank_cells(spec, caches, ids, kv, first, NUM_TOKENS)
            per_group.append(ids)
        tables.append(per_group)
    return side, tables


def _decode(windows) -> tuple[Side, list[list[np.ndarray]]]:
    side = Side(3, 32, "HND", windows, seed=4)
    tables = []
    for rank, spec in enumerate(side.specs):
        per_group = []
        for caches, window in zip(side.caches[rank], windows, strict=True):
            for tensor in caches:
                bits(tensor).fill_(POISON)
            per_group.append(_table(spec, NUM_TOKENS, window_start(NUM_TOKENS, window), side.rng))
        tables.append(per_group)
    return side, tables


def _expected(side: Side, tables, request_kv, windows) -> list[list[list[torch.Tensor]]]:
    """Each decode rank's caches per group as they must be: poison, plus the moved tokens."""
    expected = []
    for rank, spec in enumerate(side.specs):
        per_group = []
        for caches, ids, kv, window in zip(
            side.caches[rank], tables[rank], request_kv, windows, strict=True
        ):
            want = [torch.full_like(bits(t), POISON).view(t.dtype) for t in caches]
            write_rank_cells(spec, want, ids, kv, window_start(NUM_TOKENS, window), NUM_TOKENS)
            per_group.append(want)
        expected.append(per_group)
    return expected


def _assert_equal(side: Side, expected) -> None:
    for rank, per_group in enumerate(expected):
        for group, want in enumerate(per_group):
            for layer, (got, w) in enumerate(zip(side.caches[rank][group], want, strict=True)):
                assert torch.equal(bits(got), bits(w)), f"rank {rank} group {group} layer {layer}"


def _recorder(released: list) -> Callable[[str, ReleaseReason], None]:
    return lambda request_id, reason: released.append((request_id, reason))


@contextlib.contextmanager
def _published(prefill: Side, src_tables, decode: Side, released=None):
    """A producer per prefill rank, publishing request "r", and a consumer per decode rank,
    connected to them; all closed at the end."""
    producers, consumers = [], []
    try:
        for rank in range(len(prefill.specs)):
            release = None if released is None else _recorder(released[rank])
            producers.append(
                GroupedProducer(prefill.groups(rank), "prefill", release=release, **LOCAL)
            )
        for rank in range(len(decode.specs)):
            consumers.append(GroupedConsumer(decode.groups(rank), "decode", **LOCAL))
        for consumer in consumers:
            consumer.connect([p.addresses for p in producers], timeout=10)
        for producer, tables in zip(producers, src_tables, strict=True):
            producer.publish("r", tables, NUM_TOKENS)
        yield consumers
    finally:
        for c in consumers:
            c.close()
        for p in producers:
            p.close()


def test_full_and_window_groups_move_exactly_their_tokens(request_kv):
    prefill, src_tables = _prefill(request_kv)
    released: list[list[tuple[str, ReleaseReason]]] = [[] for _ in prefill.specs]
    windows = [None, WINDOW]
    decode, dst_tables = _decode(windows)
    with _published(prefill, src_tables, decode, released) as consumers:
        handles = [
            c.fetch("r", tables, NUM_TOKENS)
            for c, tables in zip(consumers, dst_tables, strict=True)
        ]
        results = [h.wait(30) for h in handles]
        assert all(r.ok for r in results), [r.errors for r in results]
        _assert_equal(decode, _expected(decode, dst_tables, request_kv, windows))
        # The window group moved fewer bytes than the full group: only its window.
        for handle in handles:
            full, windowed = (h.wait() for h in handle.handles)
            assert windowed.bytes < full.bytes
        wait_until(lambda: all(released), 30.0, "every prefill rank's release")
        # once each, after every group was done
        assert released == [[("r", ReleaseReason.READ)], [("r", ReleaseReason.READ)]]


def test_a_request_is_released_with_the_first_groups_reason_other_than_read(request_kv):
    prefill, src_tables = _prefill(request_kv)
    released: list[tuple[str, ReleaseReason]] = []
    producer = GroupedProducer(prefill.groups(0), "prefill", release=_recorder(released), **LOCAL)
    try:
        producer.publish("r", src_tables[0], NUM_TOKENS, ready_tokens=0)
        producer.producers[1].fail("r")  # one group's prefill failed, the other's is pending
        wait_until(lambda: not producer.producers[1].pending_requests, 60.0, "group 1's release")
        assert released == []  # group 0 still holds it
    finally:
        producer.close()  # group 0 releases it as closed: the request goes as failed
    assert released == [("r", ReleaseReason.FAILED)]


def test_a_rank_asking_for_dropped_window_tokens_fails_with_its_blocks(request_kv):
    prefill, src_tables = _prefill(request_kv)
    # A decode engine that takes the window group for full attention: it asks for every token.
    decode, dst_tables = _decode([None, None])
    with _published(prefill, src_tables, decode) as consumers:
        for rank, consumer in enumerate(consumers):
            result = consumer.fetch("r", dst_tables[rank], NUM_TOKENS).wait(30)
            assert not result.ok
            window_blocks = set(dst_tables[rank][1].tolist())
            assert window_blocks <= set(result.failed_block_ids)
            assert any("sliding window" in e for e in result.errors), result.errors
            for layer, tensor in enumerate(decode.caches[rank][1]):
                assert (bits(tensor) == POISON).all(), f"rank {rank} layer {layer} written"


def test_group_counts_must_match_and_tables_come_per_group(request_kv):
    prefill, src_tables = _prefill(request_kv)
    producer = GroupedProducer(prefill.groups(0), "prefill", **LOCAL)
    decode, _ = _decode([None, WINDOW])
    consumer = GroupedConsumer(decode.groups(0)[:1], "decode", **LOCAL)
    try:
        with pytest.raises(ValueError, match="serves 2 KV cache group"):
            consumer.connect([producer.addresses], timeout=5)
        with pytest.raises(ValueError, match="one block table per KV cache group"):
            producer.publish("r", src_tables[0][0], NUM_TOKENS)
        # A table with a dropped block inside the held window names the group.
        bad = [src_tables[0][0], np.zeros_like(src_tables[0][1])]
        with pytest.raises(ValueError, match="group 1"):
            producer.publish("r", bad, NUM_TOKENS)
        assert producer.producers[0].pending_requests == []  # nothing half-published
    finally:
        consumer.close()
        producer.close()


@pytest.mark.parametrize(
    ("num_tokens", "window", "start", "held"),
    [(70, None, 0, 0), (70, 20, 51, 50), (10, 20, 0, 0), (20, 20, 1, 0), (21, 20, 2, 1)],
)
def test_window_bounds(num_tokens, window, start, held):
    assert window_start(num_tokens, window) == start
    assert held_from(num_tokens, window) == held


def test_fetched_blocks_are_those_a_fetch_fills():
    """What a fetch failing before any transfer reports: every block of the full group from
    `start_token`, the window group's from its window, the state group's one block."""
    (spec,) = side_specs(1, heads=HEADS, block_size=16, num_blocks=64)
    (state_spec,) = side_specs(1, heads=HEADS, block_size=1, num_blocks=64)
    groups = [
        CacheGroup(spec, []),
        CacheGroup(spec, [], sliding_window=WINDOW),
        CacheGroup(state_spec, [], state=True),
    ]
    full, windowed, state = [10, 11, 12, 13, 14], [0, 0, 0, 23, 24], [40]
    # 70 tokens: the window keeps tokens 51..69, blocks 3 and 4 of 16 tokens.
    assert fetched_blocks(groups, [full, windowed, state], NUM_TOKENS, 20) == [
        11,
        12,
        13,
        14,
        23,
        24,
        40,
    ]
    # Everything held already: nothing to fill.
    assert fetched_blocks(groups, [full, windowed, state], NUM_TOKENS, NUM_TOKENS) == []


@pytest.mark.parametrize(
    ("num_tokens", "first_computed", "fetched"),
    [
        (70, None, (51, 70)),  # the next token attends to the 19 before it
        (70, 69, (50, 70)),  # vLLM recomputes the last loaded token: one token more
        (71, 70, (52, 71)),  # token 51's block (48-51) was dropped: from the next block
        (10, 9, (0, 10)),
    ],
)
def test_a_window_group_fetches_what_the_first_computed_query_attends(
    num_tokens, first_computed, fetched
):
    """A window of 20 in blocks of 4: a window group fetches what the first position the
    engine computes after the load attends to, past the blocks the engine dropped (vLLM keeps
    blocks from token `num_tokens - 19`'s; the others are its null block, 0)."""
    spec = side_specs(1, block_size=4)[0]
    group = CacheGroup(spec, allocate_kv_caches(spec), sliding_window=20)
    dropped = max(0, num_tokens - 19) // 4
    table = [0 if i < dropped else 100 + i for i in range(20)]
    start, end = group.fetched_tokens(num_tokens, 0, first_computed)
    assert (_past_null_blocks(table, start, end, 4, 0), end) == fetched
