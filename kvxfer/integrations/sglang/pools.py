"""SGLang's KV pools as kvxfer's layout contract, read from the pointers SGLang hands a transfer
backend (`KVArgs.kv_data_ptrs`, `kv_data_lens`, `kv_item_lens`), and checked, never assumed.

What SGLang 0.5.23 allocates (`sglang.srt.mem_cache.memory_pool`; docs/sglang.md):

- `MHATokenToKVPool` keeps per layer a K buffer and a V buffer of `[size + page_size, heads,
  head_dim]` (token slots, NHD), and registers them as K of every layer, then V of every layer.
  When K and V have one shape it allocates them as the two halves of one `[2, rows, heads,
  head_dim]` tensor per layer: exactly the contract's NHD `kv_first` layer
  `[2, num_blocks, block_size, heads, head_dim]`, with SGLang's pages as blocks. That is the
  layout accepted here, after checking that each layer's V starts where its K ends and that
  the page size divides the rows; K and V apart in memory (another allocator, `vectorized_5d`,
  a V head size unlike K's) is refused, naming what differs.
- `MLATokenToKVPool` keeps one latent buffer `[size + page_size, 1, kv_lora_rank +
  qk_rope_head_dim]` per layer: the contract's MLA layer `[num_blocks, block_size, head_dim]`.

Page `p`, slot `s` is SGLang's token slot `p * page_size + s`, so SGLang's page ids are the block
ids kvxfer moves. Page 0 is SGLang's padding page, never a request's.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvxfer.spec import DTYPE_ITEMSIZE, FP8_DTYPES, TORCH_DTYPES, KVCacheSpec

# SGLang's `--kv-cache-dtype` names of the formats kvxfer moves (bit for bit); "auto" is the
# model's dtype.
_SGLANG_KV_DTYPES: dict[str, str] = {
    "bfloat16": "bfloat16",
    "float16": "float16",
    "float32": "float32",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}


@dataclass(frozen=True)
class SGLangModel:
    """What the pools' pointers do not say, from SGLang's `ModelConfig` and server arguments.

    Attributes:
        total_kv_heads: KV heads of the whole model (1 for MLA).
        head_dim: elements per head (MLA: `kv_lora_rank + qk_rope_head_dim`).
        total_layers: attention layers of the whole model (a hybrid model's of the pool's
            kind: its full-attention layers).
        dtype: the KV cache's dtype, a `KVCacheSpec.dtype` name.
        mla: the model keeps an MLA latent cache.
        k_scales: an fp8 pool's K scale per layer of its pipeline stage
            (`kvxfer.integrations.sglang.loaded`); empty for other dtypes.
        v_scales: the same for V (empty for MLA, whose latent uses `k_scales`: 1.0 every
            layer, as SGLang's MLA pool casts the latent with no scale).
        layer_start: the pool's first layer among those `total_layers` (a pipeline stage's).
    """

    total_kv_heads: int
    head_dim: int
    total_layers: int
    dtype: str
    mla: bool = False
    k_scales: tuple[float, ...] = ()
    v_scales: tuple[float, ...] = ()
    layer_start: int = 0


def kv_dtype_name(kv_cache_dtype: str, model_dtype: torch.dtype) -> str:
    """kvxfer's name for SGLang's `--kv-cache-dtype` (`"auto"`: the model's dtype).

    Raises:
        ValueError: a format kvxfer does not move (fp4, int8 with scales...), naming the setting.
    """
    if kv_cache_dtype == "auto":
        for name, dtype in TORCH_DTYPES.items():
            if dtype == model_dtype:
                return name
        raise ValueError(f"the model's dtype {model_dtype} is not a KV dtype kvxfer moves")
    if kv_cache_dtype not in _SGLANG_KV_DTYPES:
        raise ValueError(
            f"--kv-cache-dtype {kv_cache_dtype!r} is not a format kvxfer moves; use one of "
            f"{['auto', *_SGLANG_KV_DTYPES]}"
        )
    return _SGLANG_KV_DTYPES[kv_cache_dtype]


def heads_held(total_kv_heads: int, tp_size: int) -> int:
    """KV heads one attention-TP rank holds: SGLang's `max(1, H // T)` (replicated when
    `H < T`), the contract's head ownership."""
    return max(1, total_kv_heads // tp_size)


def tensor_at(ptr: int, nbytes: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The `nbytes` of memory at `ptr` as a flat tensor of `dtype`, sharing that memory (SGLang
    hands a backend pointers, not tensors). The memory must outlive the tensor: it is the
    engine's pool, alive while the engine runs."""
    if device.type == "cpu":
        raw = (ctypes.c_uint8 * nbytes).from_address(ptr)
        flat = torch.frombuffer(raw, dtype=torch.uint8)
    elif device.type == "cuda":
        flat = torch.as_tensor(_CudaMemory(ptr, nbytes), device=device)
    else:
        raise ValueError(f"device {device}: kvxfer's SGLang backend runs on CPU or CUDA")
    return flat.view(dtype)


class _CudaMemory:
    """Device memory as the CUDA array interface, for `torch.as_tensor`."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
        }


def sglang_cache(
    ptrs: Sequence[int],
    lens: Sequence[int],
    item_lens: Sequence[int],
    page_size: int,
    model: SGLangModel,
    *,
    tp_size: int,
    tp_rank: int,
    pp_size: int = 1,
    pp_rank: int = 0,
    layer_start: int = 0,
    device: torch.device | str = "cpu",
) -> tuple[KVCacheSpec, list[torch.Tensor]]:
    """One rank's SGLang KV pool as a spec and its layer tensors (the module docstring).

    Args:
        ptrs, lens, item_lens: `KVArgs.kv_data_ptrs`, `kv_data_lens`, `kv_item_lens` (MHA: K of
            every layer, then V of every layer; MLA: one buffer per layer).
        page_size: SGLang's `--page-size`.
        model: what the pointers do not say.
        tp_size, tp_rank: the attention-TP group.
        pp_size, pp_rank, layer_start: the pipeline stage and its first global layer.
        device: where the pool lives.

    Raises:
        ValueError: a pool layout kvxfer has not verified, naming what differs.
    """
    device = torch.device(device)
    dtype = TORCH_DTYPES[model.dtype]
    itemsize = DTYPE_ITEMSIZE[model.dtype]
    heads = 1 if model.mla else heads_held(model.total_kv_heads, tp_size)
    row_bytes = heads * model.head_dim * itemsize
    buffers = len(ptrs)
    if not buffers or len(lens) != buffers or len(item_lens) != buffers:
        raise ValueError(
            f"KVArgs: {buffers} kv_data_ptrs, {len(lens)} lens, {len(item_lens)} item_lens; "
            "expected one of each per KV buffer"
        )
    num_layers = buffers if model.mla else buffers // 2
    if not model.mla and buffers % 2:
        raise ValueError(
            f"KVArgs: {buffers} KV buffers for an MHA pool, expected K and V of every layer "
            "(a draft model's pool is counted by KVArgs.num_draft_entries)"
        )
    for i, (n, item) in enumerate(zip(lens, item_lens, strict=True)):
        if item != page_size * row_bytes:
            raise ValueError(
                f"KV buffer {i}: {item} bytes per page, expected page_size {page_size} x "
                f"{heads} heads x head_dim {model.head_dim} x {itemsize} bytes; the pool is not "
                "a layout kvxfer has verified (its KV dtype, head count or a quantized format)"
            )
        if n != lens[0] or n % item:
            raise ValueError(
                f"KV buffer {i}: {n} bytes, not a whole number of pages like buffer 0 "
                f"({lens[0]} bytes); the pool is not a layout kvxfer has verified"
            )
    num_blocks = lens[0] // item_lens[0]
    layers = []
    for layer in range(num_layers):
        k = ptrs[layer]
        if model.mla:
            shape: tuple[int, ...] = (num_blocks, page_size, model.head_dim)
            nbytes = lens[layer]
        else:
            v = ptrs[num_layers + layer]
            if v != k + lens[layer]:
                raise ValueError(
                    f"layer {layer}: V starts {v - k} bytes after K, expected {lens[layer]} "
                    "(K and V as the two halves of one allocation, SGLang's MHA pool with "
                    "equal K and V shapes); a pool with K and V apart is not a layout kvxfer "
                    "has verified"
                )
            shape = (2, num_blocks, page_size, heads, model.head_dim)
            nbytes = 2 * lens[layer]
        layers.append(tensor_at(k, nbytes, dtype, device).view(shape))
    spec = KVCacheSpec(
        num_layers=num_layers,
        num_kv_heads=1 if model.mla else model.total_kv_heads,
        head_dim=model.head_dim,
        dtype=model.dtype,  # type: ignore[arg-type]
        tp_size=tp_size,
        tp_rank=tp_rank,
        block_size=page_size,
        num_blocks=num_blocks,
        layout="NHD",
        kv_placement="kv_first",
        mla=model.mla,
        pp_size=pp_size,
        pp_rank=pp_rank,
        layer_start=layer_start if pp_size > 1 else 0,
        total_layers=model.total_layers if pp_size > 1 else 0,
        k_scales=model.k_scales,
        v_scales=model.v_scales,
        # SGLang's fp8 write (`MHATokenToKVPool.set_kv_buffer`): kvxfer.kernels.convert
        fp8_rounding="torch_cast" if model.dtype in FP8_DTYPES else "nearest_even",
    )
    return spec, layers


def window_table(pages: Sequence[int], num_tokens: int, page_size: int) -> list[int]:
    """A request's sliding-window pages (SGLang's "swa" state indices: the window pool's pages
    of the request's last pages, from a page-aligned window start to its last token) as the
    window group's block table: the request's every page, 0 (SGLang's padding page, never
    read or written: `CacheGroup`'s window) before the window.

    Raises:
        ValueError: more window pages than the request has pages.
    """
    pages = [int(p) for p in pages]
    blocks = -(-num_tokens // page_size)
    if len(pages) > blocks:
        raise ValueError(
            f"{len(pages)} sliding-window pages for a request of {num_tokens} tokens "
            f"({blocks} pages of {page_size}); SGLang's window indices do not fit the request"
        )
    return [0] * (blocks - len(pages)) + pages
