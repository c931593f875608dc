"""The strategy cost model: network operations, bytes on the wire and kernel passes.

`seconds = ops * seconds_per_op + bytes / link_bytes_per_second
           + kernel_passes * (launch + 2 * bytes / memory_bytes_per_second)`

(a kernel pass reads and writes every byte once). The strategy is chosen per rank pair at
handshake, before any request's block table is known, so the estimate plans a reference request
of `reference_tokens` tokens whose blocks are scattered (no two consecutive block ids) unless
`contiguous_blocks` says otherwise: the conservative case for a paged allocator under load.

The same constants cut a connector's fetch into chunks (`choose_chunking`): the smallest chunks
whose fixed costs (`seconds_per_chunk`, operations, launches) stay under `chunk_overhead` of
their byte time, within a staging slot, and as many in flight as hide a chunk's latency behind
the slowest stage.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import msgspec
import numpy as np

from kvxfer.plan.heads import HeadRoute
from kvxfer.plan.paged import moved_bytes
from kvxfer.plan.program import (
    CellCopy,
    PairChunk,
    ProgramShape,
    Strategy,
    count_program_segments,
)
from kvxfer.plan.sizing import preferred_chunk_unit
from kvxfer.spec import KVCacheSpec


@dataclass(frozen=True)
class CostModel:
    """Constants of the cost model, all in one place.

    The defaults describe a 400 Gbps RDMA NIC (50 GB/s) driven by Mooncake Transfer Engine and
    an H200 (4.8 TB/s HBM; docs/design.md's anchors). `tcp_loopback()` describes this project's
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
    # one pass (benchmarks/studies/cell_copy_passes.py: 37.1 ms against 8.6 ms, 65k rows of 768 B).
    mirror_copy_passes: int = 1
    # Fixed cost of one chunk of a connector's fetch besides its operations and launches: its
    # side-channel round trips (ask -> ready; read -> valid too for a chunk read from the
    # cache) and the host work of both sides (planning, messages, thread hand-offs).
    # Estimated for a server CPU and a data-center network (no RDMA NIC here to measure it):
    # a fifth of the 2.6 ms measured on 2 cores over loopback, which `tcp_loopback()` has
    # (measured with two round trips per chunk; a packed chunk has one).
    seconds_per_chunk: float = 500e-6
    # `choose_chunking` takes the smallest chunk whose fixed costs are at most this fraction
    # of its byte time (so they add at most about 10% to a fetch that cannot overlap them).
    chunk_overhead: float = 0.1

    @classmethod
    def tcp_loopback(cls) -> CostModel:
        """Mooncake TCP on loopback between CPU processes, as measured on the project's 2-core
        machine through kvxfer's polled transport (`benchmarks/chunk_costs.py`, medians of
        three runs, benchmarks/RESULTS.md): 20 us per descriptor with many in flight (18-26
        us; 45 us one after another with the old busy-waiting writes), one stream at 2.8 GB/s
        (1.8-2.9), the torch backend's one-pass pack and unpack at 6-9 GB/s of payload (15
        GB/s of memory traffic: a pass reads and writes every byte; 13.7-15.8), and 2.6 ms per
        chunk of a fetch beyond its bytes (2.2-2.7)."""
        return cls(
            seconds_per_op=20e-6,
            link_bytes_per_second=2.8e9,
            memory_bytes_per_second=15e9,
            seconds_per_kernel_launch=20e-6,
            mirror_copy_passes=2,
            seconds_per_chunk=2.6e-3,
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


def estimate_strategies(
    strategies: tuple[Strategy, ...],
    route: HeadRoute,
    src_spec: KVCacheSpec,
    dst_spec: KVCacheSpec,
    model: CostModel,
    num_tokens: int | None = None,
    landing: bool = False,
) -> tuple[StrategyEstimate, ...]:
    """Estimate each strategy for one pair on a reference request of `num_tokens` tokens
    (`landing`: a connector's program, whose bytes always land in destination staging), sizing
    the request once. Only the route's layers count."""
    tokens = num_tokens or model.reference_tokens
    src_spec, dst_spec, blocks = _reference_caches(src_spec, dst_spec, model, tokens)
    estimates = []
    for strategy in strategies:
        chunk = PairChunk(route, strategy, src_spec, dst_spec, 0, tokens, landing)
        ops, nbytes, (pack, unpack) = _counts(chunk, blocks, model)
        passes = pack + unpack
        estimates.append(
            StrategyEstimate(strategy, ops, nbytes, passes, model.seconds(ops, nbytes, passes))
        )
    return tuple(estimates)


def _reference_caches(
    src_spec: KVCacheSpec, dst_spec: KVCacheSpec, model: CostModel, tokens: int
) -> tuple[KVCacheSpec, KVCacheSpec, tuple[np.ndarray, np.ndarray]]:
    """Both sides' reference block tables for `tokens` tokens (scattered unless
    `model.contiguous_blocks`), with the specs sized for them: the plane stride of kv_first
    depends on the number of blocks."""
    src_ids = reference_block_ids(tokens, src_spec.block_size, model.contiguous_blocks)
    dst_ids = reference_block_ids(tokens, dst_spec.block_size, model.contiguous_blocks)
    src_spec = msgspec.structs.replace(src_spec, num_blocks=int(src_ids[-1]) + 1)
    dst_spec = msgspec.structs.replace(dst_spec, num_blocks=int(dst_ids[-1]) + 1)
    return src_spec, dst_spec, (src_ids, dst_ids)


def _counts(
    chunk: PairChunk, blocks: tuple[np.ndarray, np.ndarray], model: CostModel
) -> tuple[int, int, tuple[int, int]]:
    """What the cost model counts of a chunk's program on `blocks`: network operations, bytes
    on the wire and the kernel passes of its (pack, unpack)."""
    shape = chunk.shape(*blocks)
    tokens = chunk.token_end - chunk.token_start
    ops = count_program_segments(shape, chunk.route, 0, tokens, shape.num_layers)
    return ops, wire_bytes(shape, chunk.route, tokens), _copy_passes(shape, model)


def wire_bytes(shape: ProgramShape, route: HeadRoute, tokens: int) -> int:
    """Bytes a program shape sends for `tokens` tokens: in the dtype of the buffer it sends
    from (between two dtypes, `pack` and a quantizing `pack+unpack` send the narrower)."""
    return shape.num_layers * moved_bytes(shape.send_from.geometry, route.num_heads, tokens)


def _touches_mirror(copy: CellCopy) -> bool:
    """Whether a copy's staging side is a mirror of blocks (rather than the dense wire buffer,
    whose rows are consecutive)."""
    staging = copy.dst if copy.src.region == "cache" else copy.src
    return staging.geometry.num_blocks > 1 or staging.geometry.layout != "NHD"


def _copy_passes(shape: ProgramShape, model: CostModel) -> tuple[int, int]:
    """Kernel passes of a program's (pack, unpack): 0 without one, `mirror_copy_passes` for a
    copy to or from a mirror of blocks, else 1."""
    return tuple(  # type: ignore[return-value]
        0 if copy is None else model.mirror_copy_passes if _touches_mirror(copy) else 1
        for copy in (shape.pack, shape.unpack)
    )


@dataclass(frozen=True)
class Chunking:
    """How a connector cuts one pair's fetches: `tokens` per chunk, at most `depth` chunks in
    flight per fetch (asked, packed, read, confirmed or copied into the cache)."""

    tokens: int
    depth: int


@dataclass(frozen=True)
class ChunkCost:
    """The cost model's view of one chunk of a pair (seconds), as `choose_chunking` uses it:

    - `fixed`: `seconds_per_chunk` + operations x `seconds_per_op` + launches;
    - `byte_time`: bytes / link + kernel passes x 2 x bytes / memory bandwidth;
    - `pack`, `wire`, `unpack`: the pipeline's stages (a pass, the read, a pass);
    - `lifetime`: a chunk from its ask to its copy into the cache, all of the above.
    """

    tokens: int
    nbytes: int
    num_ops: int
    fixed: float
    byte_time: float
    pack: float
    wire: float
    unpack: float
    lifetime: float


def chunk_cost(
    strategy: Strategy,
    route: HeadRoute,
    src_spec: KVCacheSpec,
    dst_spec: KVCacheSpec,
    model: CostModel,
    tokens: int,
    landing: bool = True,
) -> ChunkCost:
    """The cost of one chunk of `tokens` tokens of a pair, on blocks laid out as the
    reference request's (scattered unless `model.contiguous_blocks`)."""
    src_spec, dst_spec, blocks = _reference_caches(src_spec, dst_spec, model, tokens)
    chunk = PairChunk(route, strategy, src_spec, dst_spec, 0, tokens, landing)
    ops, nbytes, (pack_passes, unpack_passes) = _counts(chunk, blocks, model)
    per_pass = 2 * nbytes / model.memory_bytes_per_second
    launch = model.seconds_per_kernel_launch
    wire = ops * model.seconds_per_op + nbytes / model.link_bytes_per_second
    pack = pack_passes * (launch + per_pass)
    unpack = unpack_passes * (launch + per_pass)
    return ChunkCost(
        tokens=tokens,
        nbytes=nbytes,
        num_ops=ops,
        fixed=model.seconds_per_chunk
        + ops * model.seconds_per_op
        + (pack_passes + unpack_passes) * launch,
        byte_time=nbytes / model.link_bytes_per_second + (pack_passes + unpack_passes) * per_pass,
        pack=pack,
        wire=wire,
        unpack=unpack,
        lifetime=model.seconds_per_chunk + pack + wire + unpack,
    )


DEFAULT_STAGING_SLOTS = 2
"""Staging slots per peer and side by default. Two on each side keep all three stages of a
chunk busy at once (the producer packs chunk i+1 into its second slot while chunk i is read
from its first; the consumer reads chunk i+1 while it copies chunk i out of its other slot),
and at a given `staging_bytes` they are twice the size of four: half the chunks, so half the
per-chunk host work (`seconds_per_chunk`). Measured with `kvxfer bench` on the project's CPU
machine at 32 MiB: 1.26-1.43 GB/s with 2 slots against 0.78-0.97 with 4 (benchmarks/RESULTS.md)."""


def choose_chunking(
    strategy: Strategy,
    route: HeadRoute,
    src_spec: KVCacheSpec,
    dst_spec: KVCacheSpec,
    model: CostModel,
    max_tokens: int,
    slots: int,
    tokens: int | None = None,
    landing: bool = True,
) -> Chunking:
    """Tokens per chunk and chunks in flight for one pair's fetches.

    Tokens (unless given): the smallest multiple of `preferred_chunk_unit` (whole blocks on
    both sides when a slot holds them) whose fixed costs are at most `model.chunk_overhead`
    of its byte time (`ChunkCost`), or `max_tokens` (what a staging slot holds,
    `max_chunk_tokens`) when no chunk that fits gets there. Smaller chunks start the wire
    sooner and overlap more; the rule stops where their fixed costs would start to show.

    Depth: the chunks in flight that keep the slowest stage (pack, read or unpack) busy while
    each chunk spends `lifetime` in flight: `ceil(lifetime / slowest stage)`, between 1 and
    `slots` (the staging slots per producer rank).

    Raises:
        ValueError: `max_tokens` or `slots` below 1, or `tokens` above `max_tokens`.
    """
    if max_tokens < 1 or slots < 1:
        raise ValueError(f"max_tokens and slots: must be >= 1, got {max_tokens} and {slots}")
    if tokens is not None and not 1 <= tokens <= max_tokens:
        raise ValueError(f"tokens: {tokens} is not within [1, max_tokens={max_tokens}]")

    def cost(n: int) -> ChunkCost:
        return chunk_cost(strategy, route, src_spec, dst_spec, model, n, landing)

    def amortized(c: ChunkCost) -> bool:
        return c.fixed <= model.chunk_overhead * c.byte_time

    if tokens is None:
        unit = preferred_chunk_unit(strategy, src_spec, dst_spec, max_tokens)
        lo, hi = 1, max_tokens // unit
        if not amortized(cost(hi * unit)):
            tokens = max_tokens  # nothing that fits amortizes: the largest chunk comes closest
        else:  # bytes grow linearly and fixed costs slower: the smallest that amortizes
            while lo < hi:
                mid = (lo + hi) // 2
                if amortized(cost(mid * unit)):
                    hi = mid
                else:
                    lo = mid + 1
            tokens = lo * unit
    chosen = cost(tokens)
    slowest = max(chosen.pack, chosen.wire, chosen.unpack)
    depth = math.ceil(chosen.lifetime / slowest) if slowest > 0 else slots
    return Chunking(tokens, max(1, min(slots, depth)))


@functools.lru_cache(maxsize=1024)
def choose_stream_layers(
    strategy: Strategy,
    route: HeadRoute,
    src_spec: KVCacheSpec,
    dst_spec: KVCacheSpec,
    model: CostModel,
    chunk_tokens: int,
    max_tokens: int,
    request_tokens: int,
) -> tuple[int, int]:
    """(layers, tokens) per chunk of a streamed fetch of `request_tokens` tokens over one pair:
    a fetch asked for while the prefill still computes, read as the producer marks its layers
    ready.

    A chunk of `g` of the route's `L` layers carries up to what a staging slot holds of `g`
    layers (`max_tokens`, a slot's tokens of all `L` layers, times `L // g`), in multiples of
    `chunk_tokens` so that chunks stay aligned as the slot needs. `g` is the fewest layers
    (dividing `L`) whose chunk, at this request's length, has fixed costs at most its byte
    time: reading it then takes at least as long as asking for it, so the reads keep pace with
    the wire rather than with the round trips, and the tail after the prefill's last layer is
    one chunk (`g` layers' bytes and one fixed cost). A request too short for any such chunk
    gets `L`: one chunk per token range, as unstreamed (streaming it would only multiply round
    trips).
    """
    layers = route.global_layers(src_spec)
    total = len(layers)
    for group in range(1, total + 1):
        if total % group:
            continue  # equal groups only, so that every chunk costs the same
        tokens = max(chunk_tokens, max_tokens * (total // group) // chunk_tokens * chunk_tokens)
        narrowed = route.narrowed(layers.start, layers.start + group)
        cost = chunk_cost(
            strategy, narrowed, src_spec, dst_spec, model, min(tokens, request_tokens)
        )
        if cost.fixed <= cost.byte_time or group == total:
            return group, tokens if group < total else chunk_tokens
    raise AssertionError("unreachable: the last group is every layer")
