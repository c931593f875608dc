"""What kvxfer's SGLang manager reads from SGLang besides the pools' pointers: its settings
(`KVXFER_CONFIG`), which of `KVArgs`' buffers are the target's and the draft's pools, the
model facts a pool's spec needs (`SGLangModel`), and the pools' device."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvxfer.integrations.settings import ConnectorSettings
from kvxfer.integrations.sglang.loaded import scales_of
from kvxfer.integrations.sglang.mamba import MAMBA
from kvxfer.integrations.sglang.pools import SGLangModel, kv_dtype_name, window_table
from kvxfer.spec import DTYPE_ITEMSIZE, FP8_DTYPES

if TYPE_CHECKING:
    from sglang.srt.disaggregation.base.conn import KVArgs

    from kvxfer.connector.groups import CacheGroup

SWA = "swa"  # SGLang's StateType.SWA: the window layers' pool (SWAKVPool)
CONFIG_ENV = "KVXFER_CONFIG"  # JSON of kvxfer's connector settings (docs/sglang.md)


def load_settings() -> ConnectorSettings:
    """kvxfer's settings for SGLang, from `KVXFER_CONFIG` (JSON, the keys of vLLM's
    `kv_connector_extra_config`; SGLang has no per-backend configuration)."""
    raw = os.environ.get(CONFIG_ENV, "")
    try:
        extra = json.loads(raw) if raw else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"{CONFIG_ENV}: not JSON ({exc}); pass an object of settings") from None
    return ConnectorSettings.from_extra_config(extra)


def pool_entries(kv_args: KVArgs) -> tuple[slice, slice]:
    """Which of `KVArgs`' KV buffers are the target model's pool and which the draft model's:
    SGLang appends the draft pool's (speculative decoding, `num_draft_entries`)."""
    target = len(kv_args.kv_data_ptrs) - (getattr(kv_args, "num_draft_entries", 0) or 0)
    return slice(0, target), slice(target, len(kv_args.kv_data_ptrs))


def state_kinds(kv_args: KVArgs) -> list[str]:
    """The kinds of the state pools SGLang registered beside the KV pool (`KVArgs.state_types`:
    "swa", "mamba"...), in their order."""
    return [str(getattr(t, "value", t)) for t in getattr(kv_args, "state_types", None) or []]


def check_state_kinds(kv_args: KVArgs) -> None:
    """Refuse the hybrid state kvxfer's SGLang backend does not move: everything but one
    sliding-window pool (`SWAKVPool`'s window layers) or one Mamba state (`MambaPool`'s, of
    the target model) beside full attention, of any KV dtype (the layers' global ids say whose
    scales: `pool_layer_ids`, `window_split`).

    Raises:
        ValueError: naming the kinds and the fix.
    """
    kinds = state_kinds(kv_args)
    if kinds and kinds not in ([SWA], [MAMBA]):
        raise ValueError(
            f"this model keeps hybrid state ({', '.join(kinds)}) beside its KV cache; kvxfer's "
            "SGLang backend moves full-attention KV with one sliding-window pool or one Mamba "
            "state, not the other kinds (nor a draft model's window pool or Mamba state): "
            "serve it with another transfer backend"
        )


def model_of(
    server_args: Any, kv_args: KVArgs, is_mla: bool, draft: bool = False, config: Any = None
) -> SGLangModel:
    """What a pool's pointers do not say, from SGLang's `ModelConfig`: the target model's pool
    (`config`, its `ModelConfig` if already read), or with `draft` the draft model's (its layers
    those of its pool, in order).

    Raises:
        ValueError: hybrid state other than one sliding-window pool (`check_state_kinds`), or
            an fp8 pool whose model's scales were not recorded (`scales_of`).
    """
    from sglang.srt.configs.model_config import ModelConfig

    check_state_kinds(kv_args)
    entries = pool_entries(kv_args)[1 if draft else 0]
    if draft:  # an MTP model's draft is its own checkpoint's next-token layers
        path = server_args.speculative_draft_model_path or server_args.model_path
        config = ModelConfig.from_server_args(server_args, model_path=path, is_draft_model=True)
    elif config is None:
        config = ModelConfig.from_server_args(server_args)
    dtype = kv_dtype_name(kv_args.kv_cache_dtype_str, config.dtype)
    pool_layers = (entries.stop - entries.start) // (1 if is_mla else 2)
    # An fp8 pool's spec carries its layers' scales (what a converting transfer divides or
    # multiplies by): a pipeline stage's layers (MHA: a K and a V buffer each), or the draft's.
    ids: Sequence[int]
    if not draft and state_kinds(kv_args) == [SWA]:  # the full pool's layers
        ids = window_split(config, kv_args, is_mla, server_args.pp_size).stage_full
    else:
        ids = pool_layer_ids(kv_args, pool_layers)
    layers: Sequence[int] | int = pool_layers if draft else ids
    k_scales: tuple[float, ...] = ()
    v_scales: tuple[float, ...] = ()
    if dtype in FP8_DTYPES:
        k_scales, v_scales = latent_scales(layers, draft) if is_mla else scales_of(layers, draft)
    start, total = (0, pool_layers) if draft else _pool_place(config, kv_args, ids)
    if is_mla:
        # The latent width (kv_lora_rank + qk_rope_head_dim) is the pool's row.
        row = kv_args.kv_item_lens[entries.start] // kv_args.page_size
        head_dim = row // DTYPE_ITEMSIZE[dtype]
        return SGLangModel(1, head_dim, total, dtype, True, k_scales, layer_start=start)
    heads = config.get_total_num_kv_heads()
    return SGLangModel(heads, config.head_dim, total, dtype, False, k_scales, v_scales, start)


def latent_scales(
    layers: Sequence[int] | int, draft: bool = False
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """An fp8 MLA pool's scales (K: the latent's; no V): 1.0 for every layer, where every
    layer's recorded `k_scale` is 1.0 (a checkpoint without MLA KV scales, as DeepSeek's).
    SGLang's MLA attention backends write a latent in two ways: `MLATokenToKVPool` casts it
    (FlashInfer, FlashMLA, TRT-LLM), the Triton backend divides it by `k_scale` first. With
    scales of 1.0 the two agree; with others the pool does not say which one wrote it.

    Raises:
        ValueError: a layer's `k_scale` other than 1.0, naming the layers and the fix.
    """
    k_scales, _ = scales_of(layers, draft)
    ids = range(layers) if isinstance(layers, int) else layers
    other = {layer: k for layer, k in zip(ids, k_scales, strict=True) if k != 1.0}
    if other:
        raise ValueError(
            f"an fp8 MLA pool whose model has KV scales other than 1.0 (k_scale by layer: "
            f"{other}): SGLang's MLA attention backends write the latent differently with them "
            "(Triton divides it by k_scale, FlashInfer, FlashMLA and TRT-LLM cast it), and the "
            "pool does not say which wrote it; kvxfer does not guess: serve with "
            "--kv-cache-dtype auto, or a checkpoint without MLA KV scales"
        )
    return k_scales, ()


def _pool_place(config: Any, kv_args: KVArgs, layers: Sequence[int]) -> tuple[int, int]:
    """The target pool's first layer among the model's layers of its kind, and their count (a
    pipeline stage's place): a Mamba model's pool keeps the full-attention layers alone
    (SGLang's `full_attention_layer_ids`, where the pool's layer ids are found), and so does a
    sliding-window model's (`window_split`); any other pool every layer.

    Raises:
        ValueError: a Mamba model's pool whose layers are not among its full-attention layers.
    """
    if state_kinds(kv_args) == [MAMBA]:
        from sglang.srt.configs.hybrid_arch import mambaish_config

        full = list(getattr(mambaish_config(config), "full_attention_layer_ids", None) or [])
        if not (layers and layers[0] in full):
            raise ValueError(
                f"a Mamba model's KV pool of layers {list(layers)}, not among its "
                f"full-attention layers {full}: not a layout kvxfer's SGLang backend has "
                "verified (it moves the state beside a KV pool)"
            )
        return full.index(layers[0]), len(full)
    if state_kinds(kv_args) == [SWA]:
        full = config.full_attention_layer_ids
        return full.index(layers[0]), len(full)
    return getattr(kv_args, "prefill_start_layer", 0) or 0, config.num_hidden_layers


@dataclass(frozen=True)
class WindowSplit:
    """A sliding-window model's layers, as SGLang's `SWAKVPool` keeps them (global ids).

    Attributes:
        full, window: the model's full-attention and window layers (SGLang's `ModelConfig`:
            `full_attention_layer_ids`, `swa_attention_layer_ids`).
        stage_full, stage_window: those of this rank's pipeline stage, in the order of its
            full pool's and its window pool's buffers.
    """

    full: list[int]
    window: list[int]
    stage_full: list[int]
    stage_window: list[int]


def window_split(config: Any, kv_args: KVArgs, mla: bool, pp_size: int) -> WindowSplit:
    """Which layers a sliding-window pool's two pools hold: SGLang's split of the model's
    layers, cut to the pipeline stage as its model runner cuts it (the layers the stage's model
    owns: SGLang's `get_pp_indices` for `KVArgs.pp_rank` of `pp_size`, which honours
    `SGLANG_PP_LAYER_PARTITION`; a `SWAKVPool`'s `prefill_start_layer` is 0 on every stage).

    Raises:
        ValueError: SGLang's `ModelConfig` names no split (not a model SGLang keeps in a
            `SWAKVPool`), or the stage's layers of each kind are not what its pools hold.
    """
    from sglang.srt.distributed.utils import get_pp_indices

    full = list(getattr(config, "full_attention_layer_ids", None) or [])
    window = list(getattr(config, "swa_attention_layer_ids", None) or [])
    per_layer = 1 if mla else 2
    held_full = pool_entries(kv_args)[0].stop // per_layer  # the target's (a draft's follow)
    held_window = len(kv_args.state_data_ptrs[0]) // per_layer
    pp_rank = getattr(kv_args, "pp_rank", 0) or 0
    owned = range(*get_pp_indices(config.num_hidden_layers, pp_rank, pp_size))
    split = WindowSplit(
        full, window, [i for i in full if i in owned], [i for i in window if i in owned]
    )
    if not window or len(split.stage_full) != held_full or len(split.stage_window) != held_window:
        raise ValueError(
            f"a sliding-window pool of {held_full} full and {held_window} window layers on "
            f"pipeline stage {pp_rank} of {pp_size} (layers {owned.start}-{owned.stop - 1}), "
            f"but SGLang's model config splits the model's layers as full {full} and window "
            f"{window}: not a layout kvxfer's SGLang backend has verified"
        )
    if not split.stage_window:
        raise ValueError(
            f"pipeline stage of layers {list(owned)} keeps no window layer: kvxfer's SGLang "
            "backend moves a sliding-window pool with layers; serve the prefill with stages "
            "that each hold window layers"
        )
    return split


def pool_layer_ids(kv_args: KVArgs, pool_layers: int) -> Sequence[int]:
    """The target pool's layers, as global layer ids, in order: SGLang's `kv_layer_ids` of its
    K buffers where it gives them (a hybrid model's pool holds its full-attention layers
    alone), else the pipeline stage's layers from `prefill_start_layer` on."""
    ids = list(getattr(kv_args, "kv_layer_ids", None) or [])
    if ids:
        return ids[:pool_layers]
    start = getattr(kv_args, "prefill_start_layer", 0) or 0
    return range(start, start + pool_layers)


def pool_device(server_args: Any, kv_args: KVArgs) -> str:
    """Where SGLang keeps the pools: `cuda:<gpu_id>`, or the server's device."""
    device = getattr(server_args, "device", None) or "cuda"
    return f"cuda:{kv_args.gpu_id}" if device == "cuda" else str(device)


def group_tables(
    groups: Sequence[CacheGroup], kv_pages: np.ndarray, state_indices: Any, num_tokens: int
) -> list[np.ndarray]:
    """Every group's block table for a request of `num_tokens` tokens: `kv_pages` for the
    full-attention groups (the target's and the draft's share its pages); from SGLang's state
    indices (one list, its one state's), the request's sliding-window pages (`window_table`)
    for a window group, its Mamba slot for a state group."""
    indices = state_indices[0] if state_indices else ()
    tables = []
    for group in groups:
        if group.state:
            # SGLang hands a slot as a 0-d array (`_mamba_payload` of an int pool index)
            slot = np.asarray(indices, dtype=np.int64).reshape(-1)
            if slot.size != 1:
                raise ValueError(f"Mamba state indices {slot.tolist()}: expected one slot")
            tables.append(slot)
        elif group.sliding_window is not None:
            pages = window_table(indices, num_tokens, group.spec.block_size)
            tables.append(np.asarray(pages))
        else:
            tables.append(kv_pages)
    return tables
