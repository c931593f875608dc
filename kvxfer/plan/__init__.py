"""Pure planning: head routes, cell addresses, byte segments, strategies and their costs, a
connector's pairs fitted to its staging slots, and each chunk's read program."""

from kvxfer.plan.cost import (
    DEFAULT_STAGING_SLOTS,
    CostModel,
    StrategyEstimate,
    estimate_strategies,
)
from kvxfer.plan.fitting import FittedPair, fit_pair
from kvxfer.plan.heads import (
    HeadRoute,
    heads_of_rank,
    ranks_holding_head,
    route_heads,
    route_pair,
    routes_into,
)
from kvxfer.plan.paged import BlockGeometry, PagedView
from kvxfer.plan.pairs import PairPlan, check_pairable, check_side, plan_pairs, plan_pairs_into
from kvxfer.plan.program import (
    STRATEGIES,
    CellCopy,
    PairChunk,
    Strategy,
    TransferProgram,
    build_program,
    strategies_for,
)
from kvxfer.plan.reads import chunk_read_program, chunk_source_blocks
from kvxfer.plan.segments import Segments, coalesce

__all__ = [
    "DEFAULT_STAGING_SLOTS",
    "STRATEGIES",
    "BlockGeometry",
    "CellCopy",
    "CostModel",
    "FittedPair",
    "HeadRoute",
    "PagedView",
    "PairChunk",
    "PairPlan",
    "Segments",
    "Strategy",
    "StrategyEstimate",
    "TransferProgram",
    "build_program",
    "check_pairable",
    "check_side",
    "chunk_read_program",
    "chunk_source_blocks",
    "coalesce",
    "estimate_strategies",
    "fit_pair",
    "heads_of_rank",
    "plan_pairs",
    "plan_pairs_into",
    "ranks_holding_head",
    "route_heads",
    "route_pair",
    "routes_into",
    "strategies_for",
]
