"""Recurrent state as a cache kind: the Mamba/SSM state of hybrid models, resharded across TP.

A recurrent layer (Mamba1/2, gated delta net...) keeps, per request, a fixed-size state in one
block (page) of its cache instead of KV per token. vLLM packs each layer's states into the
page, one after another (`MambaBase.bind_kv_cache`): for Mamba2 a conv state
`[conv_channels, state_len]` (DS layout) then an SSM state `[heads, head_dim, d_state]`, each
sharded over TP along its first axis. The conv channels are sub-projections (`x, B, C` for
Mamba2, `Q, K, V` for a gated delta net), each split evenly over the ranks: rank `r` holds the
`r`-th slice of every sub-projection, back to back. A sub-projection of fewer rows than ranks is
replicated as KV heads are (`H < T`): rank `r` holds its row `r // (T / H)` (a Mamba2 mixer with
fewer groups than ranks gives each rank B and C whole, one row of `n_groups = 1` groups).

Each (state, sub-projection) is then exactly a KV cache of this library with one token per
block: rows are "heads" (the TP-sharded axis, global rows split as KV heads are), a row's bytes
are one `kv_inner` cell (K then V halves, moved together: bits, never values), and the layer
tensor is a view into the pages whose blocks sit a page apart (`KVCacheSpec.block_stride`).
`StateLayout.groups` builds those views and specs, so the planner, the kernels, `reshard`, the
connectors and `kvxfer.reference` move a request's state like KV: a request's state is token 0
of its state block (`CacheGroup.state`), moved bit for bit from any TP size to any other.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import torch

from kvxfer.connector.groups import CacheGroup
from kvxfer.spec import KVCacheSpec

# One-byte items: the state moves as raw bytes, whatever its dtype.
_BYTES: Final = "float8_e4m3fn"


@dataclass(frozen=True)
class StateComponent:
    """One state tensor of a recurrent layer, as the whole model shapes it.

    Attributes:
        rows: global rows along the TP-sharded axis (conv channels, SSM heads).
        row_shape: the shape of one row (conv: `(state_len,)`; SSM: `(head_dim, d_state)`).
        dtype: the state's dtype.
        segments: the global sizes of the sub-projections along the rows, each split evenly
            over the ranks, or replicated where it has fewer rows than ranks (module
            docstring) (Mamba2 conv: `(x, B, C)`); empty: one, of `rows`.
    """

    rows: int
    row_shape: tuple[int, ...]
    dtype: torch.dtype
    segments: tuple[int, ...] = ()

    @property
    def parts(self) -> tuple[int, ...]:
        """The sub-projections' global rows (`segments`, or all rows as one)."""
        return self.segments or (self.rows,)

    @property
    def row_bytes(self) -> int:
        """Bytes of one row."""
        return math.prod(self.row_shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class StateLayout:
    """How one rank's recurrent layers keep their states in their pages.

    Attributes:
        components: the states of a layer, in page order.
        page_bytes: bytes from one block (page) of a layer to the next (vLLM: the padded page
            size shared with the attention layers).
        tp_size, tp_rank: this rank's tensor-parallel place.
        pp_size, pp_rank, layer_start, total_layers: its pipeline stage, as
            `KVCacheSpec`'s, counted in recurrent layers: the stage holds the model's recurrent
            layers `[layer_start, layer_start + len(pages))` of `total_layers` (0 without
            pipeline parallelism).
    """

    components: tuple[StateComponent, ...]
    page_bytes: int
    tp_size: int
    tp_rank: int
    pp_size: int = 1
    pp_rank: int = 0
    layer_start: int = 0
    total_layers: int = 0

    def __post_init__(self) -> None:
        for index, component in enumerate(self.components):
            if sum(component.parts) != component.rows:
                raise ValueError(
                    f"StateLayout: state {index}'s sub-projections {component.parts} do not add "
                    f"up to its {component.rows} rows"
                )
            for size in component.parts:
                if (size % self.tp_size) if size >= self.tp_size else (self.tp_size % size):
                    raise ValueError(
                        f"StateLayout: state {index} has a sub-projection of {size} rows, which "
                        f"TP {self.tp_size} cannot split evenly or replicate (a TP that divides "
                        "its rows, or that its rows divide)"
                    )
            if component.row_bytes % 2:
                raise ValueError(
                    f"StateLayout: state {index}'s rows are {component.row_bytes} bytes; kvxfer "
                    "moves rows of an even number of bytes"
                )
        if self.rank_bytes > self.page_bytes:
            raise ValueError(
                f"StateLayout: a rank's states take {self.rank_bytes} bytes, more than the "
                f"{self.page_bytes}-byte page"
            )

    @property
    def rank_bytes(self) -> int:
        """Bytes of this rank's states in a page."""
        return sum(
            rows_held(size, self.tp_size) * c.row_bytes for c in self.components for size in c.parts
        )

    def slices(self) -> list[tuple[int, int, int]]:
        """Per (state, sub-projection), in page order: `(byte offset in the page, global
        rows, row bytes)` of this rank's slice."""
        result, offset = [], 0
        for component in self.components:
            for size in component.parts:
                result.append((offset, size, component.row_bytes))
                offset += rows_held(size, self.tp_size) * component.row_bytes
        return result

    def specs(self, num_layers: int, num_blocks: int) -> list[KVCacheSpec]:
        """The cache spec of every (state, sub-projection), in page order."""
        return [
            KVCacheSpec(
                num_layers=num_layers,
                num_kv_heads=rows,
                head_dim=row_bytes // 2,
                dtype=_BYTES,
                tp_size=self.tp_size,
                tp_rank=self.tp_rank,
                block_size=1,
                num_blocks=num_blocks,
                layout="NHD",
                kv_placement="kv_inner",
                block_stride=self.page_bytes,
                pp_size=self.pp_size,
                pp_rank=self.pp_rank,
                layer_start=self.layer_start,
                total_layers=self.total_layers,
            )
            for _, rows, row_bytes in self.slices()
        ]

    def groups(self, pages: Sequence[torch.Tensor]) -> list[CacheGroup]:
        """This rank's state groups over its recurrent layers: one per (state,
        sub-projection), whose layer tensors are views into `pages`.

        Args:
            pages: one tensor per layer whose first axis is the block and whose blocks are
                `page_bytes` apart, each block's first bytes holding the states (vLLM: the
                registered `[blocks, 1, 1, content]` int8 view; a dense `[blocks, page_bytes]`
                uint8 tensor does too).

        Raises:
            ValueError: a page tensor that does not fit the layout.
        """
        if not pages:
            raise ValueError("StateLayout.groups: no layers; pass one page tensor per layer")
        num_blocks = int(pages[0].shape[0])
        rows = [_page_bytes(p, self.page_bytes, self.rank_bytes, num_blocks) for p in pages]
        groups = []
        for spec, (offset, _, row_bytes) in zip(
            self.specs(len(pages), num_blocks), self.slices(), strict=True
        ):
            local = spec.heads_per_rank
            views = [
                r[:, offset : offset + local * row_bytes]
                .view(spec.torch_dtype)
                .unflatten(1, (1, local, row_bytes))
                for r in rows
            ]
            groups.append(CacheGroup(spec, views, state=True))
        return groups


def rows_held(rows: int, tp_size: int) -> int:
    """Rows of a sub-projection one rank holds: its share, or one replicated row."""
    return max(1, rows // tp_size)


def _page_bytes(page: torch.Tensor, page_bytes: int, used: int, num_blocks: int) -> torch.Tensor:
    """`[blocks, used]` uint8 rows of a layer's pages (a view, never a copy)."""
    stride = page.stride(0) * page.element_size()
    if page.shape[0] != num_blocks or stride != page_bytes:
        raise ValueError(
            f"pages: {page.shape[0]} blocks {stride} bytes apart; every layer needs "
            f"{num_blocks} blocks {page_bytes} bytes apart"
        )
    flat = page.view(page.shape[0], -1)
    if flat.shape[1] * page.element_size() < used or flat.stride(1) != 1:
        raise ValueError(
            f"pages: a block holds {flat.shape[1] * page.element_size()} bytes, the states need "
            f"{used}"
        )
    return flat.view(torch.uint8)[:, :used]
