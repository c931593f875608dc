"""What kvxfer's SGLang manager reads from SGLang besides the pools' pointers: its settings
(`KVXFER_CONFIG`), which of `KVArgs`' buffers are the target's and the draft's pools, the
model facts a pool's spec needs (`SGLangModel`), and the pools' device."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
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
    sliding-window pool (`SWAKVPool`'s window layers) beside full attention in bf16, fp16 or
    fp32, or one Mamba state (`MambaPool`'s, of the target model) beside full attention of
    any KV dtype (its pool's layer ids say whose scales: `pool_layer_ids`).

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
    if kinds == [SWA] and kv_args.kv_cache_dtype_str.startswith("fp8"):
        raise ValueError(
            f"an fp8 hybrid model ({kinds[0]}): kvxfer's SGLang backend has not verified the "
            "scales of its window layers; serve it with --kv-cache-dtype auto"
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
    ids = pool_layer_ids(kv_args, pool_layers)
    layers: Sequence[int] | int = pool_layers if draft else ids
    k_scales, v_scales = scales_of(layers, draft) if dtype in FP8_DTYPES else ((), ())
    start, total = (0, pool_layers) if draft else _pool_place(config, kv_args, ids)
    if is_mla:
        # The latent width (kv_lora_rank + qk_rope_head_dim) is the pool's row.
        row = kv_args.kv_item_lens[entries.start] // kv_args.page_size
        head_dim = row // DTYPE_ITEMSIZE[dtype]
        return SGLangModel(1, head_dim, total, dtype, True, k_scales, layer_start=start)
    heads = config.get_total_num_kv_heads()
    return SGLangModel(heads, config.head_dim, total, dtype, False, k_scales, v_scales, start)


def _pool_place(config: Any, kv_args: KVArgs, layers: Sequence[int]) -> tuple[int, int]:
    """The target pool's first layer among the model's layers of its kind, and their count (a
    pipeline stage's place): a Mamba model's pool keeps the full-attention layers alone
    (SGLang's `full_attention_layer_ids`, where the pool's layer ids are found); any other pool
    every layer.

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
    return getattr(kv_args, "prefill_start_layer", 0) or 0, config.num_hidden_layers


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
