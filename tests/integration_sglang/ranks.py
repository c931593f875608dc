"""One SGLang rank per process, as SGLang's scheduler sets up a P/D rank: its runtime context,
SGLang's own KV pool (`MHATokenToKVPool`, or `MLATokenToKVPool`) and metadata buffers on CPU,
`KVArgs` filled as `prefill.py` / `decode.py` fill them, and the transfer backend's classes
taken from SGLang's `get_kv_class` after the plugin loaded through its entry point.

A prefill rank with `via_queue` is driven as SGLang's prefill scheduler drives one: SGLang's
`PrefillBootstrapQueue` builds the backend's manager (filling `KVArgs` itself) and
bootstraps the request (`add`, then `pop_bootstrapped` until the decode's metadata is in),
with a stand-in scheduler in SGLang's own test style (the model runner is absent here).

A prefill rank writes the request's KV with SGLang's `set_kv_buffer` (a chunk at a time, as a
chunked prefill does), sends it in two chunks through the sender, and waits for `Success`; a
decode rank poisons its pool, receives the request and returns what its pool holds.
"""

from __future__ import annotations

import os
import signal
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

POISON_BYTE = 0x5A
WAIT_S = 60.0


@dataclass(frozen=True)
class RankConfig:
    """Everything one rank process needs (picklable: it crosses a spawn)."""

    role: str  # "prefill" or "decode"
    tp_size: int
    tp_rank: int
    page_size: int
    model_dir: str
    bootstrap_port: int
    room: int
    num_tokens: int
    pages: list[int]  # the request's pages in this engine's pool
    aux_index: int
    mla: bool = False
    pp_size: int = 1
    pp_rank: int = 0
    dp_size: int = 1  # > 1: DP attention (each attention DP group holds KV of its own requests)
    serves: bool = True  # False: a rank of an attention DP group the request is not routed to
    load_balance_method: str = "follow_bootstrap_room"  # how the prefill picks a DP group
    dist_port: int = 0  # the prefill's torch.distributed store (SGLang's groups, on gloo)
    via_queue: bool = False  # prefill: through SGLang's PrefillBootstrapQueue (see above)
    layers: int = 4
    kv_heads: int = 12
    head_dim: int = 16
    pool_tokens: int = 512
    seed: int = 0
    abort_after_metadata: bool = False  # decode: abort the request once its metadata is out
    forged_aborts: bool = False  # decode: once its metadata is out, aborts without the secret
    killed_before_send: bool = False  # prefill: SIGKILL itself instead of sending the KV
    aborted_before_send: bool = False  # prefill: abort the request (SGLang's sender.abort)
    draft_dir: str = ""  # speculative decoding (EAGLE): the draft model, whose pool is moved too
    kv_dtype: str = "auto"  # SGLang's --kv-cache-dtype: "auto" (the model's bf16), "fp8_e4m3"...
    peer_kv_dtype: str = "auto"  # the other engine's
    # A sliding-window model (> 0: SGLang's sliding_window_size, in tokens): even layers full
    # attention, odd layers in SGLang's window pool (`SWAKVPool`), the request's tokens at
    # `window_pages` there (one a page of the request, as SGLang's allocator maps them).
    window: int = 0
    window_pages: list[int] = field(default_factory=list)
    # A hybrid linear-attention model (SGLang's `HybridLinearKVPool`: full-attention layers in a
    # KV pool, the others' conv and temporal state in a `MambaPool`): "gdn" (Qwen3-Next's gated
    # delta net), "mamba2" (NemotronH's) or "kda" (Kimi-Linear's, its conv channels last and its
    # full-attention layers MLA: with `mla`), its config in `model_dir`; the request's state at
    # `mamba_slot` of this engine's pool (never 0, SGLang's dummy slot), its index handed to
    # the backend as a one-element array, or with `mamba_slot_0d` on the decode as SGLang's
    # `_mamba_payload` makes it (a 0-d array: its `req_pool_idx` is an int; on the prefill
    # SGLang's own `CommonKVSender.send` takes `len()` of it before a backend sees it).
    mamba: str = ""
    mamba_slot: int = 0
    mamba_slot_0d: bool = False
    env: dict[str, str] = field(default_factory=dict)


def global_kv(cfg: RankConfig) -> Any:
    """The request's K and V of every layer, every head: `[layers, 2, tokens, heads, dim]`
    (MLA: `[layers, tokens, dim]`), from the seed: what the prefill computed. Where either
    engine keeps fp8, one value in 31 is beyond fp8's range or below its normals, where
    SGLang's fp8 write and vLLM's differ."""
    import torch

    g = torch.Generator().manual_seed(cfg.seed)
    if cfg.mla:
        shape: tuple[int, ...] = (cfg.layers, cfg.num_tokens, cfg.head_dim)
    else:
        shape = (cfg.layers, 2, cfg.num_tokens, cfg.kv_heads, cfg.head_dim)
    kv = torch.randn(shape, generator=g)
    if cfg.kv_dtype != "auto" or cfg.peer_kv_dtype != "auto":
        flat = kv.view(-1)
        extremes = torch.tensor([1e5, -3e5, 900.0, 1e-6, -5e-5, 470.0])
        flat[::31] = extremes.repeat(flat[::31].numel() // 6 + 1)[: flat[::31].numel()]
    return kv.to(torch.bfloat16)


def attn_tp(cfg: RankConfig) -> tuple[int, int]:
    """The rank's attention TP size and rank (DP attention splits TP into DP groups)."""
    size = cfg.tp_size // cfg.dp_size
    return size, cfg.tp_rank % size


def heads_of(cfg: RankConfig) -> slice:
    """This rank's KV heads (SGLang's and kvxfer's head ownership)."""
    size, rank = attn_tp(cfg)
    if cfg.kv_heads >= size:
        n = cfg.kv_heads // size
        return slice(rank * n, (rank + 1) * n)
    head = rank // (size // cfg.kv_heads)
    return slice(head, head + 1)


def token_slots(cfg: RankConfig) -> Any:
    """Each token's slot in this engine's pool: `page * page_size + offset`."""
    import torch

    t = torch.arange(cfg.num_tokens)
    pages = torch.tensor(cfg.pages)[t // cfg.page_size]
    return pages * cfg.page_size + t % cfg.page_size


def window_layers(cfg: RankConfig) -> list[int]:
    """The layers in the window pool (a sliding-window model's odd layers)."""
    return list(range(1, cfg.layers, 2)) if cfg.window else []


def window_slots(cfg: RankConfig) -> Any:
    """Each token's slot in this engine's window pool (`token_slots` of `window_pages`)."""
    import dataclasses

    return token_slots(dataclasses.replace(cfg, pages=cfg.window_pages))


def fetched_window(cfg: RankConfig) -> range:
    """The tokens of the window layers a decode needs (and kvxfer moves): what its first query,
    at position `num_tokens`, attends to under SGLang's FlashAttention and FlashInfer backends
    (`[p - window, p]`; Triton's attends one fewer), and what SGLang's own window pages hold."""
    return range(max(0, cfg.num_tokens - cfg.window), cfg.num_tokens)


def sent_window_pages(cfg: RankConfig) -> list[int]:
    """The window pages SGLang hands the backend (its "swa" state indices, prefill and decode
    alike): from the page-aligned window start to the last token."""
    start = max(0, cfg.num_tokens - cfg.window) // cfg.page_size
    return cfg.window_pages[start : -(-cfg.num_tokens // cfg.page_size)]


@dataclass(frozen=True)
class MambaGeometry:
    """A hybrid model's linear-attention state, whole (no TP), read from its config.json by
    the model's own rule, not SGLang's: the conv state's channel sub-blocks (GDN `[q | k | v]`,
    Mamba2 `[x | B | C]`) as `(rows, channels a row)` (a channel a row, but B and C: a group
    of N channels a row), each split evenly over TP, or replicated where it has fewer rows
    than ranks; its window (`kernel - 1`); the temporal state's heads, split evenly over TP,
    and each head's `(rows, cols)`; which layers keep state and which full-attention KV; and
    whether the conv keeps its channels last (Kimi's KDA: `[window, channels]`, each window row
    the sub-blocks' channels, else `[channels, window]`)."""

    segments: tuple[tuple[int, int], ...]
    window: int
    heads: int
    head_shape: tuple[int, int]
    state_layers: tuple[int, ...]
    full_layers: tuple[int, ...]
    channels_last: bool = False


def mamba_geometry(cfg: RankConfig) -> MambaGeometry:
    """The geometry of `cfg.model_dir`'s model: Qwen3-Next's gated delta net ("gdn": conv
    `[q | k | v]`, temporal `(value heads, value dim, key dim)`, every `full_attention_interval`-th
    layer full attention) or NemotronH's Mamba2 ("mamba2": conv `[x | B | C]` of `(heads x
    head dim, groups x N, groups x N)`, temporal `(heads, head dim, N)`; "M" layers keep state,
    "*" layers are attention) or Kimi-Linear's KDA ("kda": conv `[q | k | v]` of `heads x head
    dim` channels each (its q, k and v heads alike), channels last; temporal `(heads, head dim,
    head dim)`; the `kda_layers`, counted from 1, keep state, the others are MLA attention)."""
    import json

    hf = json.loads((Path(cfg.model_dir) / "config.json").read_text())
    layers = range(hf["num_hidden_layers"])
    if cfg.mamba == "kda":
        linear = hf["linear_attn_config"]
        width = linear["num_heads"] * linear["head_dim"]
        state = tuple(i - 1 for i in linear["kda_layers"])
        return MambaGeometry(
            ((width, 1),) * 3, linear["short_conv_kernel_size"] - 1, linear["num_heads"],
            (linear["head_dim"], linear["head_dim"]), state,
            tuple(i for i in layers if i not in state), channels_last=True,
        )  # fmt: skip
    if cfg.mamba == "gdn":
        key = hf["linear_num_key_heads"] * hf["linear_key_head_dim"]
        value = hf["linear_num_value_heads"] * hf["linear_value_head_dim"]
        full = tuple(i for i in layers if (i + 1) % hf["full_attention_interval"] == 0)
        return MambaGeometry(
            ((key, 1), (key, 1), (value, 1)), hf["linear_conv_kernel_dim"] - 1,
            hf["linear_num_value_heads"],
            (hf["linear_value_head_dim"], hf["linear_key_head_dim"]),
            tuple(i for i in layers if i not in full), full,
        )  # fmt: skip
    assert cfg.mamba == "mamba2", cfg.mamba
    groups = (hf["n_groups"], hf["ssm_state_size"])
    pattern = hf["hybrid_override_pattern"]
    return MambaGeometry(
        ((hf["mamba_num_heads"] * hf["mamba_head_dim"], 1), groups, groups), hf["conv_kernel"] - 1,
        hf["mamba_num_heads"], (hf["mamba_head_dim"], hf["ssm_state_size"]),
        tuple(i for i in layers if pattern[i] == "M"),
        tuple(i for i in layers if pattern[i] == "*"),
    )  # fmt: skip


def global_mamba(cfg: RankConfig) -> tuple[Any, Any]:
    """The request's linear-attention state at the end of its prefill, every channel and head
    (what a TP 1 engine holds), from the seed: conv `[state layers, channels, window]` (channels
    last: `[state layers, window, channels]`) in bf16, temporal `[state layers, heads, rows,
    cols]` in fp32."""
    import torch

    geo = mamba_geometry(cfg)
    g = torch.Generator().manual_seed(cfg.seed + 11)
    layers = len(geo.state_layers)
    channels = sum(rows * width for rows, width in geo.segments)
    shape = (geo.window, channels) if geo.channels_last else (channels, geo.window)
    conv = torch.randn((layers, *shape), generator=g)
    temporal = torch.randn((layers, geo.heads, *geo.head_shape), generator=g)
    return conv.to(torch.bfloat16), temporal


def mamba_of_rank(cfg: RankConfig, conv: Any, temporal: Any) -> tuple[Any, Any]:
    """A TP rank's part of the whole state (`global_mamba`): of every conv sub-block its
    `rank`-th even slice of rows (or, of fewer rows than ranks, row `rank // (tp / rows)`:
    a Mamba2 mixer of one group gives every rank B and C whole), the slices back to back (as
    the mixers' column-parallel conv holds them; channels last: in every window row), and its
    `rank`-th even slice of the temporal heads."""
    import torch

    geo = mamba_geometry(cfg)
    size, rank = attn_tp(cfg)
    channels, start = [], 0
    for rows, width in geo.segments:
        held = max(1, rows // size)
        first = rank * held if rows >= size else rank // (size // rows)
        channels.append(torch.arange(start + first * width, start + (first + held) * width))
        start += rows * width
    heads = geo.heads // size
    held = conv.index_select(conv_channel_axis(geo), torch.cat(channels))
    return held, temporal[:, rank * heads : (rank + 1) * heads]


def conv_channel_axis(geo: MambaGeometry) -> int:
    """The channels' axis of a conv state `[state layers, ...]` (`global_mamba`'s, a slot's)."""
    return 2 if geo.channels_last else 1


def mamba_index(cfg: RankConfig) -> list[np.ndarray]:
    """The request's "mamba" state indices, as a scheduler hands them to the backend: its slot
    (as an array of one, or on a decode as SGLang's `_mamba_payload` makes it: 0-d; a prefill's
    0-d slot fails in SGLang's own sender, `_record_transfer_indices`, before the backend)."""
    slot = np.asarray(cfg.mamba_slot, dtype=np.int32)
    zero_d = cfg.mamba_slot_0d and cfg.role == "decode"
    return [slot if zero_d else slot.reshape(1)]


def run_rank(cfg: RankConfig, conn: Any) -> None:
    """The process's body: report `("ok", result)` or `("error", traceback)` on `conn`."""
    try:
        os.environ.update(cfg.env)
        conn.send(("ok", _run(cfg, conn)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    # A rank lives on until every rank answered, as an engine does: a decode rank reports its
    # reads done to the prefill after its own result, and the prefill waits for that.
    conn.poll(WAIT_S)


_POOL_DTYPES = {"auto": "bfloat16", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def kv_scales(layer: int) -> tuple[float, float]:
    """A model layer's fp8 K and V scales, as a checkpoint gives them: values of bf16, on which
    SGLang's division on CPU (by the float32 scale) and on CUDA (by the scale cast to bf16)
    agree (`kvxfer.kernels.convert`)."""
    return 0.5 * (layer + 1), 0.25 * (layer + 2)


def _attention(cfg: RankConfig, layers: Sequence[int]) -> Any:
    """The stage's attention layers as SGLang's model builds them (`RadixAttention`), with the
    scales SGLang's KV cache method loads from a checkpoint (`BaseKVCacheMethod`) where the
    pool is fp8, and none otherwise (SGLang then divides by nothing)."""
    import torch
    from sglang.srt.layers.quantization.kv_cache import BaseKVCacheMethod
    from sglang.srt.layers.radix_attention import RadixAttention

    heads = 1 if cfg.mla else heads_of(cfg).stop - heads_of(cfg).start
    modules = torch.nn.ModuleList()
    for layer in layers:
        attention = RadixAttention(heads, cfg.head_dim, 1.0, heads, layer)
        if cfg.kv_dtype != "auto":
            method = BaseKVCacheMethod(None)
            method.create_weights(attention)
            # An MLA checkpoint without KV scales (as DeepSeek's): kvxfer refuses others
            # (`manager.model.latent_scales`: SGLang's MLA backends differ with them).
            k_scale, v_scale = (1.0, 1.0) if cfg.mla else kv_scales(layer)
            attention.k_scale.data.fill_(k_scale)  # as the checkpoint's weight loader does
            attention.v_scale.data.fill_(v_scale)
            method.process_weights_after_loading(attention)
        modules.append(attention)
    return modules


def _pool(cfg: RankConfig, layers: int, start: int) -> Any:
    """SGLang's KV pool of the rank, in its `kv_dtype` (a sliding-window model's: SGLang's
    `SWAKVPool`, a full pool and a window pool)."""
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    dtype = getattr(torch, _POOL_DTYPES[cfg.kv_dtype])
    if cfg.window:  # the stage's layers of each kind, as SGLang's model runner cuts them
        stage = range(start, start + layers)
        window = [i for i in window_layers(cfg) if i in stage]
        return SWAKVPool(
            size=cfg.pool_tokens, size_swa=cfg.pool_tokens, page_size=cfg.page_size,
            dtype=dtype, head_num=heads_of(cfg).stop - heads_of(cfg).start,
            head_dim=cfg.head_dim, swa_attention_layer_ids=window,
            full_attention_layer_ids=[i for i in stage if i not in window],
            device="cpu",
        )  # fmt: skip
    if cfg.mla:
        return MLATokenToKVPool(
            size=cfg.pool_tokens, page_size=cfg.page_size, dtype=dtype,
            kv_lora_rank=cfg.head_dim - 8, qk_rope_head_dim=8, layer_num=layers,
            device="cpu", enable_memory_saver=False, start_layer=start,
        )  # fmt: skip
    return MHATokenToKVPool(
        size=cfg.pool_tokens, page_size=cfg.page_size, dtype=dtype,
        head_num=heads_of(cfg).stop - heads_of(cfg).start, head_dim=cfg.head_dim,
        layer_num=layers, device="cpu", enable_memory_saver=False, start_layer=start,
    )  # fmt: skip


MAMBA_SLOTS = 6  # a MambaPool's requests (slots 1..6; slot 0 is SGLang's dummy)


def _hybrid_pool(cfg: RankConfig, args: Any, layers: range) -> Any:
    """SGLang's pool of a hybrid linear-attention model's stage, as its model runner builds it:
    a `HybridLinearKVPool` (the full-attention layers' KV, in the rank's `kv_dtype`) over a
    `MambaPool` of the state layers, whose shapes and dtypes are SGLang's own at this rank's
    attention TP (`mamba2_cache_params`, from SGLang's `ModelConfig`)."""
    import torch
    from sglang.srt.configs.hybrid_arch import mambaish_config
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, MambaPool

    params = mambaish_config(ModelConfig.from_server_args(args)).mamba2_cache_params
    mamba = MambaPool(
        size=MAMBA_SLOTS, spec_state_size=MAMBA_SLOTS, cache_params=params,
        mamba_layer_ids=[i for i in params.layers if i in layers], device="cpu",
    )  # fmt: skip
    return HybridLinearKVPool(
        size=cfg.pool_tokens, dtype=getattr(torch, _POOL_DTYPES[cfg.kv_dtype]),
        page_size=cfg.page_size,
        head_num=heads_of(cfg).stop - heads_of(cfg).start, head_dim=cfg.head_dim,
        full_attention_layer_ids=[i for i in mamba_geometry(cfg).full_layers if i in layers],
        device="cpu", mamba_pool=mamba, use_mla=cfg.mla,
        **({"kv_lora_rank": cfg.head_dim - 8, "qk_rope_head_dim": 8} if cfg.mla else {}),
    )  # fmt: skip


def _state_tensors(pool: Any) -> list[Any]:
    """A `MambaPool`'s conv and temporal tensors, `[state layers, slots, ...]` each."""
    return [*pool.mamba_pool.mamba_cache.conv, pool.mamba_pool.mamba_cache.temporal]


def _write_state(cfg: RankConfig, pool: Any) -> None:
    """The prefill's end state of the request (its part of `global_mamba`) into its slot, and
    other values into every other slot (another request's state, or the dummy's)."""
    import torch

    conv, temporal = _state_tensors(pool)
    g = torch.Generator().manual_seed(cfg.seed + 13)
    conv.copy_(torch.randn(conv.shape, generator=g).to(conv.dtype))
    temporal.copy_(torch.randn(temporal.shape, generator=g).to(temporal.dtype))
    want_conv, want_temporal = mamba_of_rank(cfg, *global_mamba(cfg))
    # A pipeline stage's pool keeps its own state layers: their rows of the whole state.
    stage = range(
        cfg.pp_rank * cfg.layers // cfg.pp_size, (cfg.pp_rank + 1) * cfg.layers // cfg.pp_size
    )
    held = [i for i, layer in enumerate(mamba_geometry(cfg).state_layers) if layer in stage]
    want_conv, want_temporal = want_conv[held], want_temporal[held]
    shapes = (conv[:, cfg.mamba_slot].shape, temporal[:, cfg.mamba_slot].shape)
    assert shapes == (want_conv.shape, want_temporal.shape), f"SGLang's state {shapes}"
    conv[:, cfg.mamba_slot] = want_conv
    temporal[:, cfg.mamba_slot] = want_temporal


def _held_state(cfg: RankConfig, pool: Any) -> dict[str, Any]:
    """What a decode's `MambaPool` holds at the request's slot (conv as int16 bits, temporal as
    int32 bits), and whether every other slot of both tensors keeps its poison."""
    import torch

    conv, temporal = _state_tensors(pool)
    others = [i for i in range(conv.shape[1]) if i != cfg.mamba_slot]
    untouched = all(
        bool((t[:, others].view(torch.uint8) == POISON_BYTE).all()) for t in (conv, temporal)
    )
    return {
        "conv": conv[:, cfg.mamba_slot].view(torch.int16).numpy().copy(),
        "temporal": temporal[:, cfg.mamba_slot].view(torch.int32).numpy().copy(),
        "untouched": untouched,
    }


# Speculative decoding as SGLang's server arguments take it (one draft token a step: pages of
# more than one token need it on CPU attention).
_EAGLE = {
    "speculative_algorithm": "EAGLE",
    "speculative_eagle_topk": 1,
    "speculative_num_steps": 3,
    "speculative_num_draft_tokens": 4,
}
DRAFT_KV_HEADS, DRAFT_LAYERS = 4, 1  # the draft model's (tests/integration_sglang's draft config)


def draft_config(cfg: RankConfig) -> RankConfig:
    """The rank as its draft model's pool sees it: the draft's heads and layers (its own KV,
    from another seed, full attention); the pages are the target's, as SGLang shares them."""
    import dataclasses

    return dataclasses.replace(
        cfg, kv_heads=DRAFT_KV_HEADS, layers=DRAFT_LAYERS, pp_size=1, pp_rank=0,
        seed=cfg.seed + 7, window=0, window_pages=[],
    )  # fmt: skip


def _draft_pool(cfg: RankConfig, kv_args: Any) -> tuple[Any, Any]:
    """The draft model's pool and attention layers, appended to `kv_args`' buffers as
    SGLang's schedulers append them (`num_draft_entries`), its scales recorded as the plugin's
    hook records a draft runner's."""
    from kvxfer.integrations.sglang.loaded import record_model_scales

    draft = draft_config(cfg)
    pool = _pool(draft, DRAFT_LAYERS, 0)
    attention = _attention(draft, range(DRAFT_LAYERS))
    record_model_scales(attention, draft=True)
    ptrs, lens, item_lens = pool.get_contiguous_buf_infos()
    kv_args.kv_data_ptrs += ptrs
    kv_args.kv_data_lens += lens
    kv_args.kv_item_lens += item_lens
    kv_args.num_draft_entries = len(ptrs)
    return pool, attention


def _write(cfg: RankConfig, pool: Any, attention: Any, kv: Any, slots: Any, tokens: slice) -> None:
    """SGLang's own write of the rank's heads of `tokens`, every layer of the stage, as an
    attention backend calls it (`set_kv_buffer` with the layer's scales, on copies: it divides
    in place)."""
    for layer in attention:
        if cfg.mla:  # the latent row is K; MLA has no V
            pool.set_kv_buffer(layer, slots[tokens], kv[layer.layer_id, tokens][:, None], None)
            continue
        h = heads_of(cfg)
        k, v = kv[layer.layer_id, 0, tokens, h].clone(), kv[layer.layer_id, 1, tokens, h].clone()
        loc = slots[tokens]
        if cfg.window:  # the write location in both pools, as an attention backend gives it
            from sglang.srt.mem_cache.memory_pool import KVWriteLoc

            loc = KVWriteLoc(slots[tokens], window_slots(cfg)[tokens], None)
        pool.set_kv_buffer(layer, loc, k, v, layer.k_scale, layer.v_scale)


def _converted(
    cfg: RankConfig, kv: Any, slots: Any, layers: Sequence[int], new_pool: Callable[..., Any]
) -> np.ndarray:
    """What a decode rank fed KV of another dtype must hold (as `_held` reads it): into fp8, its
    own SGLang write of the request's KV; out of fp8, the prefill's SGLang write of it times
    the prefill's scale, rounded to the decode's dtype (kvxfer's dequantization; MLA: the latent
    cast, with no scale, as SGLang's MLA pool writes it). `layers`: the model's layer ids the
    pool keeps (a hybrid model's full-attention layers), each with its own scales; `new_pool`:
    a fresh pool of the rank's kind for a `RankConfig` (its dtype)."""
    import dataclasses

    import torch

    tokens = slice(0, cfg.num_tokens)
    if cfg.kv_dtype != "auto":
        pool = new_pool(cfg)
        _write(cfg, pool, _attention(cfg, layers), kv, slots, tokens)
        return _held(pool, cfg, slots, layers)
    fp8 = dataclasses.replace(cfg, kv_dtype=cfg.peer_kv_dtype)
    pool = new_pool(fp8)
    _write(fp8, pool, _attention(fp8, layers), kv, slots, tokens)
    planes = []
    for layer in layers:
        if cfg.mla:  # SGLang's MLA pool keeps the latent cast to fp8, with no scale
            planes.append(pool.get_key_buffer(layer)[slots, 0].to(torch.bfloat16))
            continue
        k_scale, v_scale = kv_scales(layer)
        at = window_slots(cfg) if layer in window_layers(cfg) else slots
        k = pool.get_key_buffer(layer)[at].float() * k_scale
        v = pool.get_value_buffer(layer)[at].float() * v_scale
        planes.append(torch.stack([k, v]).to(torch.bfloat16))
    return torch.stack(planes).view(torch.int16).numpy().copy()


def _run(cfg: RankConfig, conn: Any) -> dict[str, Any]:
    import torch
    from sglang.srt.plugins import load_plugins

    load_plugins()  # the entry point, as every SGLang scheduler process runs it, first
    from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
    from sglang.srt.disaggregation.utils import (
        DisaggregationMode,
        KVClassType,
        MetadataBuffers,
        TransferBackend,
        build_kv_layer_ids,
        get_kv_class,
        setup_state_kv_args,
    )
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
    from sglang.srt.server_args import ServerArgs

    from kvxfer.integrations.sglang.loaded import record_model_scales, record_sliding_window

    prefill = cfg.role == "prefill"
    args = ServerArgs(
        model_path=cfg.model_dir,
        disaggregation_mode=cfg.role,
        disaggregation_transfer_backend="kvxfer",
        disaggregation_bootstrap_port=cfg.bootstrap_port,
        host="127.0.0.1",
        port=30000 + cfg.bootstrap_port % 1000 + (0 if prefill else 500),
        tp_size=cfg.tp_size,
        pp_size=cfg.pp_size,
        dp_size=cfg.dp_size,
        enable_dp_attention=cfg.dp_size > 1,
        load_balance_method=cfg.load_balance_method,
        page_size=cfg.page_size,
        skip_tokenizer_init=True,
        device="cpu",
        **({**_EAGLE, "speculative_draft_model_path": cfg.draft_dir} if cfg.draft_dir else {}),
        # What SGLang needs of a hybrid linear-attention model on CPU (its "extra_buffer" radix
        # cache strategy and the overlap scheduler are CUDA's; "no_buffer" takes pages of one
        # token unless the radix cache is off, as a decode's always is).
        **(
            {
                "mamba_radix_cache_strategy": "no_buffer",
                "disable_overlap_schedule": True,
                "disable_radix_cache": True,
            }
            if cfg.mamba
            else {}
        ),
    )
    world_rank = cfg.pp_rank * cfg.tp_size + cfg.tp_rank
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=world_rank, gpu_id=0))
    # SGLang's own groups, on gloo: the prefill's PPConsensusStore uses PP's, and the bootstrap
    # queue all-reduces its polls over attention TP's.
    if cfg.pp_size > 1 or cfg.via_queue:
        from sglang.srt.distributed.parallel_state import (
            init_distributed_environment,
            initialize_model_parallel,
        )

        init_distributed_environment(
            world_size=cfg.tp_size * cfg.pp_size, rank=world_rank, local_rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{cfg.dist_port}", backend="gloo",
        )  # fmt: skip
        initialize_model_parallel(backend="gloo")
    else:
        get_parallel().override_permanently(pp_group=None)

    layers = cfg.layers // cfg.pp_size
    start = cfg.pp_rank * layers
    stage = range(start, start + layers)

    def new_pool(c: RankConfig) -> Any:  # the rank's pool (or the oracle's, in `c.kv_dtype`)
        return _hybrid_pool(c, args, stage) if c.mamba else _pool(c, layers, start)

    pool = new_pool(cfg)
    kv_layers = [i for i in mamba_geometry(cfg).full_layers if i in stage] if cfg.mamba else stage
    attention = _attention(cfg, kv_layers)
    # What kvxfer's plugin hook records as SGLang's ModelRunner loads the model (this process
    # has no model runner): the layers' fp8 scales.
    record_model_scales(attention)
    record_sliding_window(cfg.window or None)  # as the hook records the model runner's
    meta = MetadataBuffers(8, 16, torch.float32, 0)
    buffers = _buffers(pool)
    if not prefill:
        for b in [*buffers, *(_state_tensors(pool) if cfg.mamba else ())]:
            b.view(torch.uint8).fill_(POISON_BYTE)

    kv_args = KVArgs()
    # As prefill.py and decode.py fill it: the decode's is its attention TP rank.
    kv_args.engine_rank = cfg.tp_rank if prefill else attn_tp(cfg)[1]
    kv_args.pp_rank = cfg.pp_rank
    kv_args.system_dp_rank = 0
    kv_args.rust_http_port = None
    kv_args.kv_cache_dtype_str = cfg.kv_dtype
    kv_args.kv_layout = None
    kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens = (
        pool.get_contiguous_buf_infos()
    )
    kv_args.num_draft_entries = 0
    draft_pool, draft_attention = _draft_pool(cfg, kv_args) if cfg.draft_dir else (None, None)
    if draft_pool is not None and not prefill:
        buffers = [*buffers, *draft_pool.k_buffer, *draft_pool.v_buffer]
        for b in buffers:
            b.view(torch.uint8).fill_(POISON_BYTE)
    # As prefill.py and decode.py fill them: a hybrid pool's global layer ids of its K and V
    # buffers (its full-attention layers'), none for the other pools.
    kv_args.kv_layer_ids = build_kv_layer_ids(
        token_to_kv_pool=pool, draft_token_to_kv_pool=draft_pool,
        num_draft_entries=kv_args.num_draft_entries, num_hidden_layers=cfg.layers,
    )  # fmt: skip
    if prefill and not cfg.mla:  # the decode scheduler leaves them unset (decode.py)
        kv_args.kv_head_num = pool.head_num
        kv_args.total_kv_head_num = cfg.kv_heads
    kv_args.page_size = cfg.page_size
    if prefill:  # as prefill.py fills them: a SWAKVPool's start is 0 on every stage
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.disaggregation.prefill import _transfer_start_layer

        hf_text_config = ModelConfig.from_server_args(args).hf_text_config
        kv_args.prefill_start_layer = _transfer_start_layer(
            pool=pool, hf_text_config=hf_text_config
        )
        kv_args.prefill_end_layer = getattr(pool, "end_layer", None)
    kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens = meta.get_buf_infos()
    kv_args.ib_device = None
    kv_args.gpu_id = 0
    setup_state_kv_args(kv_args, pool, None, cfg.layers)
    if cfg.mamba:  # SGLang's one "mamba" state: conv and temporal of every state layer
        assert [t.value for t in kv_args.state_types] == ["mamba"], kv_args.state_types

    backend = TransferBackend("kvxfer")
    mode = DisaggregationMode.PREFILL if prefill else DisaggregationMode.DECODE
    if cfg.via_queue:
        queue = _bootstrap_queue(cfg, args, pool, meta, backend)
        manager = queue.kv_manager
    else:
        manager = get_kv_class(backend, KVClassType.MANAGER)(kv_args, mode, args, cfg.mla)
    addr = f"127.0.0.1:{cfg.bootstrap_port}"
    if not cfg.serves:  # up and registered, as an engine's other DP groups are
        return {"serves": False}
    kv = global_kv(cfg)
    slots = token_slots(cfg)
    states: list[int] = []

    def wait_for(target: set[int], poller: Any) -> int:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            state = poller.poll()
            if not states or states[-1] != state:
                states.append(int(state))
            if state in target:
                return int(state)
            time.sleep(0.01)
        producers = manager.producer.producers if manager.producer is not None else []
        stats = [p.stats_snapshot() for p in producers]
        raise TimeoutError(f"{cfg.role} rank {cfg.tp_rank}: states {states} {stats}")

    if prefill:
        num_pages = len(cfg.pages)
        if cfg.via_queue:
            sender, aux_index = _bootstrapped(queue, cfg)
        else:
            sender = get_kv_class(backend, KVClassType.SENDER)(manager, addr, cfg.room)
            wait_for({KVPoll.WaitingForInput, KVPoll.Failed}, sender)
            aux_index = cfg.aux_index
            sender.init(num_pages, aux_index)
        if cfg.killed_before_send:
            os.kill(os.getpid(), signal.SIGKILL)
        if cfg.aborted_before_send:
            sender.abort()
            num_pages = 0  # sends nothing, as SGLang's scheduler does for an aborted request
        half = num_pages // 2
        for first, last in ((0, half), (half, num_pages)) if num_pages else ():
            tokens = slice(first * cfg.page_size, min(last * cfg.page_size, cfg.num_tokens))
            _write(cfg, pool, attention, kv, slots, tokens)
            if draft_pool is not None:  # the draft model's KV of the same pages
                draft_kv = global_kv(draft_config(cfg))
                _write(draft_config(cfg), draft_pool, draft_attention, draft_kv, slots, tokens)
            if last == num_pages:  # the first output token and its metadata, as set_buf
                meta.output_ids[aux_index, 0] = 1000 + cfg.room % 1000
                meta.bootstrap_room[aux_index, 0] = cfg.room
            pages = np.asarray(cfg.pages[first:last], dtype=np.int32)
            window = None
            if cfg.window and last == num_pages:  # the last chunk's state indices
                window = [np.asarray(sent_window_pages(cfg), dtype=np.int32)]
                _free_before_window(pool, cfg)
            if cfg.mamba and last == num_pages:  # the state, once the prefill's forward ends
                _write_state(cfg, pool)
                window = mamba_index(cfg)
            sender.send(pages, window, num_kv_tokens=tokens.stop - tokens.start)
        final = wait_for({KVPoll.Success, KVPoll.Failed}, sender)
        reason = None
        if final == KVPoll.Failed:
            try:
                sender.failure_exception()
            except Exception as exc:
                reason = str(exc)
        held = _held(pool, cfg, slots, kv_layers)
        return {
            "states": states, "held": held, "reason": reason, "tp_rank": cfg.tp_rank,
            "pp_rank": cfg.pp_rank, "layers": slice(start, start + layers),
            "draft_held": _draft_held(draft_pool, cfg, slots),
        }  # fmt: skip

    receiver_cls = get_kv_class(backend, KVClassType.RECEIVER)
    receiver = receiver_cls(manager, addr, cfg.room)
    deadline = time.monotonic() + WAIT_S
    while not manager.try_ensure_parallel_info(addr):
        assert time.monotonic() < deadline, "the prefill never registered"
        time.sleep(0.05)
    receiver.init(_prefill_dp_rank(manager, addr, cfg.room))
    # Connected to every prefill rank before the metadata lets the prefill go on: a prefill
    # rank killed once bootstrapped then dies mid-transfer, not mid-handshake.
    while manager.consumer_of(receiver.group_key) is None:
        assert time.monotonic() < deadline, "the decode rank never connected"
        time.sleep(0.01)
    pages = np.asarray(cfg.pages, dtype=np.int32)
    window = [np.asarray(sent_window_pages(cfg), dtype=np.int32)] if cfg.window else None
    window = mamba_index(cfg) if cfg.mamba else window
    receiver.send_metadata(pages, cfg.aux_index, window, decode_prefix_len=0)
    if cfg.abort_after_metadata:
        receiver.abort()
    if cfg.forged_aborts:
        _forge_aborts(receiver, cfg.room)
    final = wait_for({KVPoll.Success, KVPoll.Failed}, receiver)
    reason = None
    if final == KVPoll.Failed:
        receiver.ensure_abort_notified(force_arm=True)  # as SGLang's decode does on a failure
        deadline = time.monotonic() + WAIT_S
        while not manager.is_abort_release_safe(cfg.room, 0):
            assert time.monotonic() < deadline, "a failed fetch never ended"
            time.sleep(0.01)
        try:
            receiver.failure_exception()
        except Exception as exc:
            reason = str(exc)
    converting = cfg.kv_dtype != cfg.peer_kv_dtype
    return {
        "states": states,
        "held": _held(pool, cfg, slots, kv_layers),
        "state": _held_state(cfg, pool) if cfg.mamba else None,
        "converted": _converted(cfg, kv, slots, kv_layers, new_pool) if converting else None,
        "draft_held": _draft_held(draft_pool, cfg, slots),
        "untouched": _untouched(pool, buffers, cfg, slots),
        "aux": (int(meta.output_ids[cfg.aux_index, 0]), int(meta.bootstrap_room[cfg.aux_index, 0])),
        "reason": reason,
    }


def _forge_aborts(receiver: Any, room: int) -> None:
    """What an engine without the secret can send the prefill ranks about a request that this
    rank (with the secret) reads: SGLang's unsigned ABORT, and kvxfer's `Abandoned` under
    another secret; after this rank's `Reading`, on the same socket (so in that order)."""
    from sglang.srt.disaggregation.common.conn import AbortNotification

    from kvxfer.integrations.sglang.control import Abandoned, frames_of

    for info in receiver.bootstrap_infos:
        sock, lock = receiver._connect_to_bootstrap_server(info)
        with lock:
            sock.send_multipart(AbortNotification(room=room).to_zmq())
            sock.send_multipart(frames_of(Abandoned(room=room), "guess"))


def _bootstrap_queue(cfg: RankConfig, args: Any, pool: Any, meta: Any, backend: Any) -> Any:
    """SGLang's `PrefillBootstrapQueue` over the rank's pool: it fills `KVArgs` and builds the
    backend's manager itself (`_init_kv_manager`). The scheduler is a stand-in in SGLang's own
    test style (a `MagicMock`), given what the queue reads of it."""
    from unittest.mock import MagicMock

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
    from sglang.srt.disaggregation.utils import ReqToMetadataIdxAllocator
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    scheduler = MagicMock()
    scheduler.server_args = args
    scheduler.model_config = ModelConfig.from_server_args(args)
    scheduler.rust_server = None
    scheduler.req_to_token_pool = None
    scheduler.tp_worker.model_runner.kv_cache_dtype_str = "auto"
    scheduler.tp_worker.model_runner.effective_logical_max_total_num_tokens = cfg.pool_tokens
    scheduler.kv_shard_widening = 1
    scheduler.token_to_kv_pool_allocator.page_size = cfg.page_size
    scheduler.attn_tp_cpu_group = parallel.attn_tp_group.cpu_group
    scheduler.attn_cp_cpu_group = parallel.attn_cp_group.cpu_group
    scheduler.pp_group = parallel.pp_group
    scheduler.processed_tokens_counter = 0
    return PrefillBootstrapQueue(
        token_to_kv_pool=pool, draft_token_to_kv_pool=None,
        req_to_metadata_buffer_idx_allocator=ReqToMetadataIdxAllocator(8),
        metadata_buffers=meta, gpu_id=0, bootstrap_port=cfg.bootstrap_port,
        max_total_num_tokens=cfg.pool_tokens, scheduler=scheduler,
        scheduler_stage_metrics=MagicMock(), transfer_backend=backend,
    )  # fmt: skip


def _bootstrapped(queue: Any, cfg: RankConfig) -> tuple[Any, int]:
    """The request added to the queue as SGLang's prefill scheduler adds it, and popped once
    bootstrapped (a collective over the attention TP and PP groups: every rank of the engine
    calls it alike): its sender, `init` by the queue, and its metadata buffer row."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(
        f"req-{cfg.room}", "", list(range(cfg.num_tokens)), SamplingParams(max_new_tokens=8),
        bootstrap_host="127.0.0.1", bootstrap_port=cfg.bootstrap_port, bootstrap_room=cfg.room,
    )  # fmt: skip
    queue.add(req, num_kv_heads=cfg.kv_heads)
    assert queue.queue == [req], "the queue refused the request"
    deadline = time.monotonic() + WAIT_S
    while req not in queue.pop_bootstrapped():
        assert not queue.scheduler.handle_bootstrap_failure.called, "the bootstrap failed"
        assert time.monotonic() < deadline, "the request never bootstrapped"
        time.sleep(0.01)
    assert req.sampling_params.max_new_tokens == 1  # the queue's own step (_process_req)
    return req.disagg_kv_sender, req.metadata_buffer_index


def _prefill_dp_rank(manager: Any, addr: str, room: int) -> int:
    """The prefill DP group that holds the request, found as SGLang's decode finds it
    (`DecodePreallocQueue._resolve_prefill_dp_rank`): DP 1, the room when the prefill follows
    it, else the bootstrap server's `/query_dp_ranks` (the prefill's sender registered it)."""
    from sglang.srt.disaggregation.common.conn import CommonKVReceiver

    info = manager.prefill_info_table[addr]
    if info.dp_size == 1:
        return 0
    if info.follow_bootstrap_room:
        return room % int(info.dp_size)
    deadline = time.monotonic() + WAIT_S
    while str(room) not in (ranks := CommonKVReceiver.query_prefill_dp_ranks(addr, [room])):
        assert time.monotonic() < deadline, "the prefill never registered the request's DP rank"
        time.sleep(0.05)
    return int(ranks[str(room)])


def _held(pool: Any, cfg: RankConfig, slots: Any, layers: int | Sequence[int]) -> np.ndarray:
    """What the pool holds at the request's slots: `[layers, 2, tokens, heads, dim]` (MLA:
    `[layers, tokens, dim]`), read through SGLang's own buffer getters, as int16 bits (a
    numpy copy: a tensor would cross the pipe as shared memory that dies with this process).
    `layers`: the stage's count, or the model's layer ids that keep KV (a hybrid model's)."""
    import torch

    if isinstance(layers, int):
        layers = range(cfg.pp_rank * layers, (cfg.pp_rank + 1) * layers)
    if cfg.mla:
        held = torch.stack([pool.get_key_buffer(i)[slots, 0] for i in layers])
    else:
        at = [window_slots(cfg) if i in window_layers(cfg) else slots for i in layers]
        held = torch.stack(
            [
                torch.stack([pool.get_key_buffer(i)[at[n]], pool.get_value_buffer(i)[at[n]]])
                for n, i in enumerate(layers)
            ]
        )
    return held.view(torch.int16).numpy().copy()


def _draft_held(pool: Any, cfg: RankConfig, slots: Any) -> np.ndarray | None:
    """What the draft pool holds at the request's slots (`_held`), if the rank has one."""
    return None if pool is None else _held(pool, draft_config(cfg), slots, DRAFT_LAYERS)


def _buffers(pool: Any) -> list[Any]:
    """Every KV buffer of SGLang's pool (a sliding-window pool's: its full pool's, then its
    window pool's)."""
    if hasattr(pool, "swa_kv_pool"):
        return [*_buffers(pool.full_kv_pool), *_buffers(pool.swa_kv_pool)]
    if hasattr(pool, "mamba_pool"):  # a hybrid linear-attention pool's KV
        return _buffers(pool.full_kv_pool)
    return pool.kv_buffer if hasattr(pool, "kv_buffer") else [*pool.k_buffer, *pool.v_buffer]


def _untouched(pool: Any, buffers: list[Any], cfg: RankConfig, slots: Any) -> bool:
    """Whether every byte outside the request's slots still holds the poison: of a window
    pool, outside the slots of the tokens the decode needs (`fetched_window`)."""
    import torch

    written = {id(b): slots for b in buffers}
    if cfg.window:
        needed = window_slots(cfg)[list(fetched_window(cfg))]
        written.update({id(b): needed for b in _buffers(pool.swa_kv_pool)})
    for b in buffers:
        keep = torch.ones(b.shape[0], dtype=torch.bool)
        keep[written[id(b)]] = False
        if not bool((b[keep].view(torch.uint8) == POISON_BYTE).all()):
            return False
    return True


def _free_before_window(pool: Any, cfg: RankConfig) -> None:
    """What SGLang does with a prefill's window pages before the window (it frees them as the
    prefill moves on, and another request may write them): overwritten, so that a transfer
    that read them would be seen."""
    import torch

    window_start = max(0, cfg.num_tokens - cfg.window) // cfg.page_size * cfg.page_size
    before = window_slots(cfg)[:window_start]
    for b in _buffers(pool.swa_kv_pool):
        b[before].view(torch.uint8).fill_(0x33)
