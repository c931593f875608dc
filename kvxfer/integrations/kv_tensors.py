"""Read a serving engine's per-layer KV cache tensors as kvxfer's layout contract.

Engines hand connectors one tensor per attention layer in a *logical* shape and apply their
preferred memory order through strides (vLLM allocates the physical order and views it in the
logical shape). kvxfer needs the *physical* order, so it is read from the strides, never
assumed: any layout on either side is accepted, which is what lets a prefill engine with one
backend and layout feed a decode engine with another.

Logical shapes understood:
    `[num_blocks, heads, block_size, 2 * head_dim]`  vLLM 0.33 (`[B, H, N, C]`: K then V
                                                      in each cell); MLA: `heads` = 1, C = latent
    `[2, num_blocks, block_size, heads, head_dim]`   K/V planes first (older vLLM, FlashAttention)
    `[num_blocks, 2, block_size, heads, head_dim]`   blocks first (older FlashInfer, Triton)
    `[num_blocks, block_size, head_dim]`             MLA latent cache
Physical orders accepted: blocks (or K/V planes) outermost, then (slot, head) or (head, slot),
then each head's elements: vLLM's layer-compact layouts LBNHC (NHD) and LBHNC (HND), and the
four 5-D layouts of docs/design.md's table. Block-outermost layouts (BLNHC, ...) interleave layers
within a block and are refused with the setting that avoids them. Which physical order is which
(layout, kv_placement) comes from the layout contract's module, `kvxfer.layout`.

Dtypes: float16, bfloat16, float32, and fp8 caches. A float8_e4m3fn or float8_e5m2 tensor names
its format. vLLM allocates fp8 caches (`kv_cache_dtype` "fp8", "fp8_e4m3", "fp8_e5m2") as
uint8 tensors, whose bytes do not say which format they hold; the format then comes from
`EngineGeometry.kv_cache_dtype` (vLLM's `cache_config.cache_dtype`), and a uint8 cache without
it is refused with an error that names that setting. The format is part of the handshake, so
that both sides agree on what the bytes mean; an fp8 cache's per-layer scales (vLLM's
`k_scale`, `v_scale`) come with its tensors (`spec_from_layers(scales=...)`) and travel in the
spec, so a 16-bit engine and an fp8 engine pair and the kernels convert
(docs/kernels-and-layouts.md, "Dtype conversion").

Pipeline parallelism: a stage registers the caches of its own layers only, named by the model's
layers (vLLM: `model.layers.7.self_attn.attn`). `spec_from_layers` takes each tensor's model-layer
index (`layer_indices`) and places the stage in *KV-cache-layer space*: a layer's index there is
its place among the model's layers that hold a KV cache (`EngineGeometry.kv_layers`), which is
what `KVCacheSpec.layer_start` and `total_layers` count, on every engine alike. For a model whose
every layer holds a KV cache the two spaces are the same; for one with cache-less layers (no-op
attention) they differ, and counting in KV-cache-layer space keeps two engines that split the
model differently in agreement about which cache is which.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import msgspec
import torch

from kvxfer.layout import (
    BLOCK,
    CELL,
    CPU_PLACEMENTS,
    DIM,
    HEAD,
    KV_PLACEMENTS,
    LAYOUTS,
    PLANE,
    SLOT,
    layer_axes,
)
from kvxfer.spec import FP8_DTYPES, FP8Rounding, KVCacheSpec

_Item = TypeVar("_Item")  # a cache tensor, with what goes with it (`_place_layers`)

# The layout contract's K/V layouts by the axes of their tensors, outermost first (kv_inner:
# vLLM's LBNHC and LBHNC).
_PHYSICAL_ORDERS: dict[tuple[str, ...], tuple[str, str]] = {
    layer_axes(layout, placement, False): (layout, placement)
    for layout in LAYOUTS
    for placement in KV_PLACEMENTS
}
_LAYOUT_FIX = (
    "on vLLM start the engine with VLLM_KV_CACHE_LAYOUT=LBNHC (or LBHNC), the layer-compact "
    "layouts, in which each layer is one dense tensor"
)
_DTYPE_NAMES = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
}
# vLLM's `cache_dtype` settings whose caches are uint8 tensors holding one fp8 format.
_VLLM_FP8_BYTES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


@dataclass(frozen=True)
class EngineGeometry:
    """What the engine's configuration says about one rank's caches.

    Attributes:
        total_kv_heads: KV heads of the whole model (1 for MLA).
        head_dim: elements per head (the latent width for MLA).
        block_size: tokens per block.
        tp_size, tp_rank: this rank's tensor-parallel place.
        mla: whether the model uses a latent (MLA) cache.
        kv_cache_dtype: the engine's cache dtype setting (vLLM's `cache_config.cache_dtype`:
            "auto", "fp8", "fp8_e4m3", "fp8_e5m2", ...), or None. Read only for uint8 cache
            tensors, whose fp8 format it names ("fp8" and "fp8_e4m3": float8_e4m3fn;
            "fp8_e5m2": float8_e5m2).
        pp_size, pp_rank: this rank's pipeline stage (vLLM's `pipeline_parallel_size` and PP
            group rank); 1 and 0 without pipeline parallelism.
        kv_layers: the model-layer index of every layer of the whole model (every stage) that
            holds a KV cache, ascending: a layer's place in it is its index in KV-cache-layer
            space (the module's docstring). vLLM: every decoder layer except no-op attention
            layers. Empty: unknown, allowed without pipeline parallelism only (the registered
            layers are then the whole model).
        cpu_placement: the engine's CPU attention keeps each (block, head) in a placement of
            its own, "k_transposed" (K dim-major) or "amx_tiles" (tile groups), which its
            strides cannot show: they read as HND kv_inner. The engine's attention-backend
            table says so (`kvxfer.integrations.vllm.backends`), never the tensors. None:
            the strides show the placement.
        fp8_rounding: how the engine's cache write rounds into an fp8 cache
            (`KVCacheSpec.fp8_rounding`; vLLM CPU attention: "toward_zero"), from the same
            table; kept in the spec of fp8 caches only.
    """

    total_kv_heads: int
    head_dim: int
    block_size: int
    tp_size: int
    tp_rank: int
    mla: bool = False
    kv_cache_dtype: str | None = None
    pp_size: int = 1
    pp_rank: int = 0
    kv_layers: tuple[int, ...] = ()
    cpu_placement: str | None = None
    fp8_rounding: FP8Rounding = "nearest_even"

    def __post_init__(self) -> None:
        if self.pp_size < 1 or not 0 <= self.pp_rank < self.pp_size:
            raise ValueError(
                f"EngineGeometry: pp_rank {self.pp_rank} of pp_size {self.pp_size}; pass the "
                "engine's pipeline-parallel size (>= 1) and this rank's stage below it"
            )
        if list(self.kv_layers) != sorted(set(self.kv_layers)) or any(
            i < 0 for i in self.kv_layers
        ):
            raise ValueError(
                f"EngineGeometry.kv_layers: {list(self.kv_layers)[:16]} must be distinct "
                "non-negative model-layer indices in ascending order"
            )
        if self.pp_size > 1 and not self.kv_layers:
            raise ValueError(
                f"EngineGeometry.kv_layers: required with pp_size {self.pp_size}; pass the "
                "model-layer index of every layer of the model that holds a KV cache"
            )


def physical_layer(tensor: torch.Tensor, geometry: EngineGeometry) -> tuple[torch.Tensor, str, str]:
    """The layer tensor viewed in its physical order, with its (layout, kv_placement).

    Raises:
        ValueError: a shape or memory order that is not one of the module's layouts, naming
            what was found and what was expected.
    """
    if geometry.mla:
        return _mla_layer(tensor, geometry), "NHD", "kv_first"
    roles = _logical_roles(tensor, geometry)
    # Physical order: outermost axis first. Ties (size-1 axes) keep the logical order.
    strides = tensor.stride()
    order = sorted(range(tensor.dim()), key=lambda axis: (-strides[axis], axis))
    physical = tuple(roles[axis] for axis in order)
    found = _PHYSICAL_ORDERS.get(physical)
    if found is None:
        raise ValueError(
            f"cache tensor's memory order is {physical} (strides {tensor.stride()}); kvxfer "
            f"reads blocks or K/V outermost and head elements innermost; {_LAYOUT_FIX}"
        )
    return _contiguous_or_fail(tensor.permute(order), "cache tensor"), *found


def _mla_layer(tensor: torch.Tensor, geometry: EngineGeometry) -> torch.Tensor:
    latent = (geometry.block_size, geometry.head_dim)
    if tensor.dim() == 4 and tensor.shape[1] == 1:  # vLLM 0.33: [B, 1, N, C]
        tensor = tensor.squeeze(1)
    if tensor.dim() != 3 or tuple(tensor.shape[1:]) != latent:
        raise ValueError(
            f"MLA cache tensor has shape {tuple(tensor.shape)}; expected [num_blocks, "
            f"{geometry.block_size}, {geometry.head_dim}] or [num_blocks, 1, "
            f"{geometry.block_size}, {geometry.head_dim}] (block_size, latent width)"
        )
    return _contiguous_or_fail(tensor, "MLA cache tensor")


def _logical_roles(tensor: torch.Tensor, geometry: EngineGeometry) -> list[str]:
    heads = max(1, geometry.total_kv_heads // geometry.tp_size)
    shape = tuple(tensor.shape)
    if tensor.dim() == 4:
        cell = (heads, geometry.block_size, 2 * geometry.head_dim)
        if shape[1:] != cell:
            raise ValueError(
                f"cache tensor has shape {shape}; a [blocks, heads, block_size, 2 * head_dim] "
                f"view needs {cell} after the blocks; check block_size and the "
                "tensor-parallel size the connector was configured with"
            )
        return [BLOCK, HEAD, SLOT, CELL]
    if tensor.dim() != 5:
        raise ValueError(
            f"cache tensor has {tensor.dim()} dims (shape {shape}); expected [blocks, heads, "
            "block_size, 2 * head_dim], [2, blocks, block_size, heads, head_dim] or "
            "[blocks, 2, block_size, heads, head_dim]"
        )
    tail = (geometry.block_size, heads, geometry.head_dim)
    if shape[2:] != tail:
        raise ValueError(
            f"cache tensor has shape {shape}; its last three axes should be "
            f"(block_size, heads per rank, head_dim) = {tail}; check block_size and the "
            "tensor-parallel size the connector was configured with"
        )
    if shape[0] == 2:
        return [PLANE, BLOCK, SLOT, HEAD, DIM]
    if shape[1] == 2:
        return [BLOCK, PLANE, SLOT, HEAD, DIM]
    raise ValueError(f"cache tensor has shape {shape}; no K/V axis of size 2 among the first two")


def _contiguous_or_fail(tensor: torch.Tensor, what: str) -> torch.Tensor:
    if not tensor.is_contiguous():
        raise ValueError(
            f"{what} is not dense in its physical order (shape {tuple(tensor.shape)}, strides "
            f"{tensor.stride()}); kvxfer registers each layer as one memory region: "
            f"{_LAYOUT_FIX}"
        )
    return tensor


def spec_from_layers(
    layers: Sequence[torch.Tensor],
    geometry: EngineGeometry,
    layer_indices: Sequence[int] | None = None,
    scales: Sequence[tuple[float, float]] | None = None,
) -> tuple[KVCacheSpec, list[torch.Tensor]]:
    """The `KVCacheSpec` of one rank and its layer tensors in the spec's shape.

    Every layer must share one physical layout, dtype and block count: a rank has one spec.

    Args:
        layers: the rank's cache tensors, one per layer it holds.
        geometry: what the engine's configuration says (`EngineGeometry`).
        layer_indices: the model-layer index of each tensor (vLLM: `extract_layer_index` of
            the registered names), required with pipeline parallelism. The tensors come back
            in layer order, and the spec's `layer_start`, `num_layers` and `total_layers`
            count in KV-cache-layer space (`geometry.kv_layers`). None: the tensors are the
            whole model's layers, in order.
        scales: each tensor's `(k_scale, v_scale)` (vLLM: the attention layer's
            `_k_scale_float`, `_v_scale_float`), kept in the spec of an fp8 cache (MLA: the
            K scale) and ignored for others. None: 1.0.

    Raises:
        ValueError: no layers, mixed layouts or dtypes, a layout kvxfer cannot read, or layer
            indices that are not this stage's KV-cache layers, one each and consecutive.
    """
    if not layers:
        raise ValueError("no KV cache tensors were registered; pass one per attention layer")
    if scales is not None and len(scales) != len(layers):
        raise ValueError(
            f"scales: {len(scales)} (k_scale, v_scale) pairs for {len(layers)} cache tensors; "
            "pass one per tensor"
        )
    paired = list(zip(layers, scales or [(1.0, 1.0)] * len(layers), strict=True))
    placed, layer_start, total_layers = _place_layers(paired, geometry, layer_indices)
    layers = [tensor for tensor, _ in placed]
    views, layouts = [], []
    for tensor in layers:
        view, layout, placement = physical_layer(tensor, geometry)
        views.append(view)
        layouts.append((layout, placement, view.dtype, tuple(view.shape)))
    if len(set(layouts)) != 1:
        raise ValueError(
            f"layers differ in layout, dtype or shape: {sorted(set(map(str, layouts)))}; "
            "kvxfer needs one geometry per rank (one KV cache group)"
        )
    layout, placement, dtype, _ = layouts[0]
    if geometry.cpu_placement is not None and not geometry.mla:
        placement = _cpu_placement(layout, placement, geometry.cpu_placement)
    first = views[0]
    num_blocks = first.shape[layer_axes(layout, placement, geometry.mla).index(BLOCK)]
    spec = KVCacheSpec(
        num_layers=len(views),
        num_kv_heads=1 if geometry.mla else geometry.total_kv_heads,
        head_dim=geometry.head_dim,
        dtype=_dtype_name(dtype, geometry),  # type: ignore[arg-type]
        tp_size=geometry.tp_size,
        tp_rank=geometry.tp_rank,
        block_size=geometry.block_size,
        num_blocks=int(num_blocks),
        layout=layout,  # type: ignore[arg-type]
        kv_placement=placement,  # type: ignore[arg-type]
        mla=geometry.mla,
        pp_size=geometry.pp_size,
        pp_rank=geometry.pp_rank,
        layer_start=layer_start,
        total_layers=total_layers,
    )
    if dtype == torch.uint8:  # vLLM allocates fp8 caches as bytes: view them as their format
        views = [view.view(spec.torch_dtype) for view in views]
    if spec.dtype in FP8_DTYPES and scales is not None:
        k_scales = tuple(float(k) for _, (k, _) in placed)
        v_scales = () if spec.mla else tuple(float(v) for _, (_, v) in placed)
        spec = msgspec.structs.replace(spec, k_scales=k_scales, v_scales=v_scales)
    if spec.dtype in FP8_DTYPES:
        spec = msgspec.structs.replace(spec, fp8_rounding=geometry.fp8_rounding)
    return spec, views


def _cpu_placement(layout: str, placement: str, cpu_placement: str) -> str:
    """`cpu_placement` (one of `CPU_PLACEMENTS`), for tensors whose strides read as HND
    kv_inner (the shape and strides vLLM's CPU attention registers).

    Raises:
        ValueError: the strides read as another layout, so the table's layout cannot hold.
    """
    if cpu_placement not in CPU_PLACEMENTS:
        raise ValueError(
            f"EngineGeometry.cpu_placement: {cpu_placement!r} is not one of {CPU_PLACEMENTS}"
        )
    if (layout, placement) != ("HND", "kv_inner"):
        raise ValueError(
            f"the attention backend keeps its cache as {cpu_placement} in [blocks, heads, "
            f"block_size, 2 * head_dim] tensors, but these read as {layout}/{placement}; "
            "kvxfer does not know this backend's layout in this vLLM version: report it"
        )
    return cpu_placement


def _place_layers(
    layers: Sequence[_Item],
    geometry: EngineGeometry,
    layer_indices: Sequence[int] | None,
) -> tuple[list[_Item], int, int]:
    """The tensors (with what goes with each) in layer order, the first one's index in
    KV-cache-layer space, and the model's KV-cache layers (0 without pipeline parallelism, as
    `KVCacheSpec` counts)."""
    stage = f"pipeline stage {geometry.pp_rank} of {geometry.pp_size}"
    if layer_indices is None:
        if geometry.pp_size > 1:
            raise ValueError(
                f"{stage}: pass each cache tensor's model-layer index (layer_indices) with "
                "pipeline parallelism, so that the stage's layers are known"
            )
        if geometry.kv_layers and len(layers) != len(geometry.kv_layers):
            raise ValueError(
                f"{len(layers)} cache tensors registered for a model with "
                f"{len(geometry.kv_layers)} KV-cache layers (EngineGeometry.kv_layers); "
                "without pipeline parallelism a rank holds every layer"
            )
        return list(layers), 0, 0
    indices = [int(i) for i in layer_indices]
    if len(indices) != len(layers):
        raise ValueError(
            f"layer_indices: {len(indices)} indices for {len(layers)} cache tensors; pass one "
            "model-layer index per tensor"
        )
    if len(set(indices)) != len(indices):
        duplicates = sorted({i for i in indices if indices.count(i) > 1})
        raise ValueError(
            f"layer_indices: model layers {duplicates} have more than one cache tensor; "
            "kvxfer needs one tensor per layer (one KV cache group)"
        )
    order = sorted(range(len(indices)), key=indices.__getitem__)
    ordered = [indices[i] for i in order]
    if not geometry.kv_layers:  # without pipeline parallelism: the whole model, in order
        return [layers[i] for i in order], 0, 0
    kv_layers = geometry.kv_layers
    place = {layer: k for k, layer in enumerate(kv_layers)}
    unknown = [i for i in ordered if i not in place]
    if unknown:
        raise ValueError(
            f"layer_indices: model layers {unknown[:8]} hold no KV cache according to the "
            f"model's configuration (EngineGeometry.kv_layers: {len(kv_layers)} layers); "
            "check the registered layer names"
        )
    start = place[ordered[0]]
    if [place[i] for i in ordered] != list(range(start, start + len(ordered))):
        missing = [
            layer for layer in kv_layers[start : place[ordered[-1]] + 1] if layer not in indices
        ]
        raise ValueError(
            f"{stage}: its cache tensors skip model layers {missing[:8]}; a stage holds "
            "consecutive layers: check the registered layer names"
        )
    if geometry.pp_size == 1:
        if len(ordered) != len(kv_layers):
            raise ValueError(
                f"{len(ordered)} cache tensors (model layers {ordered[0]}..{ordered[-1]}) "
                f"registered for a model with {len(kv_layers)} KV-cache layers; without "
                "pipeline parallelism a rank holds every layer"
            )
        return [layers[i] for i in order], 0, 0
    return [layers[i] for i in order], start, len(kv_layers)


def _dtype_name(dtype: torch.dtype, geometry: EngineGeometry) -> str:
    """The spec's dtype name of a cache tensor's dtype (uint8: the fp8 format the engine's
    `kv_cache_dtype` names; see the module's docstring)."""
    if dtype == torch.uint8:
        setting = geometry.kv_cache_dtype
        if setting not in _VLLM_FP8_BYTES:
            raise ValueError(
                f"cache tensors are uint8 with kv_cache_dtype {setting!r}: kvxfer reads uint8 "
                "caches as fp8 bytes, whose format the bytes do not tell; pass "
                "EngineGeometry(kv_cache_dtype=...) with the engine's setting (vLLM's "
                f"cache_config.cache_dtype: one of {sorted(_VLLM_FP8_BYTES)})"
            )
        return _VLLM_FP8_BYTES[setting]
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        raise ValueError(
            f"cache dtype {dtype} is not supported; use one of {sorted(_DTYPE_NAMES.values())} "
            "(or uint8 fp8 bytes with EngineGeometry.kv_cache_dtype)"
        )
    setting = _VLLM_FP8_BYTES.get(geometry.kv_cache_dtype or "")
    if name.startswith("float8") and setting is not None and setting != name:
        raise ValueError(
            f"cache tensors are {name} but kv_cache_dtype {geometry.kv_cache_dtype!r} names "
            f"{setting}; pass the engine's own cache dtype setting"
        )
    return name
