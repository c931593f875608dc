"""The strategy cost model: network operations, bytes on the wire and kernel passes.

`seconds = ops * seconds_per_op + bytes / link_bytes_per_second
           + kernel_passes * (launch + 2 * bytes / memory_bytes_per_second)`

(a kernel pass reads and writes every byte once). The strategy is chosen per rank pair at
handshake, before any request's block table is known, so the estimate plans a reference request
of `reference_tokens` tokens whose blocks are scattered (no two consecutive block ids) unless
`contiguous_blocks` says otherwise: the conservative case for a paged allocator under load.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import numpy as np

from kvxfer.plan.heads import HeadRoute
from kvxfer.plan.layout import BlockGeometry, moved_bytes
from kvxfer.plan.program import CellCopy, Strategy, count_program_segments, program_shape
from kvxfer.spec import KVCacheSpec


@dataclass(frozen=True)
class CostModel:
    """Constants of the cost model, all in one place.

    The defaults describe a 400 Gbps RDMA NIC (50 GB/s) driven by Mooncake Transfer Engine and
    an H200 (4.8 TB/s HBM; DESIGN.md's anchors). `tcp_loopback()` describes this project's
    CPU test machines.
    """

    seconds_per_op: float = 2e-6  # post + completion of one RDMA write descriptor
    link_bytes_per_second: float = 50e9
    memory_bytes_per_second: float = 4.8e12
    seconds_per_kernel_launch: float = 5e-6
    reference_tokens: int = 4096
    contiguous_blocks: bool = False
    # Passes one copy to or from a mirror of blocks costs. 1 for the Triton kernels; 2 for the
    # CPU's torch copies, whose mirror side takes a temporary while a dense wire buffer takes
    # one pass (benchmarks/cell_copy_passes.py: 37.1 ms against 8.6 ms, 65k rows of 768 B).
    mirror_copy_passes: int = 1

    @classmethod
    def tcp_loopback(cls) -> CostModel:
        """Mooncake TCP on loopback between CPU processes, as measured on a 2-core machine:
        about 45 us per descriptor and 1.4 GB/s (kvxfer/transport/mooncake.py), torch
        gathers of 256-768 byte rows at about 3 GB/s (benchmarks/RESULTS.md)."""
        return cls(
            seconds_per_op=45e-6,
            link_bytes_per_second=1.4e9,
            memory_bytes_per_second=3e9,
            seconds_per_kernel_launch=20e-6,
            mirror_copy_passes=2,
        )

    def seconds(self, num_ops: int, nbytes: int, kernel_passes: int) -> float:
        """Estimated time of a transfer."""
        wire = num_ops * self.seconds_per_op + nbytes / self.link_bytes_per_second
        per_pass = self.seconds_per_kernel_launch + 2 * nbytes / self.memory_bytes_per_second
        return wire + kernel_passes * per_pass


@dataclass(frozen=True)
class StrategyEstimate:
    """A strategy's estimated cost for the reference request of one rank pair."""

    strategy: Strategy
    num_ops: int
    nbytes: int
    kernel_passes: int
    seconds: float


def reference_block_ids(num_tokens: int, block_size: int, contiguous: bool) -> np.ndarray:
    """A synthetic block table: consecutive ids, or every other id so that no runs join."""
    needed = -(-num_tokens // block_size)
    step = 1 if contiguous else 2
    return np.arange(needed, dtype=np.int64) * step


def estimate_strategy(
    strategy: Strategy,
    route: HeadRoute,
    src_spec: KVCacheSpec,
    dst_spec: KVCacheSpec,
    model: CostModel,
    num_tokens: int | None = None,
    landing: bool = False,
) -> StrategyEstimate:
    """Estimate one strategy for one pair on a reference request of `num_tokens` tokens
    (`landing`: a connector's program, whose bytes always land in destination staging)."""
    tokens = num_tokens or model.reference_tokens
    src_ids = reference_block_ids(tokens, src_spec.block_size, model.contiguous_blocks)
    dst_ids = reference_block_ids(tokens, dst_spec.block_size, model.contiguous_blocks)
    # Size the caches for the synthetic ids: the plane stride of kv_first depends on it.
    src_spec = msgspec.structs.replace(src_spec, num_blocks=int(src_ids[-1]) + 1)
    dst_spec = msgspec.structs.replace(dst_spec, num_blocks=int(dst_ids[-1]) + 1)
    shape = program_shape(strategy, route, src_spec, dst_spec, src_ids, dst_ids, 0, tokens, landing)
    ops = count_program_segments(shape, route, 0, tokens, src_spec.num_layers)
    geometry = BlockGeometry.of_spec(src_spec)
    nbytes = src_spec.num_layers * moved_bytes(geometry, route.num_heads, tokens)
    passes = sum(
        model.mirror_copy_passes if _touches_mirror(copy) else 1
        for copy in (shape.pack, shape.unpack)
        if copy is not None
    )
    return StrategyEstimate(strategy, ops, nbytes, passes, model.seconds(ops, nbytes, passes))


def _touches_mirror(copy: CellCopy) -> bool:
    """Whether a copy's staging side is a mirror of blocks (rather than the dense wire buffer,
    whose rows are consecutive)."""
    staging = copy.dst if copy.src.region == "cache" else copy.src
    return staging.geometry.num_blocks > 1 or staging.geometry.layout != "NHD"
