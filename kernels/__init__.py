"""kvxfer.kernels: gather, scatter and remap of paged KV caches (Triton, and torch for CPU)."""

from kvxfer.kernels.layout import canonical_kv_view
from kvxfer.kernels.remap_kv_torch import remap_kv_torch

__all__ = ["canonical_kv_view", "remap_kv_torch"]
