"""`reshard`: move a request's KV cache between two shardings inside one process.

It plans every rank pair, then runs each pair's transfer program through a `LocalTransport`:
pack on the source side, the byte segments, unpack on the destination side. The plan objects
and segment lists are the ones a network transport executes.

Either side may be pipeline parallel: its entries then list every (pp, tp) rank, each with its
own stage's layers (`KVCacheSpec.layer_start`, `num_layers`), and each pair moves the layers
both of its ranks hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvxfer.execute import Backend, resolve_backend, run_cell_copy
from kvxfer.plan import (
    CostModel,
    PairPlan,
    TransferProgram,
    build_program,
    check_side,
    plan_pairs,
)
from kvxfer.plan.paged import STAGING_REGION
from kvxfer.spec import KVCacheSpec
from kvxfer.transport import LocalTransport, Region
from kvxfer.validation import check_block_ids, check_caches, check_token_range

RankCache = tuple[KVCacheSpec, Sequence[torch.Tensor], Sequence[int] | np.ndarray]


@dataclass(frozen=True)
class PairReport:
    """What one rank pair did. Ranks are engine ranks (`KVCacheSpec.engine_rank`: the TP
    rank without pipeline parallelism)."""

    src_rank: int
    dst_rank: int
    heads: range  # global KV heads moved
    strategy: str
    num_segments: int
    nbytes: int
    layers: range  # global layers moved


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
    # region key -> (registered id, offset of the buffer in the region)
    regions: dict[int, tuple[int, int]] = field(default_factory=dict)


def _check_side(entries: Sequence[RankCache], side: str, num_tokens: int) -> list[_Rank]:
    if not entries:
        raise ValueError(f"{side}: no ranks given; list (spec, caches, block_ids) per rank")
    for entry in entries:
        if not isinstance(entry, tuple | list) or len(entry) != 3:
            raise ValueError(f"{side}: each entry must be a (spec, caches, block_ids) tuple")
    specs = check_side([spec for spec, _, _ in entries], side)
    ranks = []
    by_rank = {spec.engine_rank: (caches, ids) for spec, caches, ids in entries}
    for spec in specs:
        who = f"{side} {spec.rank_name}"
        caches, ids = by_rank[spec.engine_rank]
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
        src: `(KVCacheSpec, caches, block_ids)` for every source rank: every (pp, tp) rank
            with pipeline parallelism, its caches being its own stage's layers.
        dst: the same for every destination rank. Block ids cover tokens `[0, num_tokens)`.
        num_tokens: tokens in the request.
        start_token: first token to move; slots of earlier tokens are never written.
        strategy: force "direct", "pack", "unpack" or "pack+unpack" for every pair.
        backend: "torch", "triton", or "auto" (triton for CUDA tensors, torch otherwise).
        cost_model: constants for choosing strategies (default `CostModel()`).

    Returns:
        Per rank pair: the layers and heads, the strategy, the segments written and the bytes
        moved. Every destination rank ends up with exactly its layers and heads.

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
    programs = [
        build_program(
            plan.route,
            plan.strategy,
            src_ranks[plan.src_rank].spec,
            dst_ranks[plan.dst_rank].spec,
            src_ranks[plan.src_rank].block_ids,
            dst_ranks[plan.dst_rank].block_ids,
            start_token,
            num_tokens,
        )
        for plan in plans
    ]
    transport = LocalTransport()
    regions: list[Region] = []
    for rank in (*src_ranks, *dst_ranks):
        for layer, tensor in enumerate(rank.caches):
            regions.append(transport.register(tensor))
            rank.regions[layer] = (regions[-1].region_id, 0)
    # Pairs run one after another, so each side needs one staging buffer, sized for the largest
    # program, allocated (and first touched) once per call rather than once per pair.
    # Bytes, not elements: between two KV dtypes a side's staging holds either dtype.
    staging: dict[str, torch.Tensor] = {}
    for side, ranks in (("src", src_ranks), ("dst", dst_ranks)):
        nbytes = max(_staging_bytes(p, side) for p in programs)
        if nbytes > 0:
            staging[side] = torch.empty(nbytes, dtype=torch.uint8, device=device)
            regions.append(transport.register(staging[side]))
            for rank in ranks:
                rank.regions[STAGING_REGION] = (regions[-1].region_id, 0)
    try:
        for plan, program in zip(plans, programs, strict=True):
            s, d = src_ranks[plan.src_rank], dst_ranks[plan.dst_rank]
            _execute(program, s, d, staging, transport, resolved)
            result.pairs.append(_report(plan, program))
    finally:
        for region in regions:
            transport.unregister(region)
    return result


def _staging_bytes(program: TransferProgram, side: str) -> int:
    geometry = program.src_staging if side == "src" else program.dst_staging
    return 0 if geometry is None else program.num_layers * geometry.layer_bytes


def _report(plan: PairPlan, program: TransferProgram) -> PairReport:
    return PairReport(
        src_rank=plan.src_rank,
        dst_rank=plan.dst_rank,
        heads=range(plan.route.head_start, plan.route.head_start + plan.route.num_heads),
        strategy=plan.strategy,
        num_segments=len(program.segments),
        nbytes=program.nbytes,
        layers=range(plan.route.layer_start, plan.route.layer_start + program.num_layers),
    )


def _execute(
    program: TransferProgram,
    s: _Rank,
    d: _Rank,
    staging: dict[str, torch.Tensor],
    transport: LocalTransport,
    backend: Backend,
) -> None:
    src_staging, dst_staging = staging.get("src"), staging.get("dst")
    if program.pack is not None:
        assert src_staging is not None
        packed = src_staging[: _staging_bytes(program, "src")]
        run_cell_copy(program.pack, s.caches, [packed], backend)
    transport.write(program.segments.with_regions(s.regions, d.regions), transport.peer())
    if program.unpack is not None:
        assert dst_staging is not None
        unpacked = dst_staging[: _staging_bytes(program, "dst")]
        run_cell_copy(program.unpack, [unpacked], d.caches, backend)
