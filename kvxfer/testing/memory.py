"""Poisoned memory: the byte patterns, raw-byte views by block, and a byte-exact cache model.

A destination cache starts all `POISON`; what a transfer must write there is computed from
`kvxfer.reference` (never from the code under test), so a byte out of place shows as a
difference, whether it landed in the wrong block, too late, or not at all.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from kvxfer.layout import BLOCK, layer_axes
from kvxfer.reference import random_global_kv, write_rank_cells
from kvxfer.spec import KVCacheSpec
from kvxfer.testing.geometry import Request

POISON = 0xA5
"""Every destination byte before anything lands."""
REPOISON = 0x5A
"""What an engine recomputing a failed block writes there (not the poison)."""
SOURCE_FILL = 0x3C
"""Source bytes outside published cells: a read from the wrong place shows."""

BlockIds = Sequence[int] | np.ndarray
"""Block ids of one rank: a list or an int64 array."""


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor: a view of a contiguous tensor (writes go through), a copy of
    a non-contiguous one (for comparison only)."""
    return t.contiguous().view(torch.uint8)


def by_block(spec: KVCacheSpec, layer: torch.Tensor) -> torch.Tensor:
    """A layer tensor (or its bytes) with the block axis first: `by_block(...)[b]` is block b,
    whatever the layout (compared as bytes, so `k_transposed` layers need no canonical view)."""
    return layer.movedim(layer_axes(spec.layout, spec.kv_placement, spec.mla).index(BLOCK), 0)


def _ids(blocks: Iterable[int]) -> torch.Tensor:
    return torch.as_tensor(np.asarray([int(b) for b in blocks], dtype=np.int64))


def fill_blocks(
    spec: KVCacheSpec, caches: Sequence[torch.Tensor], blocks: Iterable[int], byte: int
) -> None:
    """Overwrite whole blocks of every (contiguous) layer with one byte value."""
    ids = _ids(blocks)
    if ids.numel() == 0:
        return
    for t in caches:
        by_block(spec, t.view(torch.uint8))[ids] = byte


def block_diff(spec: KVCacheSpec, got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Differing bytes per block of one layer (int64, `num_blocks` long)."""
    diff = by_block(spec, bits(got) != bits(want))
    return diff.reshape(spec.num_blocks, -1).sum(1)


def poison(caches: Iterable[torch.Tensor], byte: int = POISON) -> None:
    """Fill every byte of every tensor with `byte` (default `POISON`)."""
    for t in caches:
        t.view(torch.uint8).fill_(byte)


def global_kv(spec: KVCacheSpec, request: Request) -> torch.Tensor:
    """The request's KV for all heads and the model's every layer, the same in every process
    (a function of the request's seed); any rank's spec of either engine gives the same."""
    return random_global_kv(spec, request.num_tokens, seed=request.seed)


class CacheModel:
    """What one destination rank's cache must hold, byte for byte (starts all `POISON`)."""

    def __init__(self, spec: KVCacheSpec, caches: Sequence[torch.Tensor]) -> None:
        self.spec = spec
        self.caches = list(caches)
        self.model = [torch.empty_like(t) for t in caches]
        poison(self.model)

    def land(self, block_ids: BlockIds, request: Request) -> None:
        """The request's tokens `[start_token, num_tokens)` are in `block_ids`."""
        kv = global_kv(self.spec, request)
        ids = np.asarray([int(b) for b in block_ids], dtype=np.int64)
        write_rank_cells(self.spec, self.model, ids, kv, request.start_token, request.num_tokens)

    def fill(self, blocks: Iterable[int], byte: int) -> None:
        """Whole blocks hold `byte` (poisoned or re-poisoned)."""
        fill_blocks(self.spec, self.model, blocks, byte)

    def settle(self, block_ids: BlockIds, request: Request, failed: Sequence[int]) -> None:
        """A fetch's result: every block exact except the failed ones, which the consumer
        re-poisoned with `REPOISON` when the result came."""
        self.land(block_ids, request)
        self.fill(failed, REPOISON)

    def adopt(self, blocks: Iterable[int]) -> None:
        """Take the cache's current bytes of `blocks` as the model's (after reporting them)."""
        ids = _ids(blocks)
        for got, want in zip(self.caches, self.model, strict=True):
            by_block(self.spec, want)[ids] = by_block(self.spec, got)[ids]

    def mismatches(self, blocks: Iterable[int] | None = None) -> dict[int, int]:
        """Blocks (of `blocks`, default all) whose bytes differ from the model: block -> bytes."""
        if blocks is None:
            total = torch.zeros(self.spec.num_blocks, dtype=torch.int64)
            for got, want in zip(self.caches, self.model, strict=True):
                total += block_diff(self.spec, got, want)
            return {b: int(n) for b, n in enumerate(total.tolist()) if n}
        found: dict[int, int] = {}
        for block in [int(b) for b in blocks]:
            n = 0
            for got, want in zip(self.caches, self.model, strict=True):
                a, b = by_block(self.spec, got)[block], by_block(self.spec, want)[block]
                n += int((bits(a) != bits(b)).sum())
            if n:
                found[block] = n
        return found

    def changed(self, blocks: Iterable[int]) -> int:
        """Bytes of `blocks` that no longer hold the model's content (progress of a fetch)."""
        return sum(self.mismatches(blocks).values())


class BlockPool:
    """Free block ids of one rank, handed out scattered and reused oldest first."""

    def __init__(self, num_blocks: int, seed: int = 0) -> None:
        order = np.random.default_rng(seed).permutation(num_blocks)
        self._free = [int(b) for b in order]

    def take(self, n: int) -> np.ndarray:
        """`n` free blocks (raises if there are not enough)."""
        if n > len(self._free):
            raise ValueError(f"{n} blocks asked, {len(self._free)} free")
        ids, self._free = self._free[:n], self._free[n:]
        return np.asarray(ids, dtype=np.int64)

    def give(self, ids: Iterable[int]) -> None:
        """Blocks free again (reused after every block freed before them)."""
        self._free.extend(int(b) for b in ids)

    @property
    def free(self) -> int:
        """Blocks free now."""
        return len(self._free)
