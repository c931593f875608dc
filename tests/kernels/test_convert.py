"""vLLM's quantization arithmetic (`convert_torch`), byte for byte on values worked out by hand:
saturation, ties to even, subnormals, signed zeros, NaN and infinities; and the refusals."""

from __future__ import annotations

import pytest
import torch

from kvxfer.kernels.convert import check_conversion, convert_torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("dst", "value", "scale", "byte"),
    [
        (E4M3, 448.0, 1.0, 0x7E),  # the largest finite e4m3
        (E4M3, 464.0, 1.0, 0x7E),  # beyond it: saturated (not NaN, which e4m3fn overflow is)
        (E4M3, 1e9, 1.0, 0x7E),
        (E4M3, INF, 1.0, 0x7E),
        (E4M3, -INF, 1.0, 0xFE),
        (E4M3, NAN, 1.0, 0x7F),
        (E4M3, -NAN, 1.0, 0x7F),  # one canonical NaN
        (E4M3, 1.0, 1.0, 0x38),
        (E4M3, 1.0625, 1.0, 0x38),  # the tie between 1 and 1.125: to even
        (E4M3, 1.1875, 1.0, 0x3A),  # the tie between 1.125 and 1.25: to even
        (E4M3, 2.0**-6, 1.0, 0x08),  # the smallest normal
        (E4M3, 2.0**-10, 1.0, 0x00),  # half the smallest subnormal: to even (zero)
        (E4M3, 3 * 2.0**-10, 1.0, 0x02),  # 1.5 subnormal steps: to even (2)
        (E4M3, -(2.0**-10), 1.0, 0x80),  # a negative zero
        (E4M3, 1.0, 0.5, 0x40),  # divided by the scale: 2
        (E4M3, 300.0, 0.5, 0x7E),  # 600 saturates
        (E5M2, 57344.0, 1.0, 0x7B),
        (E5M2, 61440.0, 1.0, 0x7B),
        (E5M2, INF, 1.0, 0x7B),
        (E5M2, NAN, 1.0, 0x7F),
        (E5M2, 1.0, 1.0, 0x3C),
        (E5M2, 2.0**-16, 1.0, 0x01),
        (E5M2, 2.0**-17, 1.0, 0x00),
        (E5M2, 3 * 2.0**-17, 1.0, 0x02),
    ],
)
def test_quantization_gives_vllms_bytes(dst, value, scale, byte):
    got = convert_torch(torch.tensor([value], dtype=torch.float32), dst, torch.tensor(scale))
    assert int(got.view(torch.uint8)[0]) == byte


def test_quantization_rounds_once_from_bfloat16():
    # bf16 1.0625 is exact; the only rounding is the one into e4m3 (to even: 1.0)
    value = torch.tensor([1.0625], dtype=torch.bfloat16)
    assert int(convert_torch(value, E4M3, torch.tensor(1.0)).view(torch.uint8)[0]) == 0x38


@pytest.mark.parametrize(
    ("src_byte", "scale", "dst", "bits"),
    [
        (0x7E, 2.0, torch.bfloat16, 0x4460),  # 448 * 2 = 896
        (0x01, 1.0, torch.float32, 0x3B000000),  # 2^-9, the smallest e4m3 subnormal
        (0x7F, 1.0, torch.bfloat16, 0x7FC0),  # NaN
        (0xFF, 1.0, torch.float16, 0x7E00),  # NaN, sign dropped
        (0x80, 3.0, torch.bfloat16, -0x8000),  # -0 stays -0 (0x8000 as int16)
    ],
)
def test_dequantization_multiplies_by_the_scale(src_byte, scale, dst, bits):
    value = torch.tensor([src_byte], dtype=torch.uint8).view(E4M3)
    got = convert_torch(value, dst, torch.tensor(scale))
    assert int(got.view({2: torch.int16, 4: torch.int32}[got.element_size()])[0]) == bits


@pytest.mark.parametrize(
    ("src", "dst", "scales", "message"),
    [
        (E4M3, E5M2, torch.ones(2, 2), "not between two fp8 formats"),
        (torch.bfloat16, E4M3, None, "needs the destination's scales"),
        (E4M3, torch.bfloat16, None, "needs the source's scales"),
        (torch.bfloat16, E4M3, torch.ones(2, 1), r"float32 \[2, 2\]"),
        (torch.bfloat16, E4M3, torch.ones(2, 2, dtype=torch.float64), r"float32 \[2, 2\]"),
        (torch.bfloat16, torch.float32, torch.ones(2, 2), "uses no scales"),
        (torch.int32, torch.bfloat16, None, "cannot be converted"),
    ],
)
def test_an_unsupported_conversion_is_refused_with_the_fix(src, dst, scales, message):
    with pytest.raises(ValueError, match=message):
        check_conversion(src, dst, scales, 2, 2)


@pytest.mark.parametrize(
    ("dst", "value", "scale", "byte"),
    [
        # vLLM CPU attention's write (vLLM 0.32 csrc/cpu/cpu_attn_fp8.hpp), by hand: the
        # mantissa truncated, not rounded; zeros of either sign as 0x00; NaN as the largest
        # value; x * (1 / scale).
        (E4M3, 1.1875, 1.0, 0x39),  # 1.125 (to nearest even: 1.25, 0x3A)
        (E4M3, 3.1875, 1.0, 0x44),  # 3.0
        (E4M3, 248.0, 1.0, 0x77),  # 240 (to nearest even: 256)
        (E4M3, 0.0029296875, 1.0, 0x01),  # 1.5 subnormal steps: 1
        (E4M3, 480.0, 1.0, 0x7E),
        (E4M3, INF, 1.0, 0x7E),
        (E4M3, -INF, 1.0, 0xFE),
        (E4M3, NAN, 1.0, 0x7E),
        (E4M3, -0.0, 1.0, 0x00),
        (E4M3, -(2.0**-10), 1.0, 0x80),  # under a subnormal step: a signed zero
        (E4M3, 3.0, 0.5, 0x4C),  # 6.0: times 1 / 0.5
        (E5M2, 1.1875, 1.0, 0x3C),  # 1.0
        (E5M2, 248.0, 1.0, 0x5B),  # 224
        (E5M2, 0.0029296875, 1.0, 0x1A),
        (E5M2, 61440.0, 1.0, 0x7B),  # 57344, where torch's cast overflows to inf
        (E5M2, NAN, 1.0, 0x7B),
        (E5M2, -INF, 1.0, 0xFB),
        (E5M2, 3 * 2.0**-17, 1.0, 0x01),  # 1.5 subnormal steps: 1
    ],
)
def test_cpu_attention_quantization_truncates(dst, value, scale, byte):
    values = torch.tensor([value], dtype=torch.float32)
    got = convert_torch(values, dst, torch.tensor(scale), rounding="toward_zero")
    assert int(got.view(torch.uint8)[0]) == byte


@pytest.mark.parametrize("dst", [E4M3, E5M2])
@pytest.mark.parametrize("scale", [1.0, 0.037, 3.0])
def test_the_truncating_quantization_equals_the_reference_on_every_bfloat16(dst, scale):
    """Every bf16 bit pattern (NaNs, infinities, subnormals included) quantized by the torch
    backend equals `kvxfer.reference.cpu_truncated_fp8`, the C++ rewritten in numpy."""
    import numpy as np

    from kvxfer.reference import cpu_truncated_fp8

    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    got = convert_torch(every, dst, torch.tensor(scale), rounding="toward_zero")
    want = cpu_truncated_fp8(every.reshape(1, 1, -1), dst, np.array([[scale]], np.float32))
    assert torch.equal(got.view(torch.uint8), want.reshape(-1).view(torch.uint8))


# ---- SGLang's fp8 write: `x.div_(scale)` in x's dtype, then torch's cast ------------------


@pytest.mark.parametrize(
    ("dst", "value", "byte"),
    [
        (E4M3, 464.0, 0x7E),  # the tie between 448 and 480 (the NaN pattern): to even
        (E4M3, 472.0, 0x7E),  # rounds onto the NaN pattern: torch saturates
        (E4M3, -1e9, 0xFE),
        (E4M3, INF, 0x7E),
        (E4M3, NAN, 0x7F),
        (E4M3, 1.0625, 0x38),
        (E5M2, 57344.0, 0x7B),
        (E5M2, 61440.0, 0x7C),  # the tie between 57344 and 65536: to even, infinity
        (E5M2, -1e6, 0xFC),
        (E5M2, NAN, 0x7F),
    ],
)
def test_sglangs_quantization_saturates_e4m3_only(dst, value, byte):
    values = torch.tensor([value], dtype=torch.float32)
    got = convert_torch(values, dst, torch.tensor(1.0), rounding="torch_cast")
    assert int(got.view(torch.uint8)[0]) == byte


def _every(dtype: torch.dtype) -> torch.Tensor:
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    if dtype == torch.float32:  # every bf16 value, and as many between them
        wide = every.view(torch.bfloat16).float()
        return torch.cat([wide, wide * 1.00390625])
    return every.view(dtype)


@pytest.mark.parametrize("src", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("dst", [E4M3, E5M2])
@pytest.mark.parametrize("scale", [1.0, 0.375, 3.0, 0.037])
def test_sglangs_quantization_is_its_division_then_torchs_cast(src, dst, scale):
    """Every value: what `values.div_(scale)` then `.to(dst)` stores, with the 0-dim scale in
    the values' dtype (as CUDA's division casts it; on CPU, torch reads the float32 scale and
    gives these bytes where the scale is a value of that dtype). A NaN is `0x7F` either sign."""
    values = _every(src)
    want = values.clone().div_(torch.tensor(scale).to(src)).to(dst).view(torch.uint8)
    got = convert_torch(values, dst, torch.tensor(scale), rounding="torch_cast")
    nan = torch.isnan(values)
    assert torch.equal(got.view(torch.uint8)[~nan], want[~nan])
    assert bool((got.view(torch.uint8)[nan] == 0x7F).all())
