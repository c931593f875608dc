"""Engine geometries and requests, rebuilt identically in every process from a few numbers.

A `Geometry` is one engine's cache shape and sharding (every rank's `KVCacheSpec` follows from
it); a `Request` is an id, a length and the seed of its KV. Both are plain frozen dataclasses,
so they cross process boundaries as `dataclasses.asdict` dicts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvxfer.spec import KVCacheSpec, pp_layer_ranges


@dataclass(frozen=True)
class Geometry:
    """One engine's cache geometry. Ranks are engine ranks (pp-major: `pp_rank * tp +
    tp_rank`), so a geometry with `pp > 1` has every rank of every pipeline stage."""

    tp: int = 1
    heads: int = 4
    block_size: int = 16
    layout: str = "NHD"
    placement: str = "kv_first"
    mla: bool = False
    layers: int = 2
    head_dim: int = 8
    dtype: str = "bfloat16"
    num_blocks: int = 64
    pp: int = 1
    # Each stage's global layers (start, stop); default: vLLM's default split of `layers`.
    layer_ranges: tuple[tuple[int, int], ...] | None = None

    @property
    def ranks(self) -> int:
        """Ranks of the engine, every stage's."""
        return self.pp * self.tp

    def stage_ranges(self) -> list[tuple[int, int]]:
        """Each pipeline stage's global layers, `(start, stop)`."""
        if self.layer_ranges is not None:
            return [(int(a), int(b)) for a, b in self.layer_ranges]
        return [(r.start, r.stop) for r in pp_layer_ranges(self.layers, self.pp)]

    def spec(self, rank: int = 0) -> KVCacheSpec:
        """The spec of engine rank `rank`."""
        stage, tp_rank = divmod(rank, self.tp)
        start, stop = self.stage_ranges()[stage]
        return KVCacheSpec(
            num_layers=stop - start,
            num_kv_heads=1 if self.mla else self.heads,
            head_dim=self.head_dim,
            dtype=self.dtype,  # type: ignore[arg-type]
            tp_size=self.tp,
            tp_rank=tp_rank,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            layout=self.layout,  # type: ignore[arg-type]
            kv_placement=self.placement,  # type: ignore[arg-type]
            mla=self.mla,
            pp_size=self.pp,
            pp_rank=stage,
            layer_start=start,
            total_layers=self.layers if self.pp > 1 else 0,
        )

    def specs(self) -> list[KVCacheSpec]:
        """Every rank's spec, by engine rank (`KVCacheSpec.engine_ranks`, which checks that
        `layer_ranges` tile the model's layers)."""
        return self.spec(0).engine_ranks(self.stage_ranges() if self.pp > 1 else None)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)


@dataclass(frozen=True)
class Request:
    """A request: its id, its length, the seed of its (global) KV, the first token the
    destination fetches (a prefix before it is already there), and whether the source
    publishes it."""

    request_id: str
    num_tokens: int
    seed: int = 0
    start_token: int = 0
    publish: bool = True


def side_specs(
    tp: int,
    *,
    heads: int = 4,
    block_size: int = 16,
    layout: str = "NHD",
    placement: str = "kv_first",
    mla: bool = False,
    num_layers: int = 2,
    head_dim: int = 8,
    dtype: str = "float16",
    num_blocks: int = 64,
    pp: int = 1,
    layer_ranges: Sequence[tuple[int, int]] | None = None,
) -> list[KVCacheSpec]:
    """Every rank's spec of one engine, by engine rank (pp-major): `Geometry(...).specs()`
    with the in-process tests' defaults (fp16). With `pp > 1`, the model's `num_layers` layers
    are split over the stages as `layer_ranges` says (default: vLLM's default split)."""
    return Geometry(
        tp=tp,
        heads=heads,
        block_size=block_size,
        layout=layout,
        placement=placement,
        mla=mla,
        layers=num_layers,
        head_dim=head_dim,
        dtype=dtype,
        num_blocks=num_blocks,
        pp=pp,
        layer_ranges=None if layer_ranges is None else tuple((a, b) for a, b in layer_ranges),
    ).specs()


def random_block_table(
    spec: KVCacheSpec, num_tokens: int, rng: np.random.Generator, contiguous: bool
) -> np.ndarray:
    """A request's block ids on one rank: a random permutation, or a run from a random start."""
    needed = -(-num_tokens // spec.block_size)
    if contiguous:
        start = int(rng.integers(0, spec.num_blocks - needed + 1))
        return np.arange(start, start + needed, dtype=np.int64)
    return rng.permutation(spec.num_blocks)[:needed].astype(np.int64)


def request_blocks(
    spec: KVCacheSpec, requests: Sequence[Request], index: int, side: str
) -> np.ndarray:
    """Request `index`'s blocks on one rank (`side` "src" or "dst"): scattered, disjoint from
    the other requests' blocks on the same rank, the same in every process."""
    rng = np.random.default_rng([spec.engine_rank, 0 if side == "src" else 1])
    order = rng.permutation(spec.num_blocks)
    needed = [-(-r.num_tokens // spec.block_size) for r in requests]
    start = sum(needed[:index])
    if start + needed[index] > spec.num_blocks:
        raise ValueError(f"num_blocks {spec.num_blocks} is too small for these requests")
    return order[start : start + needed[index]].astype(np.int64)
