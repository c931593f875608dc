"""Pair plans: for every (source rank, destination rank) that moves heads, which strategy."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvxfer.plan.cost import CostModel, StrategyEstimate, estimate_strategy
from kvxfer.plan.heads import HeadRoute, route_heads
from kvxfer.plan.program import STRATEGIES, Strategy, check_strategy
from kvxfer.spec import KVCacheSpec

# Fields that must agree between the two sides, and why a mismatch cannot be bridged.
_PAIRED_FIELDS = {
    "num_layers": "both engines must serve the same model",
    "num_kv_heads": "both engines must serve the same model",
    "head_dim": "both engines must serve the same model",
    "dtype": "KV dtype conversion is not supported yet; use the same kv cache dtype",
    "mla": "an MLA latent cache cannot pair with a K/V cache",
}
# Fields that must agree among the ranks of one engine.
_SIDE_FIELDS = (
    "num_layers",
    "num_kv_heads",
    "head_dim",
    "dtype",
    "tp_size",
    "block_size",
    "layout",
    "kv_placement",
    "mla",
)


def check_side(specs: Sequence[KVCacheSpec], side: str) -> list[KVCacheSpec]:
    """Check that `specs` describe every rank of one engine exactly once; return them by rank.

    Raises:
        ValueError: a rank is missing or duplicated, or the ranks disagree on the geometry.
    """
    if not specs:
        raise ValueError(f"{side}: no ranks given; list one entry per TP rank")
    tp_size = specs[0].tp_size
    for spec in specs[1:]:
        for field in _SIDE_FIELDS:
            if getattr(spec, field) != getattr(specs[0], field):
                raise ValueError(
                    f"{side}: rank {spec.tp_rank} has {field}={getattr(spec, field)!r} but rank "
                    f"{specs[0].tp_rank} has {getattr(specs[0], field)!r}; the ranks of one "
                    "engine must share their geometry"
                )
    ranks = [spec.tp_rank for spec in specs]
    duplicated = sorted({r for r in ranks if ranks.count(r) > 1})
    if duplicated:
        raise ValueError(f"{side}: duplicated rank(s) {duplicated}; list each TP rank once")
    missing = sorted(set(range(tp_size)) - set(ranks))
    if missing:
        raise ValueError(
            f"{side}: missing rank(s) {missing} of tp_size {tp_size}; list every TP rank"
        )
    return sorted(specs, key=lambda s: s.tp_rank)


def check_pairable(src: KVCacheSpec, dst: KVCacheSpec) -> None:
    """Check that a source and a destination geometry can exchange KV.

    Raises:
        ValueError: naming the first field that differs and what to do about it.
    """
    for field, reason in _PAIRED_FIELDS.items():
        a, b = getattr(src, field), getattr(dst, field)
        if a != b:
            raise ValueError(f"{field} differs: source has {a!r}, destination has {b!r}; {reason}")


@dataclass(frozen=True)
class PairPlan:
    """The plan of one rank pair: which heads move and with which strategy."""

    route: HeadRoute
    strategy: Strategy
    estimates: tuple[StrategyEstimate, ...]

    @property
    def src_rank(self) -> int:
        """Source TP rank."""
        return self.route.src_rank

    @property
    def dst_rank(self) -> int:
        """Destination TP rank."""
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
    """Plan every rank pair that moves heads from the source engine to the destination engine.

    Args:
        src_specs: every source rank's spec.
        dst_specs: every destination rank's spec.
        cost_model: constants of the cost model (defaults: `CostModel()`).
        strategy: force one strategy for every pair instead of the cost model's choice.
        reference_tokens: request size for the estimates (default: the cost model's).
        landing: plan a connector's transfers, whose bytes always land in destination
            staging first (`kvxfer.plan.program`).

    Returns:
        One `PairPlan` per route, sorted by destination rank, then head.
    """
    src = check_side(src_specs, "source")
    dst = check_side(dst_specs, "destination")
    check_pairable(src[0], dst[0])
    forced = check_strategy(strategy) if strategy is not None else None
    model = cost_model or CostModel()
    plans = []
    for route in route_heads(src[0].num_kv_heads, src[0].tp_size, dst[0].tp_size):
        s, d = src[route.src_rank], dst[route.dst_rank]
        estimates = tuple(
            estimate_strategy(name, route, s, d, model, reference_tokens, landing)
            for name in STRATEGIES
        )
        # min() keeps the first of equal costs: STRATEGIES lists the simplest first.
        chosen = forced or min(estimates, key=lambda e: e.seconds).strategy
        plans.append(PairPlan(route, chosen, estimates))
    return plans
