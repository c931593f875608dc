"""vLLM engines on CPU, driven by vLLM's own Scheduler, with kvxfer's connector on both sides.

Each engine is a real `Scheduler` (its scheduler-side connector created by vLLM's connector
factory from the kv-transfer config) plus one process per worker standing in for the model
runner: it builds its worker-side connector through the same factory, allocates its KV tensors
with vLLM's own allocator (`allocate_kv_cache`, `[blocks, heads, block_size, 2 * head_dim]` views
in the engine's layout) on CPU and registers them, and per step does what vLLM's model runner
does around a forward pass (bind metadata, start loads, "compute" KV, wait for saves,
report finished transfers and load errors). The "model" writes a KV value that is a hash of
(token, position, layer, plane, head, dim), so any rank can check any cell bit for bit.

With pipeline parallelism (`EngineSpec.pp`), a worker runs per (PP rank, TP rank), numbered
pp-major as vLLM numbers them; each holds the KV tensors of its stage's layers only (vLLM's
split, `get_pp_indices`), under those layers' names. Every worker's output is aggregated as
vLLM's executor does: by a `KVOutputAggregator` that expects a report from each of the
engine's `pp * tp` workers, where the first stages' outputs carry only their KV connector
output (`ModelRunnerOutput.with_kv_conn_output_only`) and the output returned is that of the
last stage's first worker.

With data parallelism, each DP rank is an engine of its own, as vLLM runs one engine core (its
own Scheduler and workers) per DP rank, configured as vLLM's engine core configures it
(`data_parallel_index`, the engine id suffixed with `_dp<rank>`): one `Engine` per DP rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import multiprocessing as mp
import os
import random
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvxfer.addresses import free_port_run
from kvxfer.testing.memory import POISON
from kvxfer.testing.processes import first_message

LAYERS, KV_HEADS, HEAD_DIM, VOCAB = 2, 6, 16, 256
MODEL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 192,
    "intermediate_size": 384,
    "num_attention_heads": 12,
    "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD_DIM,
    "num_hidden_layers": LAYERS,
    "vocab_size": VOCAB,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}
# A LLaVA-shaped multimodal model (vLLM accepts an encoder-cache producer only for those).
MULTIMODAL_MODEL = {
    "architectures": ["LlavaForConditionalGeneration"],
    "model_type": "llava",
    "text_config": {k: v for k, v in MODEL.items() if k != "architectures"},
    "vision_config": {
        "model_type": "clip_vision_model",
        "hidden_size": 64,
        "image_size": 32,
        "patch_size": 16,
        "num_attention_heads": 4,
        "num_hidden_layers": 1,
        "intermediate_size": 128,
        "projection_dim": 64,
    },
    "image_token_index": VOCAB - 6,
    "projector_hidden_act": "gelu",
    "vision_feature_layer": -1,
    "vision_feature_select_strategy": "default",
    "torch_dtype": "bfloat16",
}


def write_model(directory: Path, config: dict[str, Any] = MODEL) -> str:
    """A local model config: vLLM reads config.json only (skip_tokenizer_init)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


@contextlib.contextmanager
def running(engines: list[Any]) -> Iterator[list[Any]]:
    """Engines started together (their workers import vLLM at once), ready; closed in reverse
    order at the end, whatever happens."""
    try:
        for engine in engines:
            engine.wait_ready()
        yield engines
    finally:
        for engine in engines[::-1]:
            engine.close()


def prefill_remote(prefill: Any, prompts: dict[str, list[int]], timeout: float) -> dict[str, dict]:
    """Prefill prompts for remote decode (one token each, as a P/D proxy asks); the
    kv_transfer_params vLLM hands back for each when it finishes it."""
    params: dict[str, dict] = {}

    def collect(_, outputs):
        params.update({o.request_id: o.kv_transfer_params for o in outputs if o.finish_reason})

    for request_id, prompt in prompts.items():
        prefill.add(request_id, prompt, max_tokens=1, params={"do_remote_decode": True})
    run_until(lambda: set(params) >= set(prompts), [prefill], timeout, on_step=collect)
    return params


@dataclass
class Loaded:
    """What `load_and_check` saw."""

    checked: dict[str, list[list[int]]]  # per request, each decode worker's mismatches
    first_compute: dict[str, int]  # per request, the tokens vLLM scheduled in its first step


def load_and_check(
    decode: Any,
    prefills: Sequence[Any],
    loads: dict[str, tuple[list[int], dict]],
    timeout: float,
    loaded: Callable[[list[int]], int] = len,
    on_loaded: Callable[[list[int], list[list[int]]], None] | None = None,
    what: str = "",
) -> Loaded:
    """Add each request (its prompt and the prefill's kv_transfer_params) to the decode engine,
    two tokens to generate; as soon as vLLM learns a request's load finished, before the decode
    engine computes anything for it, check its first `loaded(prompt)` tokens on every decode
    worker, in every KV cache group (`on_loaded(prompt, tables)` first, if given); step the
    engines until every request finished and the prefill engines report them sent."""
    for request_id, (prompt, params) in loads.items():
        decode.add(request_id, prompt, max_tokens=2, params=params)
    seen = Loaded({}, {})
    finished: set[str] = set()

    def follow(engine, outputs):
        if engine is not decode:
            return
        for request_id, count in engine.last_scheduled.items():
            seen.first_compute.setdefault(request_id, count)
        finished.update(o.request_id for o in outputs if o.finish_reason is not None)
        for request_id in (decode.finished_recving & set(loads)) - set(seen.checked):
            tables = [list(t) for t in decode.scheduler.kv_cache_manager.get_block_ids(request_id)]
            prompt = loads[request_id][0]
            if on_loaded is not None:
                on_loaded(prompt, tables)
            seen.checked[request_id] = decode.check(prompt, tables, loaded(prompt))

    sent = lambda: set().union(*(p.finished_sending for p in prefills))  # noqa: E731
    run_until(
        lambda: finished >= set(loads) and sent() >= set(loads),
        [decode, *prefills],
        timeout,
        on_step=follow,
        what=what,
    )
    return seen


def failed_load(
    decode: Any, request_id: str, prompt: list[int], params: dict, timeout: float = 30.0
) -> tuple[list[set[int]], list[int]]:
    """Add a request whose load must fail before any transfer; once vLLM learned the load
    ended, the load errors reported since it was added, and the blocks vLLM allocated for it;
    then step until the request finished (recomputed locally)."""
    errors = len(decode.invalid_block_ids)
    decode.add(request_id, prompt, max_tokens=1, params=params)
    decode.step()
    blocks = list(decode.scheduler.kv_cache_manager.get_block_ids(request_id)[0])
    run_until(lambda: request_id in decode.finished_recving, [decode], timeout)
    reported = decode.invalid_block_ids[errors:]
    finished: set[str] = set()
    run_until(
        lambda: request_id in finished,
        [decode],
        timeout,
        on_step=lambda _, outs: finished.update(
            o.request_id for o in outs if o.finish_reason is not None
        ),
    )
    return reported, blocks


def random_prompt(seed: int, length: int) -> list[int]:
    """`length` token ids drawn from the model's vocabulary, the same for the same seed."""
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(length)]


def run_until(
    condition: Callable[[], bool],
    engines: Sequence[Any],
    timeout: float,
    on_step: Callable[[Any, Any], None] | None = None,
    what: str = "",
) -> None:
    """Step every engine in turn until `condition()` holds; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(
                f"the engines did not reach the expected state in {timeout} s {what}".strip()
            )
        for engine in engines:
            outputs = engine.step()
            if on_step is not None:
                on_step(engine, outputs)
        time.sleep(0.02)


@dataclass(frozen=True)
class EngineSpec:
    """One engine's shape: what `vllm serve` would be told."""

    name: str
    tp: int
    block_size: int
    role: str  # kv_producer | kv_consumer
    num_blocks: int
    kv_cache_layout: str  # vLLM's KVCacheLayout: LBNHC (NHD) or LBHNC (HND)
    extra: dict[str, Any] = field(default_factory=dict)
    load_failure_policy: str = "recompute"  # vLLM's default is "fail"
    dp_rank: int = 0  # this engine's DP rank, of `dp_size`
    dp_size: int = 1
    pp: int = 1  # pipeline stages, each with `tp` workers
    # With a window: two KV cache groups (vLLM's hybrid allocator), even layers full attention,
    # odd layers sliding-window attention over this many tokens.
    sliding_window: int | None = None
    # A hybrid attention/Mamba2 model: even layers full attention, odd layers Mamba2 (a group
    # of recurrent state, `MAMBA_*` below), conv state stored channels first (DS).
    mamba: bool = False
    # vLLM's kv_cache_dtype ("auto": the model's bf16; "fp8", "fp8_e5m2": uint8 caches whose
    # layers carry calibrated scales, `kv_scales`), and the setting of the engine whose cache
    # write made the KV this engine holds (a decode engine: its prefill engine's).
    cache_dtype: str = "auto"
    kv_from: str = "auto"

    @property
    def engine_id(self) -> str:
        """The engine id vLLM's engine core gives this DP rank."""
        return self.name if self.dp_size == 1 else f"{self.name}_dp{self.dp_rank}"

    @property
    def world_size(self) -> int:
        """Workers of the engine (vLLM's `world_size` within a DP rank): `pp * tp`."""
        return self.pp * self.tp


def vllm_config(model_dir: str, spec: EngineSpec, rank: int = 0) -> Any:
    """The VllmConfig of one engine (rank: the worker's rank, pp-major, as vLLM sets it per
    worker)."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model = ModelConfig(
        model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024
    )
    config = VllmConfig(
        model_config=model,
        # Mamba state without prefix caching (vLLM's mamba_cache_mode "none" requires it).
        cache_config=CacheConfig(
            block_size=spec.block_size,
            enable_prefix_caching=not spec.mamba,
            cache_dtype=spec.cache_dtype,
        ),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=1024,
            max_num_seqs=16,
            max_model_len=1024,
            is_encoder_decoder=False,
        ),
        parallel_config=ParallelConfig(
            tensor_parallel_size=spec.tp,
            pipeline_parallel_size=spec.pp,
            data_parallel_size=spec.dp_size,
            data_parallel_size_local=spec.dp_size,
            data_parallel_rank=spec.dp_rank,
        ),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvxferConnector",
            kv_connector_module_path="kvxfer.integrations.vllm",
            kv_role=spec.role,
            engine_id=spec.name,
            kv_connector_extra_config=spec.extra,
            kv_load_failure_policy=spec.load_failure_policy,
        ),
    )
    config.cache_config.num_gpu_blocks = spec.num_blocks
    # What the engine core resolves from the attention backends (resolve_kv_cache_layout).
    config.cache_config.kv_cache_layout = spec.kv_cache_layout
    config.parallel_config.rank = rank
    if spec.dp_size > 1:
        # What vLLM's engine core does for each DP rank of a dense model (run_engine_core):
        # its own engine id, and an engine of its own that remembers its DP index.
        config.kv_transfer_config.engine_id = spec.engine_id
        config.parallel_config.data_parallel_rank_local = spec.dp_rank
        config.parallel_config.data_parallel_index = spec.dp_rank
        config.parallel_config.reconfigure_for_independent_dp_rank()
    return config


def stage_layers(config: Any, pp_rank: int = 0) -> range:
    """The model layers of a pipeline stage, as vLLM splits them (`get_pp_indices`); every
    layer without pipeline parallelism."""
    from vllm.distributed.utils import get_pp_indices

    total = config.model_config.get_total_num_hidden_layers()
    start, end = get_pp_indices(total, pp_rank, config.parallel_config.pipeline_parallel_size)
    return range(start, end)


def single_engine_parallelism() -> Any:
    """What a scheduler-side connector reads of a `VllmConfig`: the parallel layout of one
    engine at TP 1, PP 1 and DP rank 0 (for tests of `SchedulerSide` alone)."""
    from types import SimpleNamespace

    parallel = SimpleNamespace(
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        data_parallel_master_ip="127.0.0.1",
        data_parallel_rank=0,
        data_parallel_index=0,
    )
    return SimpleNamespace(parallel_config=parallel)


def layer_names(layers: Sequence[int]) -> list[str]:
    """The attention layers' names, as vLLM's Llama registers them."""
    return [f"model.layers.{i}.self_attn.attn" for i in layers]


# The Mamba2 layers of `EngineSpec.mamba`: x = heads x head_dim conv channels, then B and C
# (n_groups x d_state each), a conv window of MAMBA_CONV - 1 tokens; SSM state per head
# [head_dim, d_state] in fp32. Every size splits over TP 1, 2, 3 and 6.
MAMBA_HEADS, MAMBA_HEAD_DIM, MAMBA_D_STATE, MAMBA_BC, MAMBA_CONV = 6, 4, 8, 12, 4
MAMBA_X = MAMBA_HEADS * MAMBA_HEAD_DIM
MAMBA = "mamba"


def layer_groups(spec: EngineSpec, layers: range) -> list[tuple[list[int], int | str | None]]:
    """A stage's model layers by KV cache group, each with its kind: None (full attention), a
    sliding window in tokens, or `MAMBA`. One group, or the even layers (full attention) and
    the odd ones (`spec.sliding_window` or `spec.mamba`)."""
    odd: int | str | None = MAMBA if spec.mamba else spec.sliding_window
    if odd is None:
        return [(list(layers), None)]
    return [
        ([layer for layer in layers if layer % 2 == 0], None),
        ([layer for layer in layers if layer % 2 == 1], odd),
    ]


def mamba_names(layers: Sequence[int]) -> list[str]:
    """The Mamba layers' names, as vLLM's hybrid models register their mixers."""
    return [f"model.layers.{i}.mixer" for i in layers]


def group_names(layers: Sequence[int], kind: int | str | None) -> list[str]:
    """A group's registered layer names."""
    return mamba_names(layers) if kind == MAMBA else layer_names(layers)


def mamba_state(token_ids, num_tokens: int, layer: int, tp: int, rank: int) -> torch.Tensor:
    """The stand-in Mamba2 layer's state after `num_tokens` tokens, as one rank's page bytes
    (vLLM's packing: its slices of x, B and C of the conv state `[channels, MAMBA_CONV - 1]`
    bf16, then its SSM heads `[head_dim, d_state]` fp32), a hash of (tokens so far, layer,
    state, global row, element)."""
    last = token_ids[num_tokens - 1]

    def bits(state: int, rows: int, per_row: int, dtype) -> np.ndarray:
        row = np.arange(rows, dtype=np.uint64)[:, None]
        elem = np.arange(per_row, dtype=np.uint64)[None, :]
        with np.errstate(over="ignore"):
            x = np.uint64(last * 1000003 + num_tokens * 7919 + layer * 104729 + state * 31)
            x = (x + row * np.uint64(32452843) + elem * np.uint64(49979687)) * np.uint64(2654435761)
        return ((x >> np.uint64(7)) & np.uint64(np.iinfo(dtype).max)).astype(dtype)

    conv = bits(0, MAMBA_X + 2 * MAMBA_BC, MAMBA_CONV - 1, np.uint16)
    ssm = bits(1, MAMBA_HEADS, MAMBA_HEAD_DIM * MAMBA_D_STATE, np.uint32)
    parts = []
    for start, size in ((0, MAMBA_X), (MAMBA_X, MAMBA_BC), (MAMBA_X + MAMBA_BC, MAMBA_BC)):
        per = size // tp
        parts.append(conv[start + rank * per : start + (rank + 1) * per])
    per = MAMBA_HEADS // tp
    local = [np.concatenate(parts).tobytes(), ssm[rank * per : (rank + 1) * per].tobytes()]
    return torch.frombuffer(bytearray(b"".join(local)), dtype=torch.uint8)


def kv_cache_config(spec: EngineSpec, config: Any, pp_rank: int = 0) -> Any:
    """A stage's layers (every layer without pipeline parallelism) in one full-attention
    group, or a full-attention and a sliding-window group (`spec.sliding_window`), planned by
    vLLM for `num_blocks` blocks. vLLM's scheduler gets the first stage's
    (`generate_scheduler_kv_cache_config`: the stages differ in layer names only)."""
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    shape = {
        "block_size": spec.block_size,
        "num_kv_heads": max(1, config.model_config.get_total_num_kv_heads() // spec.tp),
        "head_size": HEAD_DIM,
        "dtype": torch.uint8 if spec.cache_dtype in FP8_SETTINGS else torch.bfloat16,
    }
    page = FullAttentionSpec(**shape).page_size_bytes

    def group_spec(kind: int | str | None) -> Any:
        if kind is None:
            return FullAttentionSpec(**shape)
        if kind != MAMBA:
            return SlidingWindowSpec(**shape, sliding_window=kind)
        return MambaSpec(
            block_size=spec.block_size,
            shapes=(
                ((MAMBA_X + 2 * MAMBA_BC) // spec.tp, MAMBA_CONV - 1),
                (MAMBA_HEADS // spec.tp, MAMBA_HEAD_DIM, MAMBA_D_STATE),
            ),
            dtypes=(torch.bfloat16, torch.float32),
            page_size_padded=page,  # vLLM pads a hybrid model's state pages to the KV page
            mamba_type=MambaAttentionBackendEnum.MAMBA2,
        )

    groups = [
        KVCacheGroupSpec(group_names(layers, kind), group_spec(kind))
        for layers, kind in layer_groups(spec, stage_layers(config, pp_rank))
    ]
    widest = max(len(g.layer_names) for g in groups)
    memory = groups[0].kv_cache_spec.page_size_bytes * spec.num_blocks * widest
    return get_kv_cache_config_from_groups(config, groups, memory)


def rank_heads(tp: int, rank: int, kv_heads: int = KV_HEADS) -> list[int]:
    """Global KV heads of a TP rank (vLLM shards KV heads evenly, or replicates each over
    `tp // kv_heads` ranks when there are fewer heads than ranks)."""
    if kv_heads < tp:
        return [rank // (tp // kv_heads)]
    per = kv_heads // tp
    return list(range(rank * per, (rank + 1) * per))


def expected_kv(
    token_ids: list[int], positions: range, heads: list[int], layers: range = range(LAYERS)
) -> torch.Tensor:
    """The stand-in model's KV bits of some model layers: `[layers, 2, tokens, heads,
    head_dim]` as int16."""
    tok = np.asarray([token_ids[p] for p in positions], dtype=np.uint64)[None, None, :, None, None]
    pos = np.asarray(list(positions), dtype=np.uint64)[None, None, :, None, None]
    layer = np.asarray(list(layers), dtype=np.uint64)[:, None, None, None, None]
    plane = np.arange(2, dtype=np.uint64)[None, :, None, None, None]
    head = np.asarray(heads, dtype=np.uint64)[None, None, None, :, None]
    dim = np.arange(HEAD_DIM, dtype=np.uint64)[None, None, None, None, :]
    with np.errstate(over="ignore"):
        x = tok * 1000003 + pos * 7919 + layer * 104729 + plane * 15485863
        x = (x + head * 32452843 + dim * 49979687) * np.uint64(2654435761)
    bits = ((x >> np.uint64(13)) & np.uint64(0xFFFF)).astype(np.uint16).view(np.int16)
    return torch.from_numpy(bits.copy())


FP8_SETTINGS = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def kv_scales(layer: int) -> tuple[float, float]:
    """A model layer's (k_scale, v_scale) on an fp8 engine, as a calibrated checkpoint gives
    them (distinct per layer and plane, so that a scale of the wrong layer shows)."""
    return 0.5 + 0.25 * layer, 2.0 + 0.5 * layer


def stored_kv(bits: torch.Tensor, layers: Sequence[int], cache_dtype: str, kv_from: str) -> Any:
    """The stand-in model's KV bits (`expected_kv`) as an engine whose cache dtype is
    `cache_dtype` holds them, when the engine with `kv_from` wrote them: that engine's cache
    write (into fp8: vLLM's quantization with its layers' scales), then kvxfer's conversion
    into this engine's dtype (`kvxfer.reference`, written from vLLM's arithmetic). Bits of the
    stored dtype: int16 (bf16) or uint8 (fp8)."""
    from kvxfer.reference import converted_global_kv

    scales = np.asarray([kv_scales(layer) for layer in layers], dtype=np.float32)
    values = bits.view(torch.bfloat16)
    for setting in (kv_from, cache_dtype):
        dtype = FP8_SETTINGS.get(setting, torch.bfloat16)
        if values.dtype != dtype:
            values = converted_global_kv(values, dtype, scales)
    return values.view(torch.uint8 if values.element_size() == 1 else torch.int16)


def allocate_caches(spec: EngineSpec, config: Any, pp_rank: int = 0) -> dict[str, torch.Tensor]:
    """A stage's layer tensors exactly as vLLM's model runner allocates and registers them
    (`[blocks, heads, block_size, 2 * head_dim]` views in the resolved layout), poisoned."""
    from vllm.v1.worker.utils import allocate_kv_cache

    caches = allocate_kv_cache(
        kv_cache_config(spec, config, pp_rank),
        torch.device("cpu"),
        config.cache_config.get_resolved_kv_cache_layout(),
    )
    for tensor in caches.values():
        tensor.view(torch.uint8).fill_(POISON)
    return caches


def _bits(cache: torch.Tensor) -> torch.Tensor:
    """A cache as the integers of its element width (bf16: int16; fp8, allocated as uint8)."""
    return cache.view(torch.uint8 if cache.element_size() == 1 else torch.int16)


def _cells(cache: torch.Tensor, blocks: torch.Tensor, slots: torch.Tensor, plane: int):
    """A copy of one plane of tokens' cells, `[tokens, heads, head_dim]`, from a `[B, H, N, 2D]`
    view (K is the first half of a cell, V the second)."""
    return _bits(cache)[blocks, :, slots, plane * HEAD_DIM : (plane + 1) * HEAD_DIM]


@dataclass(frozen=True)
class Worker:
    """What one worker holds: its place, its KV heads and its stage's model layers."""

    rank: int  # in the engine, pp-major: pp_rank * tp + tp_rank
    pp_rank: int
    tp_rank: int
    heads: list[int]
    layers: range

    @classmethod
    def of(cls, spec: EngineSpec, config: Any, rank: int) -> Worker:
        pp_rank, tp_rank = divmod(rank, spec.tp)
        heads = rank_heads(spec.tp, tp_rank, config.model_config.get_total_num_kv_heads())
        return cls(rank, pp_rank, tp_rank, heads, stage_layers(config, pp_rank))


@dataclass(frozen=True)
class Group:
    """One KV cache group of a worker: its model layers, their tensors and its kind (None:
    full attention; a window; `MAMBA`)."""

    layers: list[int]
    caches: list[torch.Tensor]
    kind: int | str | None

    def first_token(self, num_tokens: int, table: list[int], block_size: int) -> int:
        """The first of `num_tokens` loaded tokens this group must hold (0 for full
        attention): vLLM recomputes the last one, whose window starts at `num_tokens -
        window`, unless that token's block is one vLLM already dropped (its null block, id
        0: from the next block on)."""
        if not isinstance(self.kind, int):
            return 0
        first = max(0, num_tokens - self.kind)
        while first < num_tokens and table[first // block_size] == 0:
            first = (first // block_size + 1) * block_size
        return min(first, num_tokens)


def worker_groups(spec: EngineSpec, registered: dict[str, torch.Tensor], layers) -> list[Group]:
    """A worker's KV cache groups, from its registered tensors."""
    return [
        Group(group_layers, [registered[n] for n in group_names(group_layers, kind)], kind)
        for group_layers, kind in layer_groups(spec, layers)
    ]


def _state_pages(group: Group) -> list[torch.Tensor]:
    """A Mamba group's `[blocks, page content]` bytes per layer (vLLM's `[B, 1, 1, C]`)."""
    return [cache.view(torch.uint8).flatten(1) for cache in group.caches]


def write_kv(
    groups: list[Group],
    spec,
    worker: Worker,
    token_ids,
    tables,
    start,
    end,
    saved: Callable[[str], None] | None = None,
) -> None:
    """The stand-in forward pass of one worker: write its KV of positions `[start, end)` in
    every group (`tables[g]`: group `g`'s block table), one attention layer after another in
    model order, calling `saved(layer_name)` after each, as vLLM's attention layers call the
    connector's `save_kv_layer`."""
    if end <= start:
        return
    positions = torch.arange(start, end)
    writes = []  # (model layer, its tensor, its values, blocks, slots)
    for group, table in zip(groups, tables, strict=True):
        if group.kind == MAMBA:  # the state after `end` tokens, in its last token's block
            for layer, page in zip(group.layers, _state_pages(group), strict=True):
                state = mamba_state(token_ids, end, layer, spec.tp, worker.tp_rank)
                page[table[(end - 1) // spec.block_size], : state.numel()] = state
            continue
        values = stored_kv(
            expected_kv(token_ids, range(start, end), worker.heads, group.layers),
            group.layers,
            spec.cache_dtype,
            spec.cache_dtype,  # its own cache write
        )
        ids = torch.as_tensor(table, dtype=torch.int64)
        blocks, slots = ids[positions // spec.block_size], positions % spec.block_size
        for index, (layer, cache) in enumerate(zip(group.layers, group.caches, strict=True)):
            writes.append((layer, cache, values[index], blocks, slots))
    for layer, cache, value, blocks, slots in sorted(writes, key=lambda w: w[0]):
        for plane in (0, 1):  # advanced indexing reads copies: write through the index
            dims = slice(plane * HEAD_DIM, (plane + 1) * HEAD_DIM)
            _bits(cache)[blocks, :, slots, dims] = value[plane]
        if saved is not None:
            saved(layer_names([layer])[0])


def mismatched_tokens(groups: list[Group], spec, worker: Worker, token_ids, tables, num_tokens):
    """Positions in `[0, num_tokens)` whose cells differ from the model's bits on a worker
    (every layer and head it holds; in a window group, only the positions it keeps)."""
    bad = torch.zeros(num_tokens, dtype=torch.bool)
    for group, table in zip(groups, tables, strict=True):
        if group.kind == MAMBA:  # a wrong state marks the last position
            for layer, page in zip(group.layers, _state_pages(group), strict=True):
                state = mamba_state(token_ids, num_tokens, layer, spec.tp, worker.tp_rank)
                block = table[(num_tokens - 1) // spec.block_size]
                if not torch.equal(page[block, : state.numel()], state):
                    bad[num_tokens - 1] = True
            continue
        first = group.first_token(num_tokens, table, spec.block_size)
        expected = stored_kv(
            expected_kv(token_ids, range(first, num_tokens), worker.heads, group.layers),
            group.layers,
            spec.cache_dtype,
            spec.kv_from,
        )
        positions = torch.arange(first, num_tokens)
        ids = torch.as_tensor(table, dtype=torch.int64)
        blocks, slots = ids[positions // spec.block_size], positions % spec.block_size
        for layer, cache in enumerate(group.caches):
            for plane in (0, 1):
                got = _cells(cache, blocks, slots, plane)
                bad[first:] |= (got != expected[layer, plane]).flatten(1).any(dim=1)
    return [int(p) for p in torch.nonzero(bad).flatten()]


def _as_tables(block_ids: list) -> list[list[int]]:
    """A request's block tables per group (a flat list is one group's)."""
    if block_ids and isinstance(block_ids[0], (list, tuple)):
        return [list(table) for table in block_ids]
    return [list(block_ids)]


class _WrittenLikeFlashAttention:
    """The attention backend of the stand-in model runner's layers: it writes each token's K
    then V in one row (`write_kv`), as FlashAttention does."""

    @staticmethod
    def get_name() -> str:
        return "FLASH_ATTN"


class _StandInAttentionLayer:
    """What a worker reads of a model's attention layer in vLLM's forward context: its
    backend and its KV cache scales (vLLM's `_k_scale_float`, `_v_scale_float`: 1.0 unless
    an fp8 checkpoint calibrated them)."""

    isa = None

    def __init__(self, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        self._k_scale_float, self._v_scale_float = k_scale, v_scale

    @staticmethod
    def get_attn_backend() -> type[_WrittenLikeFlashAttention]:
        return _WrittenLikeFlashAttention


def declare_attention_layers(config: Any, cache_config: Any) -> None:
    """Put the attention layers of `cache_config` in vLLM's forward context, as a model does
    when it is built: kvxfer reads each layer's KV layout from its backend, and an fp8
    cache's scales from the layer (Mamba layers are not attention layers)."""
    from vllm.model_executor.models.utils import extract_layer_index
    from vllm.v1.kv_cache_interface import MambaSpec

    fp8 = config.cache_config.cache_dtype in FP8_SETTINGS
    context = config.compilation_config.static_forward_context
    for group in cache_config.kv_cache_groups:
        if not isinstance(group.kv_cache_spec, MambaSpec):
            for name in group.layer_names:
                scales = kv_scales(extract_layer_index(name)) if fp8 else (1.0, 1.0)
                context[name] = _StandInAttentionLayer(*scales)


def worker_main(conn: Any, model_dir: str, spec: EngineSpec, rank: int, hold: bool) -> None:
    """One worker's model-runner stand-in (`rank`: pp-major, `pp_rank * tp + tp_rank`);
    answers the driver's commands until "close". With `hold`, it imports vLLM and then waits
    for "start" before creating its connector (a standby that comes up at once, e.g. to
    restart an engine)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    logs = logging.StreamHandler()  # kvxfer's warnings, with the time and the rank
    logs.setFormatter(logging.Formatter(f"%(asctime)s {spec.name}[{rank}] %(name)s: %(message)s"))
    logging.getLogger("kvxfer").addHandler(logs)
    config = vllm_config(model_dir, spec, rank)
    worker = Worker.of(spec, config, rank)
    if hold and conn.recv()[0] != "start":
        conn.send(("closed", rank))
        return
    connector = KVConnectorFactory.create_connector(
        config, KVConnectorRole.WORKER, kv_cache_config(spec, config, worker.pp_rank)
    )
    registered = allocate_caches(spec, config, worker.pp_rank)
    declare_attention_layers(config, kv_cache_config(spec, config, worker.pp_rank))
    connector.register_kv_caches(registered)
    groups = worker_groups(spec, registered, worker.layers)

    def save_layer(name: str) -> None:  # as vLLM's attention layer does after its write
        connector.save_kv_layer(name, registered[name], None)

    conn.send(("ready", rank))
    while True:
        command, *args = conn.recv()
        if command == "close":
            connector.shutdown()
            conn.send(("closed", rank))
            return
        if command == "step":
            metadata, finished_ids, compute = args
            connector.bind_connector_metadata(metadata)
            connector.start_load_kv(None)
            for token_ids, tables, start, end in compute:
                write_kv(groups, spec, worker, token_ids, tables, start, end, save_layer)
            connector.wait_for_save()
            # As vLLM's KVConnectorModelRunnerMixin asks after a forward pass.
            results = connector.get_transfer_results(set(finished_ids))
            invalid = connector.get_block_ids_with_load_errors()
            stats = connector.get_kv_connector_stats()
            connector.clear_connector_metadata()
            conn.send((results, invalid, None if stats is None else stats.data))
        elif command == "check":
            token_ids, block_ids, num_tokens = args
            tables = _as_tables(block_ids)
            conn.send(mismatched_tokens(groups, spec, worker, token_ids, tables, num_tokens))
        elif command == "null_block_untouched":
            # vLLM's null block (id 0) stands for a window's dropped blocks: never written.
            conn.send(all(bool((g.caches[0][0].view(torch.uint8) == POISON).all()) for g in groups))


class Engine:
    """A scheduler in this process and one worker process per (PP rank, TP rank).

    A producer's scheduler (DP rank 0) runs the engine's bootstrap service: unless the spec
    names `bootstrap_port` or `bootstrap_address`, it gets a free port, so engines of tests that
    run at once never collide. A standby engine (`hold=True`) creates its scheduler at `start`,
    as a restarted engine process would; `kill` takes the scheduler down with the workers.
    """

    def __init__(self, model_dir: str, spec: EngineSpec, hold: bool = False) -> None:
        producer = spec.role in ("kv_producer", "kv_both")
        if producer and not {"bootstrap_port", "bootstrap_address"} & set(spec.extra):
            spec = dataclasses.replace(
                spec, extra={**spec.extra, "bootstrap_port": free_port_run(1)}
            )
        self.spec, self.model_dir = spec, model_dir
        self.scheduler: Any = None
        self.aggregator: Any = None
        self._scheduler_down = False
        if not hold:
            self._start_scheduler()
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for rank in range(spec.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=worker_main, args=(child, model_dir, spec, rank, hold), daemon=True
            )
            proc.start()
            child.close()  # the worker's end lives in the worker only: its exit is our EOF
            self.conns.append(parent)
            self.procs.append(proc)
        self.finished_recving: set[str] = set()
        self.failed_recving: set[str] = set()  # loads reported failed whole (several groups)
        self.finished_sending: set[str] = set()
        self.invalid_block_ids: list[set[int]] = []
        self.stats: list[dict[str, Any]] = []
        self.last_scheduled: dict[str, int] = {}
        self.metadata: list[Any] = []  # each step's connector metadata, in step order
        # Every worker's own reports, and the step in which vLLM's aggregation let each
        # request through: ("sending" | "recving", request id) -> [(step, worker rank)], and
        # -> step.
        self.steps = 0
        self.worker_reports: dict[tuple[str, str], list[tuple[int, int]]] = {}
        self.aggregated_at: dict[tuple[str, str], int] = {}

    def _start_scheduler(self) -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        spec = self.spec
        config = vllm_config(self.model_dir, spec)
        self.scheduler = Scheduler(
            vllm_config=config,
            kv_cache_config=kv_cache_config(spec, config),
            structured_output_manager=StructuredOutputManager(config),
            block_size=spec.block_size,
            log_stats=True,
        )
        # As vLLM's executor: the connector's finished count, else one report per worker.
        self.aggregator = KVOutputAggregator.from_connector(
            self.scheduler.get_kv_connector(), config.parallel_config.world_size
        )
        # Block hashes for prefix caching, as vLLM's EngineCore gives every request.
        hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(
            spec.block_size, hash_fn, config.num_hash_lookahead_tokens
        )
        self.free_blocks_at_start = self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def start(self) -> None:
        """Let a standby engine (`hold=True`) create its scheduler and its workers their
        connectors."""
        if self.scheduler is None:
            self._start_scheduler()
        for conn in self.conns:
            conn.send(("start",))

    def kill(self) -> None:
        """SIGKILL every worker (a crash: no connector shutdown) and reap them; the scheduler
        (and the bootstrap service it may run) goes down with them."""
        if self.scheduler is not None and not self._scheduler_down:
            self.scheduler.shutdown()
            self._scheduler_down = True
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.join(10)
        for conn in self.conns:
            conn.close()
        self.conns = []

    def freeze(self) -> None:
        """SIGSTOP every worker."""
        for proc in self.procs:
            os.kill(proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT every worker."""
        for proc in self.procs:
            os.kill(proc.pid, signal.SIGCONT)

    def wait_ready(self, timeout: float = 900.0) -> None:
        """Wait until every worker registered its caches (vLLM import and connector start); a
        worker that exits first is reported at once. `timeout` only guards against a hang (a
        loaded machine has taken over 180 s to import vLLM in several spawned workers)."""
        for rank, (conn, proc) in enumerate(zip(self.conns, self.procs, strict=True)):
            first_message(conn, proc, f"{self.spec.name}: worker {rank}", timeout)

    def add(self, request_id: str, prompt: list[int], max_tokens: int, params: dict | None):
        """Submit a request, as the API server would."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        extra = {"kv_transfer_params": params} if params is not None else None
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra)
        # A copy, as the engine makes one: a connector may truncate it (a hybrid prefill).
        request = Request(request_id, list(prompt), sampling, None, block_hasher=self.block_hasher)
        self.scheduler.add_request(request)

    def step(self) -> list[Any]:
        """One engine step: schedule, run every rank, aggregate, update; the step's outputs."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        out = self.scheduler.schedule()
        self.metadata.append(out.kv_connector_metadata)
        compute, sampled = [], {}
        started = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        started.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        self.last_scheduled = dict(out.num_scheduled_tokens)
        for req_id, count in out.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            tables = [list(t) for t in self.scheduler.kv_cache_manager.get_block_ids(req_id)]
            start = started[req_id]
            tokens = list(request.all_token_ids)
            compute.append((tokens, tables, start, start + count))
            if start + count >= request.num_prompt_tokens:
                sampled[req_id] = [(start + count) * 7 % VOCAB]
        for conn in self.conns:
            conn.send(("step", out.kv_connector_metadata, set(out.finished_req_ids), compute))
        req_ids = list(sampled)
        outputs = []
        self.steps += 1
        last_stage = self.spec.world_size - self.spec.tp  # its first worker's output is returned
        for rank, conn in enumerate(self.conns):
            results, invalid, stats = conn.recv()
            sending, recving = results.finished_sending, results.finished_recving
            for kind, ids in (("sending", sending), ("recving", recving)):
                for request_id in ids or ():
                    reports = self.worker_reports.setdefault((kind, request_id), [])
                    reports.append((self.steps, rank))
            kv = KVConnectorOutput(
                finished_sending=sending,
                finished_recving=recving,
                failed_recving=results.failed_recving,
                invalid_block_ids=invalid,
                kv_connector_stats=None if stats is None else _stats(stats),
            )
            if rank < last_stage:
                # A first stage's worker: its step returns only its KV connector output
                # (vLLM's GPUModelRunner.sample_tokens, "PP with kv transfer").
                outputs.append(ModelRunnerOutput.with_kv_conn_output_only(kv))
                continue
            outputs.append(
                ModelRunnerOutput(
                    req_ids=req_ids,
                    req_id_to_index={r: i for i, r in enumerate(req_ids)},
                    sampled_token_ids=[sampled[r] for r in req_ids],
                    kv_connector_output=kv,
                )
            )
        merged = self.aggregator.aggregate(outputs, output_rank=last_stage)
        kv_out = merged.kv_connector_output
        if kv_out is not None:
            for kind, ids in (
                ("sending", kv_out.finished_sending),
                ("recving", kv_out.finished_recving),
            ):
                for request_id in ids or ():
                    self.aggregated_at[kind, request_id] = self.steps
            self.finished_recving |= kv_out.finished_recving or set()
            self.failed_recving |= kv_out.failed_recving or set()
            self.finished_sending |= kv_out.finished_sending or set()
            if kv_out.invalid_block_ids:
                self.invalid_block_ids.append(set(kv_out.invalid_block_ids))
            if kv_out.kv_connector_stats is not None:
                self.stats.append(kv_out.kv_connector_stats.data)
        engine_outputs = self.scheduler.update_from_output(out, merged)
        return [o for group in engine_outputs.values() for o in group.outputs]

    def check(self, token_ids: list[int], block_ids: list, num_tokens: int) -> list[list]:
        """Every worker's mismatching positions for a request's first `num_tokens` tokens, by
        worker rank (pp-major); `block_ids`: one table, or one per KV cache group."""
        for conn in self.conns:
            conn.send(("check", token_ids, block_ids, num_tokens))
        return [conn.recv() for conn in self.conns]

    def null_block_untouched(self) -> list[bool]:
        """Per worker: whether vLLM's null block (id 0, which stands for a window's dropped
        blocks) still holds only poison in every group's first layer."""
        for conn in self.conns:
            conn.send(("null_block_untouched",))
        return [conn.recv() for conn in self.conns]

    def free_blocks(self) -> int:
        """Free blocks in the scheduler's pool (cached-but-unused blocks count as free)."""
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def close(self) -> None:
        """Shut every worker's connector down and join the processes; then the scheduler's."""
        for conn in self.conns:
            try:
                conn.send(("close",))
                if conn.poll(30):
                    conn.recv()
            except (BrokenPipeError, EOFError):
                pass
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        if self.scheduler is not None and not self._scheduler_down:
            self.scheduler.shutdown()
            self._scheduler_down = True


def _stats(data: dict[str, Any]) -> Any:
    from kvxfer.integrations.vllm import KvxferConnector

    return KvxferConnector.build_kv_connector_stats(data)
