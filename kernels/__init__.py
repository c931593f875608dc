"""kvxfer.kernels: gather, scatter and remap of paged KV caches, in Triton and in torch."""

from kvxfer.kernels.copy_cells import check_launchable, copy_cells, tile_sizes
from kvxfer.kernels.copy_cells_torch import copy_cells_torch
from kvxfer.kernels.gather_kv import gather_kv, gather_kv_torch
from kvxfer.kernels.layout import KVBuffer, canonical_kv_view, check_cell_copy, wire_kv_buffer
from kvxfer.kernels.remap_kv import remap_kv, remap_kv_torch
from kvxfer.kernels.scatter_kv import scatter_kv, scatter_kv_torch

__all__ = [
    "KVBuffer",
    "canonical_kv_view",
    "check_cell_copy",
    "check_launchable",
    "copy_cells",
    "copy_cells_torch",
    "gather_kv",
    "gather_kv_torch",
    "remap_kv",
    "remap_kv_torch",
    "scatter_kv",
    "scatter_kv_torch",
    "tile_sizes",
    "wire_kv_buffer",
]
