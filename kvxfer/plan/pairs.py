"""Pair plans: for every (source rank, destination rank) that moves KV, which strategy.

Ranks are engine ranks (`KVCacheSpec.engine_rank`, pp-major); a pair moves the layers both
ranks hold and the destination's heads that the source rank supplies (`HeadRoute`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvxfer.plan.cost import CostModel, StrategyEstimate, estimate_strategies
from kvxfer.plan.heads import HeadRoute, routes_into
from kvxfer.plan.program import Strategy, check_strategy, check_strategy_for, strategies_for
from kvxfer.spec import FP8_DTYPES, KVCacheSpec

# Fields that must agree between the two sides, and why a mismatch cannot be bridged (the
# model's layer count is checked apart: `num_layers` counts a pipeline stage's layers only).
_PAIRED_FIELDS = {
    "num_kv_heads": "both engines must serve the same model",
    "head_dim": "both engines must serve the same model",
    "mla": "an MLA latent cache cannot pair with a K/V cache",
}
# Fields that must agree among the ranks of one engine (and `num_layers`, `layer_start` among
# the ranks of one pipeline stage).
_SIDE_FIELDS = (
    "num_kv_heads",
    "head_dim",
    "dtype",
    "tp_size",
    "pp_size",
    "block_size",
    "layout",
    "kv_placement",
    "mla",
)


def check_side(specs: Sequence[KVCacheSpec], side: str) -> list[KVCacheSpec]:
    """Check that `specs` describe every rank of one engine exactly once; return them by
    `engine_rank` (pp-major).

    With pipeline parallelism the stages' layer ranges must tile the model's layers in stage
    order, and the TP ranks of one stage hold the same layers.

    Raises:
        ValueError: a rank is missing or duplicated, the ranks disagree on the geometry, or
            the stages' layers leave a gap or overlap.
    """
    if not specs:
        raise ValueError(f"{side}: no ranks given; list one entry per rank")
    first = specs[0]
    stage_first = {first.pp_rank: first}
    for spec in specs[1:]:
        for field in _SIDE_FIELDS:
            if getattr(spec, field) != getattr(first, field):
                raise _disagree(side, spec, first, field)
        if spec.model_layers != first.model_layers:
            raise _disagree(side, spec, first, "total_layers")
        same_stage = stage_first.setdefault(spec.pp_rank, spec)
        for field in ("num_layers", "layer_start"):
            if getattr(spec, field) != getattr(same_stage, field):
                raise _disagree(side, spec, same_stage, field)
    ranks = [spec.engine_rank for spec in specs]
    if len(set(ranks)) != len(ranks):
        duplicated = sorted({r for r in ranks if ranks.count(r) > 1})
        raise ValueError(f"{side}: duplicated rank(s) {duplicated}; list each rank once")
    missing = sorted(set(range(first.engine_size)) - set(ranks))
    if missing:
        size = f"tp_size {first.tp_size}"
        if first.pp_size > 1:
            size = f"pp_size {first.pp_size} x {size} (pp-major: pp_rank * tp_size + tp_rank)"
        raise ValueError(f"{side}: missing rank(s) {missing} of {size}; list every rank")
    ordered = sorted(specs, key=lambda s: s.engine_rank)
    if first.pp_size > 1:
        _check_stages(ordered[:: first.tp_size], side)
    return ordered


def _disagree(side: str, spec: KVCacheSpec, first: KVCacheSpec, field: str) -> ValueError:
    a, b = getattr(spec, field), getattr(first, field)
    if field == "total_layers":
        a, b = spec.model_layers, first.model_layers
    scope = "engine"
    if field in ("num_layers", "layer_start") and first.pp_size > 1:
        scope = f"pipeline stage ({first.pp_rank})"
    return ValueError(
        f"{side}: {spec.rank_name} has {field}={a!r} but {first.rank_name} has {b!r}; the ranks "
        f"of one {scope} must share their geometry"
    )


def _check_stages(stages: list[KVCacheSpec], side: str) -> None:
    """One rank per stage, in stage order: their layers must follow each other from 0 to the
    model's last."""
    end = 0
    for spec in stages:
        if spec.layer_start != end:
            raise ValueError(
                f"{side}: pipeline stage {spec.pp_rank} starts at layer {spec.layer_start}, but "
                f"the stages before it end at layer {end}; each stage's layer_start must be "
                "where the previous stage's layers end"
            )
        end = spec.layer_start + spec.num_layers


def check_pairable(src: KVCacheSpec, dst: KVCacheSpec) -> None:
    """Check that a source and a destination geometry can exchange KV.

    Raises:
        ValueError: naming the first field that differs and what to do about it.
    """
    if src.model_layers != dst.model_layers:
        field = "num_layers" if src.pp_size == dst.pp_size == 1 else "total_layers"
        raise ValueError(
            f"{field} differs: source has {src.model_layers!r}, destination has "
            f"{dst.model_layers!r}; both engines must serve the same model (with pipeline "
            "parallelism, total_layers counts every stage's layers)"
        )
    for field, reason in _PAIRED_FIELDS.items():
        a, b = getattr(src, field), getattr(dst, field)
        if a != b:
            raise ValueError(f"{field} differs: source has {a!r}, destination has {b!r}; {reason}")
    check_dtypes(src, dst)


def check_dtypes(src: KVCacheSpec, dst: KVCacheSpec) -> None:
    """Check that the source's KV dtype can become the destination's: equal dtypes move as
    bytes (fp8 ones only with equal scales on the layers both hold), and the copy kernels
    convert between a 16- or 32-bit float and fp8 or another such float; never between two fp8
    formats (docs/kernels-and-layouts.md, "Dtype conversion").

    Raises:
        ValueError: naming the two dtypes, or the layer whose scales differ, and the fix.
    """
    if src.dtype in FP8_DTYPES and dst.dtype in FP8_DTYPES and src.dtype != dst.dtype:
        raise ValueError(
            f"dtype differs: source has {src.dtype!r}, destination has {dst.dtype!r}; kvxfer "
            "converts between fp8 and 16- or 32-bit floats, not between two fp8 formats: use "
            "one fp8 format on both engines"
        )
    if src.dtype == dst.dtype and src.dtype in FP8_DTYPES:
        first = max(src.layer_start, dst.layer_start)
        last = min(src.layer_start + src.num_layers, dst.layer_start + dst.num_layers)
        if first >= last:
            return
        theirs = src.layer_scales(first - src.layer_start, last - first)
        ours = dst.layer_scales(first - dst.layer_start, last - first)
        if not np.array_equal(theirs, ours):
            layer = first + int(np.nonzero((theirs != ours).any(axis=1))[0][0])
            raise ValueError(
                f"k_scales/v_scales differ at layer {layer}: source "
                f"{theirs[layer - first].tolist()}, destination {ours[layer - first].tolist()}; "
                "fp8 bytes mean one thing only under one scale: give both engines the same "
                "scales, or run one of them with a 16-bit KV cache (kvxfer then converts)"
            )


@dataclass(frozen=True)
class PairPlan:
    """The plan of one rank pair: which layers and heads move, and with which strategy."""

    route: HeadRoute
    strategy: Strategy
    estimates: tuple[StrategyEstimate, ...]

    @property
    def src_rank(self) -> int:
        """Source engine rank (the TP rank without pipeline parallelism)."""
        return self.route.src_rank

    @property
    def dst_rank(self) -> int:
        """Destination engine rank (the TP rank without pipeline parallelism)."""
        return self.route.dst_rank

    @property
    def chosen(self) -> StrategyEstimate:
        """The estimate of the chosen strategy."""
        return next(e for e in self.estimates if e.strategy == self.strategy)


def plan_pairs(
    src_specs: Sequence[KVCacheSpec],
    dst_specs: Sequence[KVCacheSpec],
    *,
    cost_model: CostModel | None = None,
    strategy: str | None = None,
    reference_tokens: int | None = None,
    landing: bool = False,
) -> list[PairPlan]:
    """Plan every rank pair that moves KV from the source engine to the destination engine:
    every pair whose layers and heads overlap.

    Args:
        src_specs: every source rank's spec (every (pp, tp) rank).
        dst_specs: every destination rank's spec.
        cost_model: constants of the cost model (defaults: `CostModel()`).
        strategy: force one strategy for every pair instead of the cost model's choice.
        reference_tokens: request size for the estimates (default: the cost model's).
        landing: plan a connector's transfers, whose bytes always land in destination
            staging first (`kvxfer.plan.program`).

    Returns:
        One `PairPlan` per route, sorted by destination rank, then head, then layer: each
        destination rank's layers x heads are covered exactly once.
    """
    src = check_side(src_specs, "source")
    dst = check_side(dst_specs, "destination")
    check_pairable(src[0], dst[0])
    forced = check_strategy(strategy) if strategy is not None else None
    model = cost_model or CostModel()
    stages = [spec.layers for spec in src[:: src[0].tp_size]]
    plans = []
    for d in dst:
        plans.extend(_plan_into(src, stages, d, model, forced, reference_tokens, landing))
    return plans


def plan_pairs_into(
    src_specs: Sequence[KVCacheSpec],
    dst_spec: KVCacheSpec,
    *,
    cost_model: CostModel | None = None,
    strategy: str | None = None,
    reference_tokens: int | None = None,
    landing: bool = False,
) -> list[PairPlan]:
    """The plans of `plan_pairs` that feed one destination rank, from that rank's spec alone
    (what a consumer plans: it knows its own layers, not the other destination stages').

    Same arguments and plans as `plan_pairs`, for `dst_spec` only.
    """
    src = check_side(src_specs, "source")
    check_pairable(src[0], dst_spec)
    forced = check_strategy(strategy) if strategy is not None else None
    stages = [spec.layers for spec in src[:: src[0].tp_size]]
    model = cost_model or CostModel()
    return _plan_into(src, stages, dst_spec, model, forced, reference_tokens, landing)


def _plan_into(
    src: list[KVCacheSpec],
    stages: list[range],
    d: KVCacheSpec,
    model: CostModel,
    forced: Strategy | None,
    reference_tokens: int | None,
    landing: bool,
) -> list[PairPlan]:
    plans = []
    source = src[0]
    strategies = strategies_for(source, d)
    if forced is not None:
        check_strategy_for(forced, source, d)
    for route in routes_into(stages, src[0].tp_size, d):
        estimates = estimate_strategies(
            strategies, route, src[route.src_rank], d, model, reference_tokens, landing
        )
        chosen = forced or by_preference(estimates)[0].strategy
        plans.append(PairPlan(route, chosen, estimates))
    return plans


# Equal estimates: the simplest strategy first (STRATEGIES' order), except that pack+unpack goes
# before pack. The two tie whenever a mirror copy costs what a wire-buffer copy does (the
# Triton kernels), and the reference request fills its blocks; but a real request's last block
# is partly filled, and pack's read then breaks at every unwritten slot (a 16-token request
# from TP 2 to TP 4: 64 segments per decode rank against pack+unpack's one, the first cause of
# its fixed latency; benchmarks/latency.py, benchmarks/RESULTS.md).
_TIE_ORDER = {"direct": 0, "pack+unpack": 1, "pack": 2, "unpack": 3}


def by_preference(estimates: Sequence[StrategyEstimate]) -> list[StrategyEstimate]:
    """Estimates from the cheapest; equal ones in `_TIE_ORDER` (pack+unpack before pack)."""
    return sorted(estimates, key=lambda e: (e.seconds, _TIE_ORDER[e.strategy]))
