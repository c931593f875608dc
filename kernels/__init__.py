"""kvxfer.kernels: gather, scatter and remap of paged KV caches, in Triton and in torch."""

from kvxfer.kernels.buffers import (
    KVBuffer,
    StackedLayers,
    canonical_kv_view,
    wire_kv_buffer,
)
from kvxfer.kernels.cell_copy_flags import tile_tokens
from kvxfer.kernels.copy_cells import (
    CellCopyLaunch,
    check_launchable,
    copy_cells,
    prepare_cell_copy,
)
from kvxfer.kernels.copy_cells_torch import copy_cells_torch
from kvxfer.kernels.gather_kv import gather_kv, gather_kv_torch
from kvxfer.kernels.remap_kv import remap_kv, remap_kv_torch
from kvxfer.kernels.scatter_kv import scatter_kv, scatter_kv_torch

__all__ = [
    "CellCopyLaunch",
    "KVBuffer",
    "StackedLayers",
    "canonical_kv_view",
    "check_launchable",
    "copy_cells",
    "copy_cells_torch",
    "gather_kv",
    "gather_kv_torch",
    "prepare_cell_copy",
    "remap_kv",
    "remap_kv_torch",
    "scatter_kv",
    "scatter_kv_torch",
    "tile_tokens",
    "wire_kv_buffer",
]
