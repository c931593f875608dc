"""The named cell copies as values: `gather_kv`, `scatter_kv` and `remap_kv` are each a
`NamedCopy`, `copy_cells` behind the op's rule on which sides are paged.

A named copy runs as one Triton launch, or with `backend="torch"` as torch ops; each op's
`_torch` name (`gather_kv_torch`...) binds that backend: the reference the kernel is checked
against, and the CPU backend.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from kvxfer.kernels.buffers import KVBuffer
from kvxfer.kernels.copy_cells import copy_cells
from kvxfer.kernels.copy_cells_torch import copy_cells_torch

CopyBackend = Literal["triton", "torch"]

COPY_CELLS: dict[str, Callable[..., None]] = {"triton": copy_cells, "torch": copy_cells_torch}
"""Each backend's cell copy; both take `scales=` by keyword."""


@dataclass(frozen=True)
class NamedCopy:
    """A cell copy with a name and a rule (`gather_kv`: a paged cache into a dense buffer...).

    Attributes:
        name: the op's name, as `kvxfer.kernels` exports it.
        rule: raises ValueError, naming the argument at fault, where the two buffers are not
            the op's kinds (paged or dense).
    """

    name: str
    rule: Callable[[KVBuffer, KVBuffer], None]

    def __call__(
        self,
        src: KVBuffer,
        dst: KVBuffer,
        token_start: int,
        token_end: int,
        num_heads: int,
        scales: torch.Tensor | None = None,
        *,
        backend: CopyBackend = "triton",
    ) -> None:
        """Copy tokens `[token_start, token_end)` and `num_heads` heads of every layer (from
        each side's `head_offset`) from `src` to `dst`: one Triton launch, or torch ops with
        `backend="torch"`. Between two dtypes it converts, with the fp8 side's `scales` (see
        `copy_cells`); other cells keep their bytes.

        Raises:
            ValueError: the buffers are not the op's kinds, or the copy is invalid
                (`check_copy_pair`).
        """
        self.rule(src, dst)
        COPY_CELLS[backend](src, dst, token_start, token_end, num_heads, scales=scales)

    def __repr__(self) -> str:
        return f"kvxfer.kernels.{self.name}"
