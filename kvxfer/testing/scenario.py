"""In-process scenarios: source ranks filled from a global KV, poisoned destination ranks, and
the bytes every destination layer must hold afterwards."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvxfer.reference import converted_global_kv, model_scales, random_global_kv, write_rank_cells
from kvxfer.spec import FP8_DTYPES, KVCacheSpec, allocate_kv_caches
from kvxfer.testing.geometry import random_block_table
from kvxfer.testing.memory import POISON, bits, poison

RankCaches = tuple[KVCacheSpec, list[torch.Tensor], np.ndarray]
"""One rank: its spec, its layer tensors and the request's block ids there."""


@dataclass
class Scenario:
    """Source ranks holding a request, poisoned destination ranks, and what they must become."""

    src: list[RankCaches]
    dst: list[RankCaches]
    expected: list[list[torch.Tensor]]
    num_tokens: int
    start_token: int

    def assert_exact(self) -> None:
        """Every destination layer equals its expectation bit for bit, untouched cells too."""
        for (spec, caches, _), expected in zip(self.dst, self.expected, strict=True):
            for layer, (got, want) in enumerate(zip(caches, expected, strict=True)):
                if not torch.equal(bits(got), bits(want)):
                    diff = (bits(got) != bits(want)).nonzero()
                    raise AssertionError(
                        f"destination {spec.rank_name} layer {layer}: "
                        f"{diff.shape[0]} bytes differ, first at byte {diff[0].tolist()}"
                    )

    def assert_untouched(self) -> None:
        """Every destination byte still holds the poison."""
        for spec, caches, _ in self.dst:
            for layer, got in enumerate(caches):
                assert (bits(got) == POISON).all(), f"{spec.rank_name} layer {layer}"


def make_scenario(
    src_specs: list[KVCacheSpec],
    dst_specs: list[KVCacheSpec],
    num_tokens: int,
    start_token: int = 0,
    seed: int = 0,
    contiguous: bool = False,
) -> Scenario:
    """Fill sources with noise plus the request's KV; poison destinations; compute expectations
    (between two KV dtypes: the request's KV as the destination's engine would store it,
    `converted_global_kv` with the fp8 side's scales and the destination's fp8 rounding)."""
    rng = np.random.default_rng(seed)
    kv = random_global_kv(src_specs[0], num_tokens, seed=seed)
    want_kv = kv
    if dst_specs[0].dtype != src_specs[0].dtype:
        fp8_side = src_specs if src_specs[0].dtype in FP8_DTYPES else dst_specs
        scales = model_scales(fp8_side) if fp8_side[0].dtype in FP8_DTYPES else None
        rounding = dst_specs[0].fp8_rounding
        want_kv = converted_global_kv(kv, dst_specs[0].torch_dtype, scales, rounding)
    src, dst, expected = [], [], []
    for spec in src_specs:
        caches = allocate_kv_caches(spec)
        for t in caches:
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(seed + 7)))
        ids = random_block_table(spec, num_tokens, rng, contiguous)
        write_rank_cells(spec, caches, ids, kv, 0, num_tokens)
        src.append((spec, caches, ids))
    for spec in dst_specs:
        caches = allocate_kv_caches(spec)
        poison(caches)
        ids = random_block_table(spec, num_tokens, rng, contiguous)
        want = [t.clone() for t in caches]
        write_rank_cells(spec, want, ids, want_kv, start_token, num_tokens)
        dst.append((spec, caches, ids))
        expected.append(want)
    return Scenario(src, dst, expected, num_tokens, start_token)
