"""What kvxfer's SGLang manager reads from SGLang besides the pools' pointers: its settings
(`KVXFER_CONFIG`), which of `KVArgs`' buffers are the target's and the draft's pools, the
model facts a pool's spec needs (`SGLangModel`), and the pools' device."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from kvxfer.integrations.settings import ConnectorSettings
from kvxfer.integrations.sglang.pools import SGLangModel, kv_dtype_name
from kvxfer.integrations.sglang.scales import scales_of
from kvxfer.spec import DTYPE_ITEMSIZE, FP8_DTYPES

if TYPE_CHECKING:
    from sglang.srt.disaggregation.base.conn import KVArgs

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


def model_of(server_args: Any, kv_args: KVArgs, is_mla: bool, draft: bool = False) -> SGLangModel:
    """What a pool's pointers do not say, from SGLang's `ModelConfig`: the target model's pool,
    or with `draft` the draft model's (its layers those of its pool, in order).

    Raises:
        ValueError: hybrid state (Mamba, sliding window...), naming the model kind: kvxfer's
            SGLang backend moves full-attention KV only; or an fp8 pool whose model's scales
            were not recorded (`scales_of`).
    """
    from sglang.srt.configs.model_config import ModelConfig

    state_types = list(getattr(kv_args, "state_types", None) or [])
    if state_types:
        kinds = ", ".join(str(getattr(t, "value", t)) for t in state_types)
        raise ValueError(
            f"this model keeps hybrid state ({kinds}) beside its KV cache; kvxfer's SGLang "
            "backend moves full-attention KV only: serve it with another transfer backend"
        )
    entries = pool_entries(kv_args)[1 if draft else 0]
    if draft:  # an MTP model's draft is its own checkpoint's next-token layers
        path = server_args.speculative_draft_model_path or server_args.model_path
        config = ModelConfig.from_server_args(server_args, model_path=path, is_draft_model=True)
    else:
        config = ModelConfig.from_server_args(server_args)
    dtype = kv_dtype_name(kv_args.kv_cache_dtype_str, config.dtype)
    pool_layers = (entries.stop - entries.start) // (1 if is_mla else 2)
    # An fp8 pool's spec carries its layers' scales (what a converting transfer divides or
    # multiplies by): a pipeline stage's layers (MHA: a K and a V buffer each), or the draft's.
    start = getattr(kv_args, "prefill_start_layer", 0) or 0
    layers: range | int = pool_layers if draft else range(start, start + pool_layers)
    k_scales, v_scales = scales_of(layers, draft) if dtype in FP8_DTYPES else ((), ())
    total_layers = pool_layers if draft else config.num_hidden_layers
    if is_mla:
        # The latent width (kv_lora_rank + qk_rope_head_dim) is the pool's row.
        row = kv_args.kv_item_lens[entries.start] // kv_args.page_size
        head_dim = row // DTYPE_ITEMSIZE[dtype]
        return SGLangModel(1, head_dim, total_layers, dtype, mla=True, k_scales=k_scales)
    heads = config.get_total_num_kv_heads()
    return SGLangModel(heads, config.head_dim, total_layers, dtype, False, k_scales, v_scales)


def pool_device(server_args: Any, kv_args: KVArgs) -> str:
    """Where SGLang keeps the pools: `cuda:<gpu_id>`, or the server's device."""
    device = getattr(server_args, "device", None) or "cuda"
    return f"cuda:{kv_args.gpu_id}" if device == "cuda" else str(device)
