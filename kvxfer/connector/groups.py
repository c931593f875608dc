"""Several KV cache groups per rank (vLLM's hybrid memory allocator): full-attention and
sliding-window layers, each group with its own geometry, layer tensors and block table.

A group is moved by a `KVProducer`/`KVConsumer` of its own (its own side channel and planner;
the groups of a request are fetched in parallel), and the request is whole only when every
group is: `GroupedProducer` releases a request once every group's producer did,
`GroupedFetch` reports one result with the failed blocks of every group (vLLM's groups share
one block pool, so their block ids never collide).

A sliding-window group moves only the tokens a query can still attend:
- the consumer fetches `[window_start(first_computed, window), num_tokens)`: the first position
  the engine computes after the load attends to the `window - 1` tokens before it. That is the
  first token not loaded (`num_tokens`), except where the engine recomputes the last loaded
  token: vLLM does after loading a whole prompt (its scheduler sets `num_computed_tokens` to
  `num_tokens - 1`), so that query attends from `num_tokens - window` (with `num_tokens - window
  + 1`, a real CPU engine's greedy outputs parted from one engine's alone on 4 of 16 prompts);
- blocks the engine already dropped (vLLM gives them its null block) are never written: a
  fetch starts past a leading null block (`null_block`);
- the producer holds `[num_tokens - window, num_tokens)` (`held_from`): what a decode rank
  that recomputes the prompt's last token asks for, which is what vLLM's sliding-window
  manager keeps after the prefill (it drops blocks below the tokens the last chunk attends
  to). A fetch below that fails with its blocks named, never reading a block that another
  request now owns.

Groups pair by index: both engines serve the same model, so vLLM builds the same groups in
the same order on both sides; `connect` checks that every producer rank has as many groups.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvxfer.connector.consumer import FetchHandle, KVConsumer, TransferResult
from kvxfer.connector.producer import KVProducer
from kvxfer.connector.requests import ReleaseReason
from kvxfer.connector.timeline import merge
from kvxfer.plan import PairPlan
from kvxfer.plan.paged import blocks_of_tokens
from kvxfer.spec import KVCacheSpec
from kvxfer.validation import (
    check_num_tokens,
    check_published_table,
    check_request_id,
)


@dataclass(frozen=True)
class CacheGroup:
    """One KV cache group of a rank.

    Attributes:
        spec: the group's geometry (its layers only: `num_layers` counts the group's layers).
        caches: its layer tensors, in the spec's shape.
        sliding_window: the attention window in tokens (vLLM's `sliding_window`), or None for
            full attention.
        state: a recurrent state group (`kvxfer.state`): a request's state is token 0 of the
            first block of its table, moved whatever the request's length.
    """

    spec: KVCacheSpec
    caches: Sequence[torch.Tensor]
    sliding_window: int | None = None
    state: bool = False

    def __post_init__(self) -> None:
        window = self.sliding_window
        if window is not None and (isinstance(window, bool) or not isinstance(window, int)):
            raise ValueError(f"CacheGroup.sliding_window: {window!r} is not an int or None")
        if window is not None and window < 1:
            raise ValueError(
                f"CacheGroup.sliding_window: {window} tokens; pass a window >= 1, or None for "
                "full attention"
            )
        if self.state and window is not None:
            raise ValueError("CacheGroup: a state group has no sliding window; pass None")

    def fetched_tokens(
        self, num_tokens: int, start_token: int = 0, first_computed: int | None = None
    ) -> tuple[int, int]:
        """The token range a decode rank fetches of this group for a request of `num_tokens`
        tokens of which it holds the first `start_token`: the window's, or the state's
        `(0, 1)`; empty (start == end) when nothing moves. `first_computed`: the first
        position the engine computes after the load (default `num_tokens`; the module
        docstring)."""
        if self.state:
            return (0, 1) if start_token < num_tokens else (1, 1)
        query = num_tokens if first_computed is None else first_computed
        return max(start_token, window_start(query, self.sliding_window)), num_tokens

    def held_tokens(self, num_tokens: int, first_token: int = 0) -> tuple[int, int]:
        """The token range a prefill rank offers of this group (`held_from`, none before
        `first_token`; the state's `(0, 1)`)."""
        if self.state:
            return 0, 1
        return max(first_token, held_from(num_tokens, self.sliding_window)), num_tokens


def window_start(num_tokens: int, sliding_window: int | None) -> int:
    """The first of `num_tokens` tokens that the query at position `num_tokens` attends to
    with a sliding window of `sliding_window` tokens (0 for full attention)."""
    if sliding_window is None:
        return 0
    return max(0, num_tokens - sliding_window + 1)


def held_from(num_tokens: int, sliding_window: int | None) -> int:
    """The first token whose KV a prefill rank still holds when it hands a request of
    `num_tokens` tokens over (see the module docstring; 0 for full attention)."""
    if sliding_window is None:
        return 0
    return max(0, num_tokens - sliding_window)


def _past_null_blocks(
    table: Sequence[int] | np.ndarray, start: int, end: int, block_size: int, null: int | None
) -> int:
    """`start`, moved to the next block's first token while its block is the engine's null
    block (at most `end`)."""
    while null is not None and start < end and int(table[start // block_size]) == null:
        start = min(end, (start // block_size + 1) * block_size)
    return start


def _group_tables(
    groups: Sequence[CacheGroup], block_ids: Sequence[Sequence[int] | np.ndarray], who: str
) -> list[Sequence[int] | np.ndarray]:
    """`block_ids` checked to hold one table per group."""
    if isinstance(block_ids, np.ndarray) or len(block_ids) != len(groups):
        count = "an array" if isinstance(block_ids, np.ndarray) else f"{len(block_ids)} tables"
        raise ValueError(
            f"{who}: block_ids must hold one block table per KV cache group ({len(groups)}), "
            f"got {count}; pass a list of per-group lists"
        )
    return list(block_ids)


class GroupedProducer:
    """A prefill rank's KV cache groups, each served by a `KVProducer` of its own.

    Args:
        groups: the rank's groups, in the engine's group order.
        engine_id: as `KVProducer`.
        host: as `KVProducer`.
        port: group 0's side-channel port (0: a free one); the other groups always listen on
            free ports (`addresses` says where).
        release: called once per request, when every group released it, with the reason of
            the first group that released it for another reason than `READ` (`READ` when
            every group's decode ranks are done with it).
        **options: every other `KVProducer` option, for each group.
    """

    def __init__(
        self,
        groups: Sequence[CacheGroup],
        engine_id: str,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        release: Callable[[str, ReleaseReason], None] | None = None,
        **options: Any,
    ) -> None:
        if not groups:
            raise ValueError("GroupedProducer: no KV cache groups; pass at least one")
        self.groups = list(groups)
        self._release_cb = release
        self._lock = threading.Lock()
        # request id -> (groups that released it, the reason to report)
        self._released: dict[str, tuple[int, ReleaseReason]] = {}
        self.producers: list[KVProducer] = []
        try:
            for index, group in enumerate(self.groups):
                self.producers.append(
                    KVProducer(
                        group.spec,
                        group.caches,
                        engine_id,
                        host,
                        port if index == 0 else 0,
                        release=self._group_released,
                        **options,
                    )
                )
        except Exception:
            self.close()
            raise

    @property
    def addresses(self) -> list[str]:
        """Each group's side channel, in group order."""
        return [p.address for p in self.producers]

    @property
    def expired_requests(self) -> int:
        """Requests released at their deadline, over every group (a request counts once per
        group it expired in)."""
        return sum(p.expired_requests for p in self.producers)

    def publish(
        self,
        request_id: str,
        block_ids: Sequence[Sequence[int] | np.ndarray],
        num_tokens: int,
        deadline_s: float | None = None,
        ready_tokens: int | None = None,
        timeline: Mapping[str, float] | None = None,
        first_token: int = 0,
    ) -> None:
        """Offer a request's KV: `block_ids[g]` is group `g`'s block table. A sliding-window
        group offers the tokens it still holds (`held_from`), none before `first_token` (the
        decode holds them already: `KVProducer.publish`). Every table is checked before any
        group publishes. `ready_tokens`, `timeline`: as `KVProducer.publish` (the prefill
        still runs; `mark_ready` and `fail` follow it).

        Raises:
            ValueError: a bad id, token count or table (naming the group), or an id already
                published.
        """
        request_id = check_request_id(request_id, "publish")
        tokens = check_num_tokens(num_tokens, f"publish({request_id!r}): num_tokens")
        tables = _group_tables(self.groups, block_ids, f"publish({request_id!r})")
        held = [g.held_tokens(tokens, first_token) for g in self.groups]
        ready = [None if ready_tokens is None else min(ready_tokens, end) for _, end in held]
        checks = zip(self.groups, tables, held, ready, strict=True)
        for index, (group, table, (first, end), computed) in enumerate(checks):
            where = f"publish({request_id!r}) group {index}"
            check_published_table(group.spec, table, end, where, first, computed)
        publishes = zip(self.producers, tables, held, ready, strict=True)
        for producer, table, (first, end), computed in publishes:
            producer.publish(request_id, table, end, deadline_s, first, computed, timeline)

    def mark_ready(
        self, request_id: str, tokens: int, group: int | None = None, layers: int | None = None
    ) -> None:
        """Tokens before `tokens` are computed: in every layer of every group (`group` None),
        or in group `group`'s first `layers` layers (`KVProducer.mark_ready`)."""
        if group is None:
            for producer in self.producers:
                producer.mark_ready(request_id, tokens)
        else:
            self.producers[group].mark_ready(request_id, tokens, layers)

    def extend(self, request_id: str, block_ids: Sequence[Sequence[int] | np.ndarray]) -> None:
        """Every group's grown block table (`KVProducer.extend`): `block_ids[g]` is group
        `g`'s whole table so far."""
        tables = _group_tables(self.groups, block_ids, f"extend({request_id!r})")
        for producer, table in zip(self.producers, tables, strict=True):
            producer.extend(request_id, table)

    def fail(self, request_id: str, reason: str = "the prefill failed") -> None:
        """The prefill of a request published with `ready_tokens` will not finish: every
        group's fetches fail with the blocks not served, and the request is released once."""
        for producer in self.producers:
            producer.fail(request_id, reason)

    def _group_released(self, request_id: str, reason: ReleaseReason) -> None:
        with self._lock:
            count, first = self._released.pop(request_id, (0, ReleaseReason.READ))
            count += 1
            if first is ReleaseReason.READ:
                first = reason
            whole = count == len(self.producers)
            if not whole:
                self._released[request_id] = (count, first)
        if whole and self._release_cb is not None:
            self._release_cb(request_id, first)

    def close(self) -> None:
        """Close every group's producer (each releases what it still holds)."""
        for producer in self.producers:
            producer.close()


class GroupedFetch:
    """A fetch of every group of a request; one result for all of them."""

    def __init__(self, request_id: str, handles: Sequence[FetchHandle | None]) -> None:
        self.request_id = request_id
        self.handles = list(handles)  # None: the group had nothing to move

    def done(self) -> bool:
        """Whether every group's fetch has finished."""
        return all(h is None or h.done() for h in self.handles)

    def wait(self, timeout: float | None = None) -> TransferResult:
        """Every group's result, merged: ok only if every group's is; the failed blocks of
        every group; bytes and operations summed; the slowest group's time. `timeout`
        applies to the whole (see `FetchHandle.wait`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        results = []
        for handle in self.handles:
            if handle is None:
                continue
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            results.append(handle.wait(left))
        return merge_results(results)

    def cancel(self) -> None:
        """Abandon every group's fetch (see `FetchHandle.cancel`)."""
        for handle in self.handles:
            if handle is not None:
                handle.cancel()


def fetched_blocks(
    groups: Sequence[CacheGroup],
    block_ids: Sequence[Sequence[int] | np.ndarray],
    num_tokens: int,
    start_token: int = 0,
) -> list[int]:
    """Every block a fetch of the request fills, over its groups (`CacheGroup.fetched_tokens`):
    what a fetch that fails before any transfer reports, for the engine to recompute."""
    blocks: set[int] = set()
    for group, table in zip(groups, block_ids, strict=True):
        start, end = group.fetched_tokens(num_tokens, start_token)
        blocks.update(blocks_of_tokens(table, group.spec.block_size, start, end))
    return sorted(blocks)


def merge_results(results: Sequence[TransferResult]) -> TransferResult:
    """One result for the groups of a request (an empty list: nothing to move, ok); their
    timelines merged (`kvxfer.connector.timeline.merge`: the first start, the last end)."""
    strategies = [r.strategy for r in results if r.strategy]
    timeline: dict[str, float] = {}
    for r in results:
        merge(timeline, r.timeline)
    return TransferResult(
        ok=all(r.ok for r in results),
        failed_block_ids=sorted({b for r in results for b in r.failed_block_ids}),
        bytes=sum(r.bytes for r in results),
        num_ops=sum(r.num_ops for r in results),
        strategy=",".join(dict.fromkeys(",".join(strategies).split(","))) if strategies else "",
        seconds=max((r.seconds for r in results), default=0.0),
        errors=[e for r in results for e in r.errors],
        timeline=timeline,
    )


class GroupedConsumer:
    """A decode rank's KV cache groups, each fetched by a `KVConsumer` of its own.

    Args:
        groups: the rank's groups, in the engine's group order (the producer's).
        engine_id: as `KVConsumer`.
        host: as `KVConsumer`.
        **options: every other `KVConsumer` option, for each group.
    """

    def __init__(
        self,
        groups: Sequence[CacheGroup],
        engine_id: str,
        host: str = "127.0.0.1",
        **options: Any,
    ) -> None:
        if not groups:
            raise ValueError("GroupedConsumer: no KV cache groups; pass at least one")
        self.groups = list(groups)
        self.consumers: list[KVConsumer] = []
        try:
            for group in self.groups:
                self.consumers.append(
                    KVConsumer(group.spec, group.caches, engine_id, host, **options)
                )
        except Exception:
            self.close()
            raise

    def connect(
        self,
        producer_addresses: Sequence[str | Sequence[str]],
        timeout: float = 10.0,
        *,
        held_timeout: float | None = None,
    ) -> list[list[PairPlan]]:
        """Connect every group to the prefill engine: `producer_addresses[r]` is producer rank
        `r`'s side channels, one per group in group order (`GroupedProducer.addresses`; a
        plain address for an engine of one group). Returns each group's pair plans.
        `timeout` and `held_timeout`: as `KVConsumer.connect`.

        Raises:
            ValueError: a producer rank with another number of groups than this rank.
            ConnectionError, TimeoutError: as `KVConsumer.connect`.
        """
        per_rank = [[a] if isinstance(a, str) else list(a) for a in producer_addresses]
        for rank, addresses in enumerate(per_rank):
            if len(addresses) != len(self.groups):
                raise ValueError(
                    f"connect: producer rank {rank} serves {len(addresses)} KV cache group(s) "
                    f"at {addresses}, this rank has {len(self.groups)}; both engines must run "
                    "the same model with the same hybrid-allocator setting, and several groups "
                    "are found through the bootstrap service (fixed addresses name one side "
                    "channel per rank)"
                )
        return [
            consumer.connect(
                [addresses[g] for addresses in per_rank], timeout, held_timeout=held_timeout
            )
            for g, consumer in enumerate(self.consumers)
        ]

    def fetch(
        self,
        request_id: str,
        block_ids: Sequence[Sequence[int] | np.ndarray],
        num_tokens: int,
        start_token: int = 0,
        timeout: float | None = None,
        streamed: bool = False,
        first_computed: int | None = None,
        null_block: int | None = None,
    ) -> GroupedFetch:
        """Start fetching tokens `[start_token, num_tokens)` of every group: `block_ids[g]`
        is group `g`'s table; a sliding-window group fetches only what the query at
        `first_computed` attends to (default `num_tokens`: the module docstring), past any
        leading entry of its table that is the engine's `null_block` (a block it dropped).
        `streamed`: as `KVConsumer.fetch` (the prefill may still compute it).

        Raises:
            ValueError: a bad id, range or table (nothing starts), as `KVConsumer.fetch`.
        """
        request_id = check_request_id(request_id, "fetch")
        num_tokens = check_num_tokens(num_tokens, f"fetch({request_id!r}): num_tokens")
        tables = _group_tables(self.groups, block_ids, f"fetch({request_id!r})")
        handles: list[FetchHandle | None] = []
        try:
            for group, consumer, table in zip(self.groups, self.consumers, tables, strict=True):
                start, end = group.fetched_tokens(num_tokens, start_token, first_computed)
                if group.sliding_window is not None:
                    start = _past_null_blocks(table, start, end, group.spec.block_size, null_block)
                if start >= end:
                    handles.append(None)  # a full prefix hit: nothing of this group moves
                    continue
                handles.append(consumer.fetch(request_id, table, end, start, timeout, streamed))
        except Exception:
            for handle in handles:
                if handle is not None:
                    handle.cancel()
            raise
        return GroupedFetch(request_id, handles)

    def abort(self, request_id: str) -> None:
        """Tell every group's producers that this engine will never load the request."""
        for consumer in self.consumers:
            consumer.abort(request_id)

    def dead_sessions(self) -> int:
        """Producer sessions lost (a rank went silent or restarted), over every group."""
        return sum(int(c.stats_snapshot()["dead_sessions"]) for c in self.consumers)  # type: ignore[call-overload]

    def close(self) -> None:
        """Close every group's consumer."""
        for consumer in self.consumers:
            consumer.close()
