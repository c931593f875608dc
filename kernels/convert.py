"""KV dtype conversion inside the cell copy: what it converts, and its arithmetic, twice.

A copy converts when its two sides hold different dtypes: bf16 / fp16 / fp32 into an fp8 cache
(quantize with the destination's scales), an fp8 cache into bf16 / fp16 / fp32 (dequantize with
the source's scales), and between the 16- and 32-bit floats (no scale). Scales are vLLM's: one
per layer and plane (`k_scale`, `v_scale`; an MLA latent plane has one), a float32 tensor
`[layers, planes]` on the copy's device, row `i` for the copy's layer `i`.

The arithmetic is vLLM's cache write (`reshape_and_cache_flash`: `x / scale` rounded to nearest
in float32, then saturated to the fp8 format's finite range and rounded to nearest even,
`__nv_cvt_float_to_fp8(..., __NV_SATFINITE, ...)`), so a decode fed by a bf16 prefill holds the
bytes its own cache write would have written. Dequantization is `fp8 -> float32`, exact, times
the scale in float32, then rounded to nearest even into the destination dtype.

NaN: every NaN becomes the destination format's positive quiet NaN (fp8 `0x7F`, bf16 `0x7FC0`,
fp16 `0x7E00`, fp32 `0x7FC00000`), as CUDA's conversions give it; a NaN's sign and payload are
not data.

vLLM CPU attention quantizes otherwise (`cpu_attn_reshape_and_cache`, vLLM 0.32
`csrc/cpu/cpu_attn_fp8.hpp`, `float_to_fp8e4m3_scalar` and `float_to_fp8e5m2_scalar`; probed
on every element by `kvxfer/testing/backend_probe.py`): `x * (1 / scale)` in float32, clamped
to the largest finite value (NaN too becomes it), zero of either sign as `0x00`, then the mantissa
truncated toward zero. A destination whose `fp8_rounding` is "toward_zero" gets that
(`quantize_toward_zero`, torch only: the planner converts on the CPU engine's own side).

SGLang quantizes otherwise too (`MHATokenToKVPool.set_kv_buffer`, SGLang 0.5.23): `x.div_(scale)`
in the values' own dtype, then torch's `.to(fp8)`. Its `k_scale` is a 0-dim float32 tensor on
the model's device, and PyTorch's CUDA division first casts it to the values' dtype (bf16 for a
bf16 model: `DivFunctor<scalar_t>`), then divides in float32 and rounds the quotient to that
dtype (torch on CPU divides by the float32 scale: the same bytes wherever the scale is a value
of that dtype, as the tests' are). Then torch's cast (`fp8e4m3fn_from_fp32_value` and
`fp8e5m2_from_fp32_value`, torch 2.13), nearest even: into e4m3fn saturated to 448, infinities
too; into e5m2 not saturated (from 61440 up, rounding reaches infinity). A destination whose
`fp8_rounding` is "torch_cast" gets that (`quantize_torch_cast`; in the Triton kernel
`quantize_torch_cast_triton`). A NaN quotient becomes `0x7F`: torch's own paths give it either
sign (its vectorized bf16 rounding makes NaNs negative, its scalar one positive).

The two implementations: `convert_torch` with torch's float ops (the CPU backend), and the
Triton helpers `to_float32` / `from_float32`, on integer bits only (the Triton interpreter has
no bf16 or fp8 type, and one code path then runs in the interpreter and on a GPU). The tests
hold them bit for bit against each other on every bf16, fp16 and fp8 value.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# The largest finite value of each fp8 format: quantization saturates to it.
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
# The positive quiet NaN a conversion writes (bits of the destination dtype; each fits the
# signed integer of its width that torch views the dtype as).
CANONICAL_NAN = {
    torch.float8_e4m3fn: 0x7F,
    torch.float8_e5m2: 0x7F,
    torch.bfloat16: 0x7FC0,
    torch.float16: 0x7E00,
    torch.float32: 0x7FC00000,
}
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}

# The kernels' names for the dtypes (constexpr codes); 0: no conversion (words move as bits).
KIND_NONE = 0
KINDS = {
    torch.float32: 1,
    torch.bfloat16: 2,
    torch.float16: 3,
    torch.float8_e4m3fn: 4,
    torch.float8_e5m2: 5,
}
SCALE_NONE, SCALE_DIVIDE, SCALE_MULTIPLY = 0, 1, 2


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> "bfloat16" (the spec's and the codegen rows' names)."""
    return str(dtype).removeprefix("torch.")


def scale_mode(src: torch.dtype, dst: torch.dtype) -> int:
    """How a copy from `src` to `dst` uses scales: divide (quantize into fp8), multiply
    (dequantize from fp8), or none (equal dtypes, or between the 16- and 32-bit floats)."""
    if src == dst:
        return SCALE_NONE
    if dst in FP8_DTYPES:
        return SCALE_DIVIDE
    if src in FP8_DTYPES:
        return SCALE_MULTIPLY
    return SCALE_NONE


def check_conversion(
    src: torch.dtype, dst: torch.dtype, scales: torch.Tensor | None, layers: int, planes: int
) -> None:
    """Check that a copy from `src` to `dst` can convert, with `scales` where it needs them.

    Raises:
        ValueError: an unsupported pair (fp8 to another fp8 format, or a non-float dtype), or
            scales missing, of the wrong shape or dtype, or given where nothing uses them.
    """
    if src == dst and scales is None:
        return
    for name, dtype in (("src", src), ("dst", dst)):
        if dtype not in KINDS:
            raise ValueError(
                f"{name}: dtype {dtype} cannot be converted; kvxfer converts between "
                f"{', '.join(dtype_name(d) for d in KINDS)}"
            )
    if src in FP8_DTYPES and dst in FP8_DTYPES and src != dst:
        raise ValueError(
            f"dst: {dtype_name(src)} -> {dtype_name(dst)}: kvxfer converts between fp8 and the "
            "16- or 32-bit floats, not between two fp8 formats; use one fp8 format on both sides"
        )
    if scale_mode(src, dst) == SCALE_NONE:
        if scales is not None:
            raise ValueError(
                f"scales: a {dtype_name(src)} -> {dtype_name(dst)} copy uses no scales; "
                "pass scales only where one side is fp8 and the other is not"
            )
        return
    fp8 = "destination's" if dst in FP8_DTYPES else "source's"
    if scales is None:
        raise ValueError(
            f"scales: a {dtype_name(src)} -> {dtype_name(dst)} copy needs the {fp8} scales "
            f"(k_scale, v_scale per layer) as a float32 tensor [{layers}, {planes}]"
        )
    if scales.dtype != torch.float32 or tuple(scales.shape) != (layers, planes):
        raise ValueError(
            f"scales: expected float32 [{layers}, {planes}] (per layer: k_scale, v_scale; MLA: "
            f"one), got {scales.dtype} {tuple(scales.shape)}"
        )
    if not scales.is_contiguous():
        raise ValueError("scales: must be contiguous; pass scales.contiguous()")


def convert_torch(
    values: torch.Tensor,
    dst: torch.dtype,
    scale: torch.Tensor | None,
    rounding: str = "nearest_even",
) -> torch.Tensor:
    """`values` converted to `dst` with vLLM's arithmetic (the module docstring).

    Args:
        values: any shape, in one of `KINDS`.
        dst: the dtype to convert to.
        scale: float32, broadcastable to `values` (the fp8 side's scale per element); None
            where `scale_mode` says none.
        rounding: how a quantization into fp8 rounds: "nearest_even" (vLLM's CUDA write),
            "toward_zero" (vLLM CPU attention's, `quantize_toward_zero`) or "torch_cast"
            (SGLang's, `quantize_torch_cast`).
    """
    src = values.dtype
    if src == dst:
        return values
    wide = values.to(torch.float32)  # exact from every dtype here
    mode = scale_mode(src, dst)
    if mode == SCALE_DIVIDE and rounding == "toward_zero":
        assert scale is not None
        return quantize_toward_zero(wide, dst, scale)
    if mode == SCALE_DIVIDE and rounding == "torch_cast":
        assert scale is not None
        return quantize_torch_cast(wide, src, dst, scale)
    if mode == SCALE_DIVIDE:
        assert scale is not None
        limit = FP8_MAX[dst]
        wide = (wide / scale).clamp(-limit, limit)  # clamp keeps NaN; saturates infinities
    elif mode == SCALE_MULTIPLY:
        assert scale is not None
        wide = wide * scale
    out = wide.to(dst)  # round to nearest even
    nan = torch.isnan(wide)
    if bool(nan.any()):
        bits = out.view(_BITS[out.element_size()])
        bits[nan] = CANONICAL_NAN[dst]
    return out


def quantize_toward_zero(
    values: torch.Tensor, dst: torch.dtype, scale: torch.Tensor
) -> torch.Tensor:
    """float32 `values` quantized into fp8 `dst` as vLLM CPU attention's cache write does (the
    module docstring): times the float32 reciprocal of `scale`, clamped (NaN to the largest
    value), zeros as `0x00`, mantissa truncated.

    e4m3 takes the bits of `v * 2^-120` (the exponent rebased from float32's bias 127 to 7, a
    float32 multiply: rounded where the result is subnormal, as the C++ does); e5m2 shifts
    the subnormals' mantissa (exponent below -14) by hand, as the C++ does.
    """
    limit = FP8_MAX[dst]
    v = values * torch.reciprocal(scale.to(torch.float32))
    v = torch.where(torch.isnan(v), limit, v.clamp(-limit, limit))
    if dst == torch.float8_e4m3fn:
        bits = (v * 2.0**-120).view(torch.int32).to(torch.int64)
        sign = (bits >> 24) & 0x80
        payload = ((bits >> 20) & 0x7F).clamp(max=0x7E)
    else:
        bits = v.view(torch.int32).to(torch.int64)
        sign = (bits >> 24) & 0x80
        exponent = ((bits >> 23) & 0xFF) - 127
        normal = ((exponent + 15) << 2) | ((bits >> 21) & 0x3)
        shift = (-14 - exponent).clamp(min=0) + 21
        subnormal = ((0x800000 | (bits & 0x7FFFFF)) >> shift.clamp(max=31)).clamp(max=3)
        subnormal = torch.where(shift >= 32, 0, subnormal)
        payload = torch.where(exponent < -14, subnormal, normal)
    code = torch.where(v == 0, 0, sign | payload)
    return code.to(torch.uint8).view(dst)


def quantize_torch_cast(
    values: torch.Tensor, src: torch.dtype, dst: torch.dtype, scale: torch.Tensor
) -> torch.Tensor:
    """float32 `values` (exact copies of `src` values) quantized into fp8 `dst` as SGLang's cache
    write does on CUDA (the module docstring): divided in float32 by `scale` rounded to `src`,
    the quotient rounded to `src`, then torch's own cast into fp8 (nearest even; e4m3fn
    saturated, e5m2 not); a NaN quotient as `0x7F`."""
    quotient = values / scale.to(src).to(torch.float32)
    out = quotient.to(src).to(dst)
    nan = torch.isnan(quotient)
    if bool(nan.any()):
        out.view(torch.uint8)[nan] = CANONICAL_NAN[dst]
    return out


# ---- Triton: the same arithmetic on integer bits --------------------------------------------


@triton.jit
def _bits_to_float(bits):
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def to_float32(raw, KIND: tl.constexpr):
    """`raw` (loaded through a pointer of the dtype's width: int32, int16 or uint8 words)
    as float32, exactly."""
    if KIND == 1:  # float32
        out = raw.to(tl.float32, bitcast=True)
    elif KIND == 2:  # bfloat16: its bits are a float32's top half
        out = _bits_to_float(raw.to(tl.uint16).to(tl.uint32) << 16)
    elif KIND == 3:  # float16
        out = raw.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    elif KIND == 5:  # float8_e5m2: its bits are a float16's top byte
        half = raw.to(tl.uint8).to(tl.uint16) << 8
        out = half.to(tl.float16, bitcast=True).to(tl.float32)
    else:  # float8_e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; S.1111.111 is NaN
        b = raw.to(tl.uint8).to(tl.uint32)
        sign = (b & 0x80) << 24
        exponent = (b >> 3) & 0xF
        mantissa = b & 0x7
        normal = _bits_to_float(sign | ((exponent + 120) << 23) | (mantissa << 20))
        tiny = mantissa.to(tl.float32) * 0.001953125  # 2^-9: subnormals, exact
        tiny = tl.where(sign != 0, -tiny, tiny)
        out = tl.where(exponent == 0, tiny, normal)
        out = tl.where((exponent == 15) & (mantissa == 7), float("nan"), out)
    return out


@triton.jit
def _round_fp8(magnitude, MANTISSA: tl.constexpr, BIAS: tl.constexpr, MIN_NORMAL: tl.constexpr):
    """A finite float32 magnitude below the format's saturation point, rounded to nearest
    even into fp8 bits without the sign (integer math on the float's bits)."""
    u = magnitude.to(tl.uint32, bitcast=True)
    drop: tl.constexpr = 23 - MANTISSA
    odd = (u >> drop) & 1
    rounded = u + ((1 << (drop - 1)) - 1) + odd
    normal = (rounded >> drop) - ((127 - BIAS) << MANTISSA)
    # Below the smallest normal: a multiple of the smallest subnormal, rounded to nearest even
    # by the float adder itself (2^23 + t keeps t's integer part, ties to even).
    step: tl.constexpr = 2.0 ** (1 - BIAS - MANTISSA)
    t = magnitude * (1.0 / step) + 8388608.0
    subnormal = t.to(tl.uint32, bitcast=True) - 0x4B000000
    return tl.where(magnitude < MIN_NORMAL, subnormal, normal)


@triton.jit
def from_float32(x, KIND: tl.constexpr):
    """float32 `x` as the bits of dtype KIND (int32, int16 or uint8 words), rounded to
    nearest even; fp8 saturates to its finite range; NaN becomes the format's canonical NaN."""
    u = x.to(tl.uint32, bitcast=True)
    nan = x != x
    if KIND == 1:
        out = tl.where(nan, 0x7FC00000, u).to(tl.int32, bitcast=True)
    elif KIND == 2:  # bfloat16: round the low half away, ties to even
        rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        out = tl.where(nan, 0x7FC0, rounded).to(tl.uint16).to(tl.int16, bitcast=True)
    elif KIND == 3:
        half = x.to(tl.float16).to(tl.uint16, bitcast=True)
        out = tl.where(nan, 0x7E00, half).to(tl.int16, bitcast=True)
    else:
        sign = (u >> 24) & 0x80
        magnitude = tl.abs(x)
        if KIND == 4:  # float8_e4m3fn: 448 is the largest finite value
            code = _round_fp8(tl.minimum(magnitude, 448.0), 3, 7, 0.015625)
        else:  # float8_e5m2: 57344
            code = _round_fp8(tl.minimum(magnitude, 57344.0), 2, 15, 0.00006103515625)
        out = tl.where(nan, 0x7F, code | sign).to(tl.uint8)
    return out


@triton.jit
def _in_dtype(x, KIND: tl.constexpr):
    """float32 `x` rounded to the 16-bit float KIND (2, 3) and back; unchanged otherwise."""
    if KIND == 2 or KIND == 3:
        x = to_float32(from_float32(x, KIND), KIND)
    return x


@triton.jit
def quantize_torch_cast_triton(x, scale, SRC_KIND: tl.constexpr, KIND: tl.constexpr):
    """float32 `x` (an exact SRC_KIND value) quantized into fp8 KIND (uint8 words) as SGLang's
    cache write does on CUDA (`quantize_torch_cast`): divided by `scale` rounded to SRC_KIND,
    the quotient rounded to SRC_KIND, then to nearest even as torch's cast (e4m3fn saturated,
    e5m2 not); a NaN quotient as `0x7F`."""
    q = tl.math.div_rn(x, _in_dtype(scale, SRC_KIND))
    nan = q != q
    q = _in_dtype(q, SRC_KIND)
    sign = (q.to(tl.uint32, bitcast=True) >> 24) & 0x80
    magnitude = tl.abs(q)
    if KIND == 4:  # float8_e4m3fn: torch saturates, infinities too
        code = _round_fp8(tl.minimum(magnitude, 448.0), 3, 7, 0.015625)
    else:  # float8_e5m2: from 65536 up (after rounding: above 61440) is infinity
        code = _round_fp8(tl.minimum(magnitude, 65535.0), 2, 15, 0.00006103515625)
        code = tl.where(magnitude >= 65536.0, 0x7C, code)
    return tl.where(nan, 0x7F, code | sign).to(tl.uint8)
