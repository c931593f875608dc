"""A plain reference for the layout contract: put a request's KV into a rank's cache.

It indexes each layout of docs/design.md's table directly, with no planner involved, so tests, the
demo and notebooks can build source caches and expected destination caches independently of
the code under test. Global KV is `[layers, 2, tokens, heads, head_dim]` (MLA:
`[layers, tokens, head_dim]`) over the model's every layer; a rank of pipeline stage `pp_rank`
holds global layers `[layer_start, layer_start + num_layers)`, its cache tensor `i` being
global layer `layer_start + i`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvxfer.spec import KVCacheSpec


def random_global_kv(
    spec: KVCacheSpec, num_tokens: int, seed: int = 0, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """Random KV for a whole request (all heads, the model's every layer: `total_layers`
    with pipeline parallelism), with distinct bit patterns everywhere. Any rank's spec of
    either engine gives the same tensor for the same seed.

    fp8 caches (one byte per element) get uniformly random bytes: every bit pattern, NaNs
    included, since only data movement is tested, never fp8 arithmetic.
    """
    gen = torch.Generator().manual_seed(seed)
    layers = model_layers(spec)
    if spec.mla:
        shape: tuple[int, ...] = (layers, num_tokens, spec.head_dim)
    else:
        shape = (layers, 2, num_tokens, spec.num_kv_heads, spec.head_dim)
    if spec.itemsize == 1:  # no randn for fp8 on CPU: random bytes, viewed as the dtype
        noise = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
        return noise.view(spec.torch_dtype).to(device=device)
    return torch.randn(shape, generator=gen).to(dtype=spec.torch_dtype, device=device)


_FP8_LIMITS = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
# The positive quiet NaN of each format, as CUDA's conversions write it.
_NAN_BITS = {
    torch.float8_e4m3fn: 0x7F,
    torch.float8_e5m2: 0x7F,
    torch.bfloat16: 0x7FC0,
    torch.float16: 0x7E00,
    torch.float32: 0x7FC00000,
}


def converted_global_kv(
    global_kv: torch.Tensor,
    dtype: torch.dtype,
    scales: np.ndarray | None = None,
    fp8_rounding: str = "nearest_even",
) -> torch.Tensor:
    """The global KV as an engine that stores `dtype` holds it, from KV of another dtype (the
    expectation of a converting transfer, written from vLLM's definitions, not from kvxfer's
    kernels):

    - into fp8: vLLM's cache write, `x / scale` in float32, saturated to the format's largest
      finite value, rounded to nearest even; with `fp8_rounding` "toward_zero", vLLM CPU
      attention's (`cpu_truncated_fp8`); with "torch_cast", SGLang's (`sglang_fp8`);
    - out of fp8: `x * scale` in float32, rounded to nearest even;
    - between 16- and 32-bit floats: rounded to nearest even.

    Every NaN becomes the format's positive quiet NaN. `scales`: float32 `[model layers,
    planes]` of the fp8 side (K, V; MLA: one).
    """
    if dtype in _FP8_LIMITS and fp8_rounding == "toward_zero":
        return cpu_truncated_fp8(global_kv, dtype, scales)
    if dtype in _FP8_LIMITS and fp8_rounding == "torch_cast":
        return sglang_fp8(global_kv, dtype, scales)
    values = global_kv.to(torch.float32)
    if scales is not None:
        per_layer = torch.from_numpy(np.ascontiguousarray(scales, dtype=np.float32))
        # [layers, planes] against [layers, 2, tokens, heads, dim] (MLA: [layers, tokens, dim])
        shaped = (
            per_layer[:, :, None, None, None] if values.dim() == 5 else per_layer[:, 0, None, None]
        )
        values = values * shaped if global_kv.dtype in _FP8_LIMITS else values / shaped
    if dtype in _FP8_LIMITS:
        values = values.clamp(-_FP8_LIMITS[dtype], _FP8_LIMITS[dtype])
    out = values.to(dtype)
    nan = torch.isnan(values)
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[out.element_size()]
    out.view(bits)[nan] = _NAN_BITS[dtype]
    return out


def sglang_fp8(
    global_kv: torch.Tensor, dtype: torch.dtype, scales: np.ndarray | None = None
) -> torch.Tensor:
    """The global KV as SGLang's cache write stores it in fp8 `dtype` on CUDA
    (`MHATokenToKVPool.set_kv_buffer`, SGLang 0.5.23): `kv.div_(scale)` in the KV's own dtype,
    whose 0-dim float32 scale PyTorch's CUDA division casts to that dtype first, then
    `.to(dtype)`, torch's cast (nearest even; e4m3fn saturated, e5m2 not). A NaN becomes
    `0x7F`. `scales` as in `converted_global_kv`."""
    kv = global_kv.clone()
    if scales is not None:
        per_layer = torch.from_numpy(np.ascontiguousarray(scales, dtype=np.float32)).to(kv.dtype)
        kv.div_(per_layer[:, :, None, None, None] if kv.dim() == 5 else per_layer[:, 0, None, None])
    out = kv.to(dtype)
    out.view(torch.uint8)[torch.isnan(kv)] = _NAN_BITS[dtype]
    return out


def cpu_truncated_fp8(
    global_kv: torch.Tensor, dtype: torch.dtype, scales: np.ndarray | None = None
) -> torch.Tensor:
    """The global KV as vLLM CPU attention's cache write stores it in fp8 `dtype`: vLLM 0.32
    `csrc/cpu/cpu_attn_fp8.hpp`, `float_to_fp8e4m3_scalar` and `float_to_fp8e5m2_scalar`,
    line for line in numpy (`x * (1 / scale)` in float32, clamped to the largest finite value
    with NaN going to it too, zero as `0x00`, the mantissa truncated). `scales` as in
    `converted_global_kv`."""
    v = global_kv.to(torch.float32).numpy()
    if scales is not None:
        inverse = np.float32(1.0) / np.ascontiguousarray(scales, dtype=np.float32)
        shaped = inverse[:, :, None, None, None] if v.ndim == 5 else inverse[:, 0, None, None]
        with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN inputs are data here
            v = (v * shaped).astype(np.float32)
    limit = np.float32(_FP8_LIMITS[dtype])
    v = np.where(np.isnan(v), limit, np.minimum(np.maximum(v, -limit), limit))
    out = np.zeros(v.shape, dtype=np.uint8)
    for index, x in np.ndenumerate(v):
        out[index] = _e4m3_scalar(x) if dtype == torch.float8_e4m3fn else _e5m2_scalar(x)
    return torch.from_numpy(out).view(dtype)


def _bits(x: np.float32) -> int:
    return int(np.array(x, dtype=np.float32).view(np.uint32))


def _e4m3_scalar(v: np.float32) -> int:
    if v == 0:
        return 0
    bits = _bits(np.float32(v) * np.float32(2.0**-120))
    sign, payload = (bits >> 24) & 0x80, (bits >> 20) & 0x7F
    return sign if payload == 0 else sign | min(payload, 0x7E)


def _e5m2_scalar(v: np.float32) -> int:
    if v == 0:
        return 0
    bits = _bits(v)
    sign = (bits >> 24) & 0x80
    exponent = ((bits >> 23) & 0xFF) - 127
    if exponent < -14:
        shift = -14 - exponent
        if shift + 21 >= 32:
            return sign
        return sign | min((0x800000 | (bits & 0x7FFFFF)) >> (shift + 21), 3)
    return sign | ((exponent + 15) << 2) | ((bits >> 21) & 0x3)


def _cpu_cell_offsets(spec: KVCacheSpec, plane: int, slots: torch.Tensor) -> torch.Tensor:
    """Where vLLM CPU attention's `cpu_attn_reshape_and_cache` writes each (slot, dim) of
    `plane` inside a (block, head) run of `2 * block_size * head_dim` elements: flat offsets
    `[tokens, head_dim]`, computed element by element.

    - `k_transposed`: K as `[head_dim, block_size]`, then V as `[block_size, head_dim]`.
    - `amx_tiles` (ISA `amx`, vLLM 0.32 `csrc/cpu/cpu_attn_amx.hpp`): K of slot `s` and dim
      `d` at `(s // 16) * 16 * head_dim + (d // 2) * 32 + (s % 16) * 2 + d % 2`, then V at
      `block_size * head_dim + (d // 16) * 16 * block_size + (s // 2) * 32 + (d % 16) * 2 +
      s % 2`.
    """
    bs, dim = spec.block_size, spec.head_dim
    s = slots[:, None]
    d = torch.arange(dim)[None, :]
    if spec.kv_placement == "k_transposed":
        return d * bs + s if plane == 0 else bs * dim + s * dim + d
    if plane == 0:
        return (s // 16) * 16 * dim + (d // 2) * 32 + (s % 16) * 2 + d % 2
    return bs * dim + (d // 16) * 16 * bs + (s // 2) * 32 + (d % 16) * 2 + s % 2


def model_scales(specs: Sequence[KVCacheSpec]) -> np.ndarray:
    """float32 `[model layers, planes]`: an engine's fp8 scales per global layer, from its
    ranks' specs (`k_scales`, `v_scales`; 1.0 where none were given)."""
    first = specs[0]
    out = np.ones((model_layers(first), 1 if first.mla else 2), dtype=np.float32)
    for spec in specs:
        out[spec.layer_start : spec.layer_start + spec.num_layers] = spec.layer_scales(
            0, spec.num_layers
        )
    return out


def model_layers(spec: KVCacheSpec) -> int:
    """The model's layers: `total_layers` with pipeline parallelism, else `num_layers`."""
    return spec.total_layers if spec.total_layers else spec.num_layers


def rank_layers(spec: KVCacheSpec) -> list[int]:
    """Global layers of `spec`'s rank, in the order of its cache tensors."""
    return list(range(spec.layer_start, spec.layer_start + spec.num_layers))


def rank_heads(spec: KVCacheSpec) -> list[int]:
    """Global heads of `spec.tp_rank`, from docs/design.md's ownership rule."""
    heads, tp = spec.num_kv_heads, spec.tp_size
    if heads >= tp:
        return list(range(spec.tp_rank * heads // tp, (spec.tp_rank + 1) * heads // tp))
    return [spec.tp_rank // (tp // heads)]


def write_rank_cells(
    spec: KVCacheSpec,
    caches: Sequence[torch.Tensor],
    block_ids: Sequence[int] | np.ndarray,
    global_kv: torch.Tensor,
    token_start: int,
    token_end: int,
) -> None:
    """Write tokens `[token_start, token_end)` of `global_kv` into one rank's cache, for the
    layers and heads that rank holds (`caches[i]` is global layer `spec.layer_start + i`)."""
    tokens = torch.arange(token_start, token_end)
    ids = torch.as_tensor(np.asarray(block_ids, dtype=np.int64))
    blocks, slots = ids[tokens // spec.block_size], tokens % spec.block_size
    heads = rank_heads(spec)
    if global_kv.shape[0] < spec.layer_start + len(caches):
        raise ValueError(
            f"global_kv: {global_kv.shape[0]} layers, but the rank holds layers "
            f"[{spec.layer_start}, {spec.layer_start + len(caches)}); pass the model's whole KV "
            "(random_global_kv of any rank's spec)"
        )
    for index, cache in enumerate(caches):
        layer = spec.layer_start + index  # global
        if spec.mla:
            cache[blocks, slots] = global_kv[layer, token_start:token_end].to(cache.device)
            continue
        for local, head in enumerate(heads):
            for plane in (0, 1):
                value = global_kv[layer, plane, token_start:token_end, head].to(cache.device)
                inner = slice(plane * spec.head_dim, (plane + 1) * spec.head_dim)
                if spec.kv_placement in ("k_transposed", "amx_tiles"):
                    offsets = _cpu_cell_offsets(spec, plane, slots)
                    _per_head_runs(spec, cache)[blocks[:, None], local, offsets] = value
                elif spec.kv_placement == "kv_inner" and spec.layout == "NHD":
                    cache[blocks, slots, local, inner] = value
                elif spec.kv_placement == "kv_inner":
                    cache[blocks, local, slots, inner] = value
                elif spec.kv_placement == "kv_first" and spec.layout == "NHD":
                    cache[plane, blocks, slots, local] = value
                elif spec.kv_placement == "kv_first":
                    cache[plane, blocks, local, slots] = value
                elif spec.layout == "NHD":
                    cache[blocks, plane, slots, local] = value
                else:
                    cache[blocks, plane, local, slots] = value


def _per_head_runs(spec: KVCacheSpec, cache: torch.Tensor) -> torch.Tensor:
    """A CPU attention layer as `[blocks, heads, 2 * block_size * head_dim]`: each (block,
    head) one dense run.

    Raises:
        ValueError: runs that are not dense (not the engine's own tensor).
    """
    if cache.stride()[2:] != (2 * spec.head_dim, 1):
        raise ValueError(
            f"cache: a {spec.kv_placement} layer's (block, head) runs must be dense, got "
            f"strides {cache.stride()}"
        )
    return cache.flatten(2)
