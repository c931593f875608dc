"""What a worker reads of itself from vLLM: its geometry (model, cache, parallel
configuration), its TP and PP ranks, and its layers' attention backends (vLLM's forward
context). `kvxfer.integrations.vllm.cache_groups` turns these into kvxfer's groups."""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from kvxfer.integrations.kv_tensors import EngineGeometry

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from kvxfer.integrations.vllm.cache_groups import Backends


def engine_geometry(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None
) -> EngineGeometry:
    """This rank's geometry from vLLM's configuration (model, cache, parallel)."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    block_size = vllm_config.cache_config.block_size
    if kv_cache_config is not None and kv_cache_config.kv_cache_groups:
        block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
    pp_size = parallel.pipeline_parallel_size
    return EngineGeometry(
        total_kv_heads=1 if model.use_mla else model.get_total_num_kv_heads(),
        head_dim=model.get_head_size(),
        block_size=block_size,
        tp_size=parallel.tensor_parallel_size,
        tp_rank=tp_rank(vllm_config),
        mla=bool(model.use_mla),
        kv_cache_dtype=str(vllm_config.cache_config.cache_dtype),
        pp_size=pp_size,
        pp_rank=pp_rank(vllm_config),
        kv_layers=_model_kv_layers(vllm_config) if pp_size > 1 else (),
    )


def attention_backends(vllm_config: VllmConfig, names: list[str]) -> Backends:
    """Each named layer's attention backend (`get_name()`) and, on CPU attention, the
    instruction set its cache write uses (`layer.isa`, set by the backend's metadata builder
    before the caches are registered), from vLLM's forward context. Layers it does not hold
    (or that have no attention backend) are left out."""
    context = vllm_config.compilation_config.static_forward_context
    found: Backends = {}
    for name in names:
        get_backend = getattr(context.get(name), "get_attn_backend", None)
        if get_backend is not None:
            found[name] = (str(get_backend().get_name()), getattr(context[name], "isa", None))
    return found


def attention_scales(vllm_config: VllmConfig, names: list[str]) -> dict[str, tuple[float, float]]:
    """Each named attention layer's KV cache scales `(k_scale, v_scale)` as its cache write
    uses them (an fp8 cache stores `K / k_scale`): vLLM keeps them on the layer
    (`_k_scale_float`, `_v_scale_float`; 1.0 unless the checkpoint calibrated them), final
    once the weights are loaded, before the caches are registered."""
    context = vllm_config.compilation_config.static_forward_context
    found: dict[str, tuple[float, float]] = {}
    for name in names:
        layer = context.get(name)
        if layer is not None and hasattr(layer, "_k_scale_float"):
            found[name] = (float(layer._k_scale_float), float(layer._v_scale_float))
    return found


def pp_rank(vllm_config: VllmConfig) -> int:
    """vLLM's PP group rank when it is initialized, else from the worker's rank in its config
    (vLLM orders ranks TP-fastest)."""
    from vllm.distributed import parallel_state

    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size == 1:
        return 0
    if parallel_state.model_parallel_is_initialized():
        return int(parallel_state.get_pp_group().rank_in_group)
    return int(parallel.rank) // parallel.tensor_parallel_size % parallel.pipeline_parallel_size


def tp_rank(vllm_config: VllmConfig) -> int:
    """vLLM's TP group rank when it is initialized, else the worker's rank in its config."""
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return int(parallel_state.get_tensor_model_parallel_rank())
    parallel = vllm_config.parallel_config
    return int(parallel.rank) % parallel.tensor_parallel_size


def _model_kv_layers(vllm_config: VllmConfig) -> tuple[int, ...]:
    """The model-layer index of every layer of the model (every pipeline stage) that holds a
    KV cache: every decoder layer except no-op attention layers (models whose
    `block_configs` mark them, as vLLM's `get_num_layers_by_block_type` reads them). Checked
    against vLLM's count of attention layers."""
    model = vllm_config.model_config
    total = int(model.get_total_num_hidden_layers())
    layers: tuple[int, ...] = tuple(range(total))
    if getattr(model, "has_noops", False):
        configs = model.hf_config.block_configs
        layers = tuple(i for i, c in enumerate(configs) if not c.attention.no_op)
    counted = _attention_layers(vllm_config)
    if counted is not None and counted != len(layers):
        raise ValueError(
            f"kvxfer: the model has {len(layers)} layers with a KV cache by its configuration "
            f"but vLLM counts {counted} attention layers; pipeline parallelism over this model "
            "is not supported by the vLLM integration"
        )
    return layers


def _attention_layers(vllm_config: VllmConfig) -> int | None:
    """vLLM's count of the model's attention layers over every stage (None when vLLM cannot
    count them)."""
    # The whole model as one stage: all vLLM reads of a parallel config to count layers.
    whole: Any = SimpleNamespace(rank=0, tensor_parallel_size=1, pipeline_parallel_size=1)
    try:
        return int(vllm_config.model_config.get_num_layers_by_block_type(whole, "attention"))
    except Exception:  # a model vLLM cannot count (or an uneven VLLM_PP_LAYER_PARTITION)
        return None
