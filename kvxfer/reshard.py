"""`reshard`: move a request's KV cache between two shardings inside one process.

It plans every rank pair, then runs each pair's transfer program through a `LocalTransport`:
pack on the source side, the byte segments, unpack on the destination side. The plan objects
and segment lists are the ones a network transport executes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvxfer.execute import Backend, allocate_staging, resolve_backend, run_cell_copy
from kvxfer.plan import (
    CostModel,
    PairPlan,
    TransferProgram,
    build_program,
    check_side,
    plan_pairs,
)
from kvxfer.plan.layout import STAGING_REGION
from kvxfer.spec import KVCacheSpec
from kvxfer.transport import LocalTransport, Region
from kvxfer.validation import check_block_ids, check_caches, check_token_range

RankCache = tuple[KVCacheSpec, Sequence[torch.Tensor], Sequence[int] | np.ndarray]


@dataclass(frozen=True)
class PairReport:
    """What one rank pair did."""

    src_rank: int
    dst_rank: int
    heads: range  # global KV heads moved
    strategy: str
    num_segments: int
    nbytes: int


@dataclass(frozen=True)
class ReshardResult:
    """What `reshard` did, per rank pair and in total."""

    backend: str
    pairs: list[PairReport] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Bytes moved over the transport, all pairs."""
        return sum(p.nbytes for p in self.pairs)

    @property
    def num_segments(self) -> int:
        """Segments written, all pairs."""
        return sum(p.num_segments for p in self.pairs)


@dataclass
class _Rank:
    spec: KVCacheSpec
    caches: Sequence[torch.Tensor]
    block_ids: np.ndarray
    regions: dict[int, int] = field(default_factory=dict)  # region key -> registered id


def _check_side(entries: Sequence[RankCache], side: str, num_tokens: int) -> list[_Rank]:
    if not entries:
        raise ValueError(f"{side}: no ranks given; list (spec, caches, block_ids) per TP rank")
    for entry in entries:
        if not isinstance(entry, tuple | list) or len(entry) != 3:
            raise ValueError(f"{side}: each entry must be a (spec, caches, block_ids) tuple")
    specs = check_side([spec for spec, _, _ in entries], side)
    ranks = []
    by_rank = {spec.tp_rank: (caches, ids) for spec, caches, ids in entries}
    for spec in specs:
        who = f"{side} rank {spec.tp_rank}"
        caches, ids = by_rank[spec.tp_rank]
        check_caches(spec, caches, who)
        ranks.append(_Rank(spec, caches, check_block_ids(spec, ids, num_tokens, who)))
    return ranks


def reshard(
    src: Sequence[RankCache],
    dst: Sequence[RankCache],
    num_tokens: int,
    start_token: int = 0,
    strategy: str | None = None,
    backend: str = "auto",
    cost_model: CostModel | None = None,
) -> ReshardResult:
    """Copy tokens `[start_token, num_tokens)` of a request from one sharding to another.

    Args:
        src: `(KVCacheSpec, caches, block_ids)` for every source rank.
        dst: the same for every destination rank. Block ids cover tokens `[0, num_tokens)`.
        num_tokens: tokens in the request.
        start_token: first token to move; slots of earlier tokens are never written.
        strategy: force "direct", "pack", "unpack" or "pack+unpack" for every pair.
        backend: "torch", "triton", or "auto" (triton for CUDA tensors, torch otherwise).
        cost_model: constants for choosing strategies (default `CostModel()`).

    Returns:
        Per rank pair: the strategy, the segments written and the bytes moved.

    Raises:
        ValueError: mismatched geometry between the sides, a missing or duplicated rank,
            caches that do not match their spec, too few or out-of-range block ids.
    """
    check_token_range(num_tokens, start_token)
    src_ranks = _check_side(src, "source", num_tokens)
    dst_ranks = _check_side(dst, "destination", num_tokens)
    devices = {t.device for rank in (*src_ranks, *dst_ranks) for t in rank.caches}
    if len(devices) != 1:
        raise ValueError(f"caches: all must live on one device, got {sorted(map(str, devices))}")
    device = devices.pop()
    resolved = resolve_backend(backend, device)
    plans = plan_pairs(
        [r.spec for r in src_ranks],
        [r.spec for r in dst_ranks],
        cost_model=cost_model,
        strategy=strategy,
        reference_tokens=max(1, num_tokens - start_token),
    )
    result = ReshardResult(backend=resolved)
    if start_token == num_tokens:
        return result
    transport = LocalTransport()
    for rank in (*src_ranks, *dst_ranks):
        rank.regions = {i: transport.register(t).region_id for i, t in enumerate(rank.caches)}
    try:
        for plan in plans:
            result.pairs.append(
                _run_pair(plan, src_ranks, dst_ranks, start_token, num_tokens, transport, resolved)
            )
    finally:
        for rank in (*src_ranks, *dst_ranks):
            for region_id in rank.regions.values():
                transport.unregister(Region(region_id, 0, 0))
    return result


def _run_pair(
    plan: PairPlan,
    src_ranks: list[_Rank],
    dst_ranks: list[_Rank],
    start_token: int,
    num_tokens: int,
    transport: LocalTransport,
    backend: Backend,
) -> PairReport:
    s, d = src_ranks[plan.src_rank], dst_ranks[plan.dst_rank]
    program = build_program(
        plan.route,
        plan.strategy,
        s.spec,
        d.spec,
        s.block_ids,
        d.block_ids,
        start_token,
        num_tokens,
    )
    _execute(program, s, d, transport, backend)
    return PairReport(
        src_rank=plan.src_rank,
        dst_rank=plan.dst_rank,
        heads=range(plan.route.head_start, plan.route.head_start + plan.route.num_heads),
        strategy=plan.strategy,
        num_segments=len(program.segments),
        nbytes=program.nbytes,
    )


def _execute(
    program: TransferProgram, s: _Rank, d: _Rank, transport: LocalTransport, backend: Backend
) -> None:
    device, dtype = s.caches[0].device, s.caches[0].dtype
    layers = program.num_layers
    src_staging = dst_staging = None
    src_regions, dst_regions = dict(s.regions), dict(d.regions)
    staged: list[Region] = []
    try:
        if program.src_staging is not None:
            src_staging = allocate_staging(program.src_staging, layers, dtype, device)
            staged.append(transport.register(src_staging))
            src_regions[STAGING_REGION] = staged[-1].region_id
        if program.dst_staging is not None:
            dst_staging = allocate_staging(program.dst_staging, layers, dtype, device)
            staged.append(transport.register(dst_staging))
            dst_regions[STAGING_REGION] = staged[-1].region_id
        if program.pack is not None:
            assert src_staging is not None
            run_cell_copy(program.pack, s.caches, [src_staging], backend)
        transport.write(program.segments.with_regions(src_regions, dst_regions))
        if program.unpack is not None:
            assert dst_staging is not None
            run_cell_copy(program.unpack, [dst_staging], d.caches, backend)
    finally:
        for region in staged:
            transport.unregister(region)
