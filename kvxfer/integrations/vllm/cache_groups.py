"""vLLM's KV cache configuration as kvxfer's groups: pure functions of the registered layer
tensors, vLLM's `KVCacheConfig` and the layers' attention backends, with no engine.

Each of vLLM's KV cache groups (hybrid memory allocator: full-attention and sliding-window
layers, each group with its own block table) is moved by a producer and consumer of its own
(`kvxfer.connector.groups`); a sliding-window group moves only the tokens inside its window. A
Mamba group becomes one state group per (state, sub-projection) (`kvxfer.state`), whose table
is the one block of vLLM's group holding the state (`group_tables`). A worker registers one
side channel per group, in vLLM's group order.

An attention group's layout is never read from the strides alone: the layers' attention
backend names it (the table of `kvxfer.integrations.vllm.backends`), and the strides are
checked against it (`kvxfer.integrations.kv_tensors.spec_from_layers`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from kvxfer.connector import CacheGroup
from kvxfer.integrations.kv_tensors import EngineGeometry, spec_from_layers
from kvxfer.integrations.vllm.backends import engine_fp8_rounding, engine_reading
from kvxfer.layout import CPU_PLACEMENTS
from kvxfer.state import StateComponent, StateLayout

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

# Each layer's attention backend (`get_name()`) and, on CPU attention, its instruction set, as
# `kvxfer.integrations.vllm.engine_config.attention_backends` reads them from vLLM.
Backends = dict[str, tuple[str, str | None]]


class TableSource(NamedTuple):
    """Where one kvxfer group's block table comes from: the vLLM KV cache group whose table it
    uses, and for a state group that group's block size (its table is positional: the state
    is in the block of the last token)."""

    vllm_group: int
    state_block_size: int | None = None


def cache_groups(
    kv_caches: dict[str, torch.Tensor],
    kv_cache_config: KVCacheConfig | None,
    geometry: EngineGeometry,
    backends: Backends,
    *,
    conv_state_dim_first: bool | None = None,
    scales: dict[str, tuple[float, float]] | None = None,
) -> tuple[list[CacheGroup], list[TableSource]]:
    """This worker's KV cache groups, in vLLM's group order, and where each one's block table
    comes from (`TableSource`, read by `group_tables`): each attention group's registered
    layers with its own spec (block size included) and its sliding window, if any; a Mamba
    group becomes one state group per (state, sub-projection) (`mamba_state_layout`).
    Without a `kv_cache_config` (or with one group), every registered layer is one group.
    `backends` are the layers' attention backends (`geometry.attention_backends`): an attention
    group's layout comes from their table, the strides are checked against it.
    `conv_state_dim_first` is passed to `mamba_state_layout` (None: vLLM's setting). `scales`:
    each attention layer's `(k_scale, v_scale)` (`geometry.attention_scales`), kept in an fp8
    group's spec.

    Raises:
        ValueError: a group kvxfer cannot move, or several groups with pipeline parallelism,
            naming the group and the fix.
    """
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    groups = list(kv_cache_config.kv_cache_groups) if kv_cache_config is not None else []
    if len(groups) <= 1:
        layers = list(kv_caches)
        window = window_of(groups[0].kv_cache_spec) if groups else None
        spec, caches = spec_from_layers(
            list(kv_caches.values()),
            attention_geometry(geometry, layers, backends),
            layer_indices(layers, geometry.pp_size),
            _scales_of(layers, scales),
        )
        return [CacheGroup(spec, caches, window)], [TableSource(0)]
    if geometry.pp_size > 1:
        raise ValueError(
            f"kvxfer: {len(groups)} KV cache groups with pipeline parallelism are not "
            "supported; run the model with pipeline_parallel_size 1, or disable the hybrid "
            "KV cache manager (--disable-hybrid-kv-cache-manager)"
        )
    result: list[CacheGroup] = []
    tables: list[TableSource] = []
    for index, group in enumerate(groups):
        kind = group.kv_cache_spec
        names = [name for name in group.layer_names if name in kv_caches]
        if not names:
            raise ValueError(
                f"kvxfer: none of KV cache group {index}'s layers ({group.layer_names[:4]}) "
                "was registered; register every layer's cache"
            )
        if isinstance(kind, MambaSpec):
            state = mamba_state_layout(
                kind,
                geometry.tp_size,
                geometry.tp_rank,
                index,
                conv_state_dim_first=conv_state_dim_first,
            )
            added = state.groups([kv_caches[n] for n in names])
            result.extend(added)
            tables.extend([TableSource(index, int(kind.block_size))] * len(added))
            continue
        if not isinstance(kind, (FullAttentionSpec, SlidingWindowSpec)):
            raise ValueError(
                f"kvxfer: KV cache group {index} is a {type(kind).__name__}; kvxfer moves "
                "full-attention, sliding-window and Mamba groups"
            )
        own = attention_geometry(
            dataclasses.replace(geometry, block_size=int(kind.block_size)), names, backends
        )
        spec, caches = spec_from_layers(
            [kv_caches[n] for n in names],
            own,
            layer_indices(names, geometry.pp_size),
            _scales_of(names, scales),
        )
        result.append(CacheGroup(spec, caches, window_of(kind)))
        tables.append(TableSource(index))
    return result, tables


def layer_positions(
    kv_caches: dict[str, torch.Tensor], kv_cache_config: KVCacheConfig | None, pp_size: int
) -> dict[str, tuple[int, int]]:
    """Each attention layer's kvxfer group and local index in it (the order `cache_groups`
    gives a group's layers: by model-layer index when the names give one each, else vLLM's),
    for marking layers ready as vLLM's forward pass saves them (`save_kv_layer`). Empty for a
    configuration with a Mamba group (its state is written whole, never streamed)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    groups = list(kv_cache_config.kv_cache_groups) if kv_cache_config is not None else []
    if len(groups) <= 1:
        names_by_group = [list(kv_caches)]
    elif any(isinstance(g.kv_cache_spec, MambaSpec) for g in groups):
        return {}
    else:
        names_by_group = [[n for n in g.layer_names if n in kv_caches] for g in groups]
    positions: dict[str, tuple[int, int]] = {}
    for group, names in enumerate(names_by_group):
        indices = layer_indices(names, pp_size)
        ordered = (
            names if indices is None else [n for _, n in sorted(zip(indices, names, strict=True))]
        )
        positions.update((name, (group, local)) for local, name in enumerate(ordered))
    return positions


def group_tables(
    sources: Sequence[TableSource], vllm_tables: Sequence[list[int]], num_tokens: int
) -> list[list[int]]:
    """Each kvxfer group's block table, from vLLM's per-group tables: a Mamba group's table
    serves each of its state groups, as the one block holding the state after `num_tokens`
    tokens (vLLM's mamba_cache_mode "none" keeps it in the block of the last token; the
    entries before it are the null block)."""
    tables = []
    for index, state_block_size in sources:
        table = vllm_tables[index]
        if state_block_size is not None:
            table = [table[(num_tokens - 1) // state_block_size]]
        tables.append(table)
    return tables


def mamba_state_layout(
    kind: Any,
    tp_size: int,
    tp_rank: int,
    index: int = 0,
    *,
    conv_state_dim_first: bool | None = None,
) -> StateLayout:
    """How a vLLM `MambaSpec` group keeps its states in its pages, with the conv state's
    sub-projections: Mamba1 `[x]`, Mamba2 `[x, B, C]` (x from the SSM state: heads x
    head_dim; B and C share the rest), gated delta net `[Q, K, V]` (V from the SSM state: value
    heads x value head dim; Q and K share the rest). `conv_state_dim_first` says whether the
    conv state is stored channels first (None: vLLM's setting, `VLLM_SSM_CONV_STATE_LAYOUT`).

    Raises:
        ValueError: a layout kvxfer cannot move, naming the fix: the conv state stored
            state-len-major (`VLLM_SSM_CONV_STATE_LAYOUT=DS` stores it channel-major, as vLLM's
            own heterogeneous-TP transfers require), a `mamba_cache_mode` other than "none",
            speculative state blocks, a state replicated over the ranks, another Mamba type.
    """
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    if conv_state_dim_first is None:
        from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

        conv_state_dim_first = is_conv_state_dim_first()
    where = f"kvxfer: KV cache group {index} (Mamba)"
    if not conv_state_dim_first:
        raise ValueError(
            f"{where}: the conv state is stored (state_len, channels); set "
            "VLLM_SSM_CONV_STATE_LAYOUT=DS on both engines (channels first: each rank's slice "
            "of a sub-projection is then one run of bytes)"
        )
    if kind.mamba_cache_mode != "none" or kind.num_speculative_blocks:
        raise ValueError(
            f"{where}: mamba_cache_mode {kind.mamba_cache_mode!r} with "
            f"{kind.num_speculative_blocks} speculative blocks; kvxfer moves the one state "
            "block of mamba_cache_mode 'none' without speculative decoding"
        )
    if getattr(kind, "tp_replicated", False):
        raise ValueError(f"{where}: a state replicated over TP ranks is not supported")
    if len(kind.shapes) != 2:
        raise ValueError(f"{where}: {len(kind.shapes)} states per layer; kvxfer moves conv + SSM")
    (conv_local, state_len), ssm_shape = kind.shapes
    conv_rows, ssm_rows = conv_local * tp_size, ssm_shape[0] * tp_size
    mamba = MambaAttentionBackendEnum
    if kind.mamba_type == mamba.MAMBA1:
        segments: tuple[int, ...] = (conv_rows,)
    elif kind.mamba_type == mamba.MAMBA2:
        x = ssm_rows * ssm_shape[1]
        segments = (x, (conv_rows - x) // 2, (conv_rows - x) // 2)
    elif kind.mamba_type == mamba.GDN_ATTN:
        v = ssm_rows * ssm_shape[1]
        segments = ((conv_rows - v) // 2, (conv_rows - v) // 2, v)
    else:
        raise ValueError(f"{where}: mamba_type {kind.mamba_type} is not supported")
    if sum(segments) != conv_rows or min(segments) <= 0:
        raise ValueError(
            f"{where}: conv channels {conv_rows} do not split into sub-projections "
            f"{segments} for {kind.mamba_type}"
        )
    conv_dtype, ssm_dtype = kind.dtypes
    return StateLayout(
        (
            StateComponent(conv_rows, (state_len,), conv_dtype, segments),
            StateComponent(ssm_rows, tuple(ssm_shape[1:]), ssm_dtype),
        ),
        int(kind.page_size_bytes),
        tp_size,
        tp_rank,
    )


def _scales_of(
    names: list[str], scales: dict[str, tuple[float, float]] | None
) -> list[tuple[float, float]] | None:
    """The layers' (k_scale, v_scale), 1.0 where a layer has none; None without scales."""
    if scales is None:
        return None
    return [scales.get(name, (1.0, 1.0)) for name in names]


def attention_geometry(
    geometry: EngineGeometry, names: list[str], backends: Backends
) -> EngineGeometry:
    """`geometry` with what the layers' attention backend says of their layout (the table of
    `kvxfer.integrations.vllm.backends`): never read from the strides alone.

    Raises:
        ValueError: a layer without a known backend, a backend or setting the table refuses,
            or a reading that contradicts the model (a latent cache without MLA, or back).
    """
    unknown = [name for name in names if name not in backends]
    if unknown:
        raise ValueError(
            f"kvxfer: cannot tell the attention backend of layers {unknown[:4]} (not in vLLM's "
            "forward context); kvxfer reads each backend's KV layout from its table and "
            "refuses to guess it from the strides"
        )
    reading = engine_reading(
        ((name, *backends[name]) for name in names), geometry.kv_cache_dtype or "auto"
    )
    if (reading == "latent") != geometry.mla:
        raise ValueError(
            f"kvxfer: attention backend {backends[names[0]][0]} keeps a {reading} cache, but "
            f"the model {'uses' if geometry.mla else 'does not use'} MLA"
        )
    return dataclasses.replace(
        geometry,
        cpu_placement=reading if reading in CPU_PLACEMENTS else None,
        fp8_rounding=engine_fp8_rounding(backends[names[0]][0]),
    )


def window_of(kind: Any) -> int | None:
    """A vLLM group spec's sliding window in tokens (None: full attention)."""
    window = getattr(kind, "sliding_window", None)
    return int(window) if window else None


def layer_indices(names: list[str], pp_size: int) -> list[int] | None:
    """The model-layer index of each registered cache, from its name (vLLM's
    `extract_layer_index`: `model.layers.7.self_attn.attn` is layer 7). Without pipeline
    parallelism, None when the names do not give one index each (the caches are then taken
    in vLLM's order, as they always were).

    Raises:
        ValueError: with pipeline parallelism, a name without its layer's index.
    """
    from vllm.model_executor.models.utils import extract_layer_index

    try:
        indices = [int(extract_layer_index(name)) for name in names]
    except (AssertionError, ValueError, IndexError) as exc:
        if pp_size == 1:
            return None
        raise ValueError(
            f"kvxfer: pipeline parallelism needs each KV cache's layer index in its name; "
            f"cannot read one from {names[:4]}: {exc}"
        ) from None
    if pp_size == 1 and len(set(indices)) != len(indices):
        return None  # several caches per layer: not placed by name (one group checks them)
    return indices
