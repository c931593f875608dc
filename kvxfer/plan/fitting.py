"""Fitting a pair's plan to its staging slots: the strategy whose chunks fit, and their size.

A connector's consumer plans each rank pair once, at `connect` (`plan_pairs_into` gives the
routes and every strategy's estimate). Every chunk of a fetch lands in a staging slot on each
side, so a strategy is usable only if a slot of each side holds one of its chunks:
`fit_pair` takes the cheapest such strategy (or checks the forced one), with a forced
`chunk_tokens` if one is given, and cuts the pair's fetches with `choose_chunking`: tokens per
chunk and chunks in flight. Pure: specs and byte counts in, one frozen `FittedPair` out.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

from kvxfer.plan.cost import Chunking, CostModel, choose_chunking, choose_stream_layers
from kvxfer.plan.heads import HeadRoute
from kvxfer.plan.pairs import PairPlan, by_preference
from kvxfer.plan.sizing import chunk_alignment, chunk_bounds, max_chunk_tokens
from kvxfer.spec import KVCacheSpec


class ChunkCut(NamedTuple):
    """One chunk of a fetch over one pair: tokens `[token_start, token_end)` of global layers
    `[layer_start, layer_end)`."""

    token_start: int
    token_end: int
    layer_start: int
    layer_end: int


@dataclass(frozen=True)
class FittedPair:
    """A pair's plan for every fetch (made at `connect`, reused as is): its route and strategy,
    tokens per chunk and chunks in flight (at most the staging slots), and what cuts a streamed
    fetch (both sides' specs and the cost model)."""

    plan: PairPlan
    chunking: Chunking
    producer: KVCacheSpec
    consumer: KVCacheSpec
    model: CostModel
    max_tokens: int  # what a staging slot of each side holds of every layer

    @property
    def src_rank(self) -> int:
        """The producer's engine rank."""
        return self.plan.src_rank

    @property
    def chunk_tokens(self) -> int:
        """Tokens per chunk (chunks end at multiples of it: `chunk_bounds`)."""
        return self.chunking.tokens

    @property
    def depth(self) -> int:
        """Chunks in flight per fetch."""
        return self.chunking.depth

    @property
    def layers(self) -> range:
        """The global layers the pair moves."""
        return self.plan.route.global_layers(self.producer)

    def cuts(self, start: int, end: int, streamed: bool = False) -> list[ChunkCut]:
        """Tokens `[start, end)` cut into chunks, in the order they are asked for.

        Unstreamed: every layer per chunk, `chunk_tokens` tokens (ending at its multiples).
        Streamed: `choose_stream_layers` layers and tokens per chunk (more tokens, as fewer
        layers leave room for in a slot, still ending at multiples of `chunk_tokens`), token
        ranges outer and layer groups inner, the order a (chunked) prefill computes them in.
        """
        layers = self.layers
        group, tokens = len(layers), self.chunk_tokens
        if streamed:
            group, tokens = choose_stream_layers(
                self.plan.strategy,
                self.plan.route,
                self.producer,
                self.consumer,
                self.model,
                tokens,
                self.max_tokens,
                end - start,
            )
        return [
            ChunkCut(lo, hi, first, min(first + group, layers.stop))
            for lo, hi in chunk_bounds(start, end, tokens)
            for first in range(layers.start, layers.stop, group)
        ]

    def route_of(self, cut: ChunkCut) -> HeadRoute:
        """The route a chunk moves: the pair's, narrowed to the chunk's layers if fewer."""
        route = self.plan.route
        if range(cut.layer_start, cut.layer_end) == self.layers:
            return route
        return route.narrowed(cut.layer_start, cut.layer_end)


def fit_pair(
    plan: PairPlan,
    producer: KVCacheSpec,
    consumer: KVCacheSpec,
    slot_bytes: tuple[int, int],
    *,
    model: CostModel,
    staging_slots: int,
    forced: bool = False,
    chunk_tokens: int | None = None,
) -> FittedPair:
    """The pair's plan with the cheapest strategy whose chunks fit both sides' slots (only
    `plan.strategy` when `forced`), and its chunking: `chunk_tokens` if given (it must fit
    and be a multiple of the strategy's alignment), else the cost model's choice within a slot.

    Args:
        plan: the pair's plan from `plan_pairs_into` (with every strategy's estimate).
        producer: the producer rank's spec.
        consumer: the consumer rank's spec.
        slot_bytes: the producer's and the consumer's staging slot sizes.
        model: the cost model that cuts the chunks.
        staging_slots: the consumer's slots per producer rank (the most chunks in flight).
        forced: the strategy was forced: try no other.
        chunk_tokens: force the tokens per chunk.

    Raises:
        ValueError: no strategy, or not the forced one, fits one token (or `chunk_tokens`) in
            a slot; the message names what to change.
    """
    order = [plan.chosen] if forced else by_preference(plan.estimates)
    refusals = []
    for estimate in order:
        strategy = estimate.strategy
        cap = max_chunk_tokens(strategy, plan.route, producer, consumer, *slot_bytes, landing=True)
        if cap is None or cap < 1:
            refusals.append(f"{strategy}: a slot cannot hold one token")
            continue
        if chunk_tokens is not None:
            unit = chunk_alignment(strategy, producer, consumer, landing=True)
            if chunk_tokens > cap or chunk_tokens % unit:
                refusals.append(
                    f"{strategy}: chunks of at most {cap} tokens, in multiples of {unit}"
                )
                continue
        chosen = dataclasses.replace(plan, strategy=strategy)
        chunking = choose_chunking(
            strategy,
            plan.route,
            producer,
            consumer,
            model,
            cap,
            staging_slots,
            tokens=chunk_tokens,
        )
        return FittedPair(chosen, chunking, producer, consumer, model, cap)
    raise _nothing_fits(plan, forced, chunk_tokens, refusals)


def _nothing_fits(
    plan: PairPlan, forced: bool, chunk_tokens: int | None, refusals: list[str]
) -> ValueError:
    pair = f"pair {plan.src_rank}->{plan.dst_rank}"
    which = "strategy " + plan.strategy if forced else "any strategy"
    if chunk_tokens is None:
        return ValueError(
            f"staging_bytes: a slot cannot hold one token of {pair} ({which}); raise "
            "staging_bytes on both sides"
        )
    return ValueError(
        f"chunk_tokens: {chunk_tokens} tokens fit no staging slot of {pair} with {which} "
        f"({'; '.join(refusals)}); choose a fitting size, raise staging_bytes on both sides, "
        "or leave chunk_tokens to the cost model"
    )
