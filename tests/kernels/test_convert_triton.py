"""The Triton conversion helpers (`kvxfer.kernels.convert`, integer bits only) against
`convert_torch` (torch's float ops), bit for bit, on every value of every 8- and 16-bit source
format and on float32 values around each format's edges. Under TRITON_INTERPRET=1 on CPU."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest
import torch
import triton
import triton.language as tl

from kvxfer import reshard
from kvxfer.kernels import (
    KVBuffer,
    canonical_kv_view,
    copy_cells,
    copy_cells_torch,
    wire_kv_buffer,
)
from kvxfer.kernels.convert import (
    FP8_DTYPES,
    KINDS,
    SCALE_DIVIDE,
    SCALE_MULTIPLY,
    convert_torch,
    from_float32,
    quantize_torch_cast_triton,
    scale_mode,
    to_float32,
)
from kvxfer.layout import layer_shape
from kvxfer.testing import make_scenario, side_specs

# Runs the Triton kernels: on CUDA, or on CPU under TRITON_INTERPRET=1 (tests/conftest.py).
pytestmark = pytest.mark.interpreter

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


@triton.jit
def _convert_kernel(src_ptr, dst_ptr, n, scale, BLOCK: tl.constexpr, SRC: tl.constexpr,
                    DST: tl.constexpr, MODE: tl.constexpr, TORCH_CAST: tl.constexpr):  # fmt: skip
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = to_float32(tl.load(src_ptr + offsets, mask=mask), SRC)
    if TORCH_CAST:
        per_value = tl.zeros([BLOCK], dtype=tl.float32) + scale  # as the kernel loads it
        out = quantize_torch_cast_triton(x, per_value, SRC, DST)
    else:
        if MODE == 1:
            x = tl.math.div_rn(x, scale)
        elif MODE == 2:
            x = x * scale
        out = from_float32(x, DST)
    tl.store(dst_ptr + offsets, out, mask=mask)


def _triton_convert(
    values: torch.Tensor, dst: torch.dtype, scale: float, torch_cast: bool = False
) -> torch.Tensor:
    out = torch.empty(values.shape, dtype=dst)
    n = values.numel()
    block = 4096
    _convert_kernel[(triton.cdiv(n, block),)](
        values.view(_BITS[values.element_size()]), out.view(_BITS[out.element_size()]), n,
        scale, BLOCK=block, SRC=KINDS[values.dtype], DST=KINDS[dst],
        MODE=scale_mode(values.dtype, dst), TORCH_CAST=torch_cast,
    )  # fmt: skip
    return out


def _every_value(dtype: torch.dtype) -> torch.Tensor:
    """Every bit pattern of an 8- or 16-bit dtype."""
    if dtype.itemsize == 1:
        return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)


def _edges() -> torch.Tensor:
    """float32 values at every edge a conversion has: both fp8 formats' saturation points,
    smallest normals and subnormals and the ties between them, float32 subnormals, infinities
    and NaNs of both signs, and random values over the whole range."""
    specials = [0.0, 448.0, 464.0, 447.9, 480.0, 57344.0, 61440.0, 61439.0, 2.0**-6, 2.0**-9,
                2.0**-10, 3 * 2.0**-10, 2.0**-14, 2.0**-16, 2.0**-17, 3 * 2.0**-17, 1e-40,
                1e-45, 65504.0, 65520.0, 3.4e38, float("inf"), float("nan")]  # fmt: skip
    special = torch.tensor(specials, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    scaled = torch.randn(20000, generator=gen) * torch.exp2(
        torch.randint(-30, 30, (20000,), generator=gen).float()
    )
    values = torch.cat([special, -special, scaled])
    ties = torch.arange(0, 1 << 16, dtype=torch.int32) << 15  # halfway for bf16 and fp8 roundings
    return torch.cat([values, ties.view(torch.float32)])


def _assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    bits = _BITS[got.element_size()]
    differ = got.view(bits) != want.view(bits)
    assert not bool(differ.any()), (
        f"{int(differ.sum())} of {got.numel()} differ, first at {int(differ.nonzero()[0])}"
    )


_PAIRS = [
    (torch.bfloat16, torch.float8_e4m3fn),
    (torch.bfloat16, torch.float8_e5m2),
    (torch.float16, torch.float8_e4m3fn),
    (torch.float16, torch.float8_e5m2),
    (torch.float8_e4m3fn, torch.bfloat16),
    (torch.float8_e4m3fn, torch.float16),
    (torch.float8_e4m3fn, torch.float32),
    (torch.float8_e5m2, torch.bfloat16),
    (torch.float8_e5m2, torch.float32),
    (torch.bfloat16, torch.float16),
    (torch.float16, torch.bfloat16),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
]


def _cases():
    for src, dst in _PAIRS:
        scaled = scale_mode(src, dst) in (SCALE_DIVIDE, SCALE_MULTIPLY)
        for scale in (1.0, 0.0371, 3.5) if scaled else (None,):
            name = f"{src}->{dst}@{scale}".replace("torch.", "")
            yield pytest.param(src, dst, scale, id=name)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on NaN and infinities
@pytest.mark.parametrize(("src", "dst", "scale"), list(_cases()))
def test_every_source_value_converts_as_torch_does(src, dst, scale):
    values = _every_value(src)
    want = convert_torch(values, dst, None if scale is None else torch.tensor(scale))
    _assert_same_bits(_triton_convert(values, dst, 1.0 if scale is None else scale), want)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("dst", [*FP8_DTYPES, torch.bfloat16, torch.float16])
def test_float32_edges_convert_as_torch_does(dst):
    values = _edges()
    scale = torch.tensor(1.0) if dst in FP8_DTYPES else None
    _assert_same_bits(_triton_convert(values, dst, 1.0), convert_torch(values, dst, scale))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("src", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("dst", FP8_DTYPES)
@pytest.mark.parametrize("scale", [1.0, 0.0371, 3.5])
def test_sglangs_quantization_in_triton_is_the_torch_backends(src, dst, scale):
    """SGLang's fp8 write (`fp8_rounding` "torch_cast"): every bf16 and fp16 value, and
    float32 values at every edge, with scales that are and are not values of the source dtype."""
    values = _edges() if src == torch.float32 else _every_value(src)
    want = convert_torch(values, dst, torch.tensor(scale), rounding="torch_cast")
    _assert_same_bits(_triton_convert(values, dst, scale, torch_cast=True), want)


# ---- converting cell copies: Triton, the torch backend and the definition agree ------------


def _cache(dtype, layout, placement, mla, blocks, block_size, heads, head_dim, seed):
    """Two layers of a paged cache, filled with values of every kind (random bytes for fp8;
    for wider floats normal values with NaN, infinities, subnormals and values beyond fp8's
    range mixed in)."""
    shape = layer_shape(blocks, block_size, heads, head_dim, layout, placement, mla)
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(2):
        if dtype.itemsize == 1:
            layers.append(
                torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).view(dtype)
            )
            continue
        wide = torch.randn(shape, generator=gen) * 40
        flat = wide.view(-1)
        picks = torch.randint(0, flat.numel(), (64,), generator=gen)
        flat[picks] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-40, 1e5, -7e4,
                                    2.0**-10, 1e-3]).repeat(8)  # fmt: skip
        layers.append(wide.to(dtype))
    return layers


def _poisoned(dtype, layout, placement, mla, blocks, block_size, heads, head_dim):
    shape = layer_shape(blocks, block_size, heads, head_dim, layout, placement, mla)
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    return [
        torch.full((nbytes,), 0xA5, dtype=torch.uint8).view(dtype).view(shape) for _ in range(2)
    ]


def _expected(src: KVBuffer, dst: KVBuffer, start, end, heads, scales) -> list[torch.Tensor]:
    """The definition: each moved cell of the destination is `convert_torch` of the source's
    same (plane, token, head), through the canonical views; every other byte is the
    destination's own."""
    tokens = torch.arange(start, end)
    sb, ss = src.token_cells(tokens)
    db, ds = dst.token_cells(tokens)
    out = []
    for layer, (s, d) in enumerate(zip(src.layers, dst.layers, strict=True)):
        got = d.clone()
        s_view = canonical_kv_view(s, src.layout, src.kv_placement, src.mla)
        d_bits = _BITS[d.element_size()]
        d_view = canonical_kv_view(got.view(d_bits), dst.layout, dst.kv_placement, dst.mla)
        s_bits = s_view.view(_BITS[s.element_size()])
        for plane in range(s_view.shape[0]):
            for h in range(heads):
                cells = s_bits[plane, sb, ss, src.head_offset + h].view(s.dtype)
                scale = None if scales is None else scales[layer, plane]
                d_view[plane, db, ds, dst.head_offset + h] = convert_torch(
                    cells, d.dtype, scale, dst.fp8_rounding
                ).view(d_bits)
        out.append(got)
    return out


_GEOMETRIES = [
    pytest.param(("NHD", "kv_first", False), ("HND", "blocks_first", False), id="NHD-HND"),
    pytest.param(("HND", "kv_inner", False), ("NHD", "kv_first", False), id="kv_inner-NHD"),
    pytest.param((None, None, True), (None, None, True), id="MLA"),
]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize(("src_geo", "dst_geo"), _GEOMETRIES)
@pytest.mark.parametrize(
    ("src_dtype", "dst_dtype", "rounding"),
    [
        (torch.bfloat16, torch.float8_e4m3fn, "nearest_even"),
        (torch.bfloat16, torch.float8_e5m2, "torch_cast"),
        (torch.float8_e5m2, torch.bfloat16, "nearest_even"),
        (torch.float32, torch.float16, "nearest_even"),
    ],
    ids=["bf16->e4m3", "bf16->e5m2-torch_cast", "e5m2->bf16", "fp32->fp16"],
)
@pytest.mark.parametrize("staged", [False, True], ids=["remap", "via-wire"])
def test_a_converting_copy_is_the_definition_in_both_backends(
    src_geo, dst_geo, src_dtype, dst_dtype, rounding, staged
):
    heads, head_dim, start, end = 2, 16, 3, 29
    (sl, sp, mla), (dl, dp, _) = src_geo, dst_geo
    sl, sp, dl, dp = sl or "NHD", sp or "kv_first", dl or "NHD", dp or "kv_first"
    src_ids = torch.tensor([5, 1, 7, 2], dtype=torch.int64)  # blocks of 8 tokens
    dst_ids = torch.tensor([3, 0], dtype=torch.int64)  # blocks of 16 tokens
    src_layers = _cache(src_dtype, sl, sp, mla, 8, 8, 3, head_dim, seed=1)
    src = KVBuffer(src_layers, sl, sp, mla, src_ids, 0, 0 if mla else 1)
    planes = 1 if mla else 2
    scaled = scale_mode(src_dtype, dst_dtype) in (SCALE_DIVIDE, SCALE_MULTIPLY)
    scales = torch.tensor([[0.5, 3.0], [0.037, 1.0]])[:, :planes].contiguous() if scaled else None
    results = {}
    for backend in ("triton", "torch"):
        dst = KVBuffer(_poisoned(dst_dtype, dl, dp, mla, 4, 16, heads, head_dim), dl, dp, mla,
                       dst_ids, 0, 0, rounding)  # fmt: skip
        copy = copy_cells if backend == "triton" else copy_cells_torch
        kwargs = {"scales": scales} if backend == "triton" else {}
        if staged:  # the pack+unpack path: into the wire layout, then out of it
            wire_dtype = dst_dtype if src_dtype.itemsize > dst_dtype.itemsize else src_dtype
            shape = (2, end - start, head_dim) if mla else (2, 2, end - start, heads, head_dim)
            wire = wire_kv_buffer(torch.zeros(shape, dtype=wire_dtype), start, mla)
            wire = dataclasses.replace(wire, fp8_rounding=rounding)  # where the pack converts
            first = scales if wire_dtype != src_dtype else None
            second = scales if wire_dtype != dst_dtype else None
            if backend == "triton":
                copy_cells(src, wire, start, end, heads if not mla else 1, scales=first)
                copy_cells(wire, dst, start, end, heads if not mla else 1, scales=second)
            else:
                copy_cells_torch(src, wire, start, end, heads if not mla else 1, first)
                copy_cells_torch(wire, dst, start, end, heads if not mla else 1, second)
        elif backend == "triton":
            copy(src, dst, start, end, 1 if mla else heads, **kwargs)
        else:
            copy_cells_torch(src, dst, start, end, 1 if mla else heads, scales)
        results[backend] = dst
    poison = _poisoned(dst_dtype, dl, dp, mla, 4, 16, heads, head_dim)
    want = _expected(src, KVBuffer(poison, dl, dp, mla, dst_ids, 0, 0, rounding), start, end,
                     1 if mla else heads, scales)  # fmt: skip
    for backend, dst in results.items():
        for layer, (got, expected) in enumerate(zip(dst.layers, want, strict=True)):
            bits = _BITS[got.element_size()]
            differ = got.view(bits) != expected.view(bits)
            assert not bool(differ.any()), f"{backend} layer {layer}: {int(differ.sum())} differ"


# ---- reshard with the Triton kernels: the same expectations as tests/test_dtype_conversion.py


def _scaled(specs, offset: float):
    return [
        msgspec.structs.replace(
            s,
            k_scales=tuple(0.25 + offset + i for i in range(s.num_layers)),
            v_scales=() if s.mla else tuple(2.0 + offset + i for i in range(s.num_layers)),
        )
        for s in specs
    ]


@pytest.mark.parametrize("strategy", ["pack", "unpack", "pack+unpack"])
@pytest.mark.parametrize(
    ("src", "dst"),
    [
        pytest.param(
            dict(tp=2, heads=4, block_size=4, head_dim=8),
            dict(tp=4, heads=4, block_size=8, head_dim=8, layout="HND", placement="blocks_first"),
            id="P2-D4-NHD-HND",
        ),
        pytest.param(
            dict(tp=2, mla=True, heads=1, block_size=4, head_dim=16),
            dict(tp=1, mla=True, heads=1, block_size=8, head_dim=16),
            id="MLA",
        ),
    ],
)
@pytest.mark.parametrize(
    ("src_dtype", "dst_dtype", "rounding"),
    [
        ("bfloat16", "float8_e4m3fn", "nearest_even"),
        ("bfloat16", "float8_e5m2", "torch_cast"),
        ("float8_e5m2", "bfloat16", "nearest_even"),
    ],
)
def test_a_triton_converting_reshard_holds_what_the_decode_would_have_written(
    src_dtype, dst_dtype, rounding, src, dst, strategy
):
    src_specs = side_specs(dtype=src_dtype, num_layers=2, num_blocks=8, **src)
    dst_specs = side_specs(dtype=dst_dtype, num_layers=2, num_blocks=8, **dst)
    dst_specs = [msgspec.structs.replace(s, fp8_rounding=rounding) for s in dst_specs]
    if src_dtype.startswith("float8"):
        src_specs = _scaled(src_specs, 0.0)
    else:
        dst_specs = _scaled(dst_specs, 0.5)
    sc = make_scenario(src_specs, dst_specs, 19, start_token=3, seed=2)
    result = reshard(sc.src, sc.dst, 19, 3, strategy=strategy, backend="triton")
    assert result.backend == "triton" and {p.strategy for p in result.pairs} == {strategy}
    sc.assert_exact()
