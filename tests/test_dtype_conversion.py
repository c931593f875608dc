"""KV dtype conversion through `reshard` (torch backend): a bf16 / fp16 / fp32 prefill into an
fp8 decode and back, every strategy that can convert, against `kvxfer.reference`'s
`converted_global_kv` (vLLM's arithmetic with the fp8 side's scales) on poisoned destinations.
The Triton kernels run the same cases under the interpreter (the `interpreter` tests)."""

from __future__ import annotations

import msgspec
import pytest

from kvxfer import plan_pairs, reshard
from kvxfer.testing import make_scenario, side_specs

STRATEGIES = ["pack", "unpack", "pack+unpack"]


def with_scales(specs, seed: int = 0):
    """`specs` with distinct k/v scales per layer (the fp8 side's, as vLLM keeps them)."""
    out = []
    for spec in specs:
        ks = tuple(0.25 + 0.5 * (spec.layer_start + i) + seed for i in range(spec.num_layers))
        vs = () if spec.mla else tuple(1.5 / k for k in ks)
        out.append(msgspec.structs.replace(spec, k_scales=ks, v_scales=vs))
    return out


def _pair(src_dtype, dst_dtype, src, dst, layers=2):
    src_specs = side_specs(dtype=src_dtype, num_layers=layers, num_blocks=12, **src)
    dst_specs = side_specs(dtype=dst_dtype, num_layers=layers, num_blocks=12, **dst)
    if src_dtype.startswith("float8"):
        src_specs = with_scales(src_specs)
    if dst_dtype.startswith("float8"):
        dst_specs = with_scales(dst_specs, seed=1)
    return src_specs, dst_specs


GEOMETRIES = [
    ("P2-D4-bs4-bs8-NHD-HND", dict(tp=2, heads=4, block_size=4, head_dim=8),
     dict(tp=4, heads=4, block_size=8, head_dim=8, layout="HND")),
    ("P3-D2-blocks_first-kv_inner",
     dict(tp=3, heads=6, block_size=8, head_dim=8, placement="blocks_first"),
     dict(tp=2, heads=6, block_size=4, head_dim=8, placement="kv_inner")),
    ("MLA", dict(tp=2, mla=True, heads=1, block_size=4, head_dim=16),
     dict(tp=1, mla=True, heads=1, block_size=8, head_dim=16)),
]  # fmt: skip
# vLLM CPU attention's layout as the destination: unpack only (`strategies_for`).
K_TRANSPOSED = (
    "PP2-k_transposed",
    dict(tp=2, heads=4, block_size=4, head_dim=8, pp=2),
    dict(tp=1, heads=4, block_size=8, head_dim=8, layout="HND", placement="k_transposed"),
)
CASES = [
    pytest.param(src, dst, strategy, id=f"{name}-{strategy}")
    for name, src, dst in GEOMETRIES
    for strategy in STRATEGIES
] + [pytest.param(K_TRANSPOSED[1], K_TRANSPOSED[2], "unpack", id=f"{K_TRANSPOSED[0]}-unpack")]


@pytest.mark.parametrize(("src", "dst", "strategy"), CASES)
@pytest.mark.parametrize(
    ("src_dtype", "dst_dtype"),
    [
        ("bfloat16", "float8_e4m3fn"),
        ("float16", "float8_e5m2"),
        ("float8_e4m3fn", "bfloat16"),
        ("float8_e5m2", "float32"),
        ("float32", "bfloat16"),
    ],
)
def test_a_converting_reshard_holds_what_the_decode_would_have_written(
    src_dtype, dst_dtype, src, dst, strategy
):
    src_specs, dst_specs = _pair(src_dtype, dst_dtype, src, dst, layers=4)
    sc = make_scenario(src_specs, dst_specs, 21, start_token=3, seed=5)
    result = reshard(sc.src, sc.dst, 21, 3, strategy=strategy, backend="torch")
    assert {p.strategy for p in result.pairs} == {strategy}
    sc.assert_exact()


@pytest.mark.parametrize(("src_dtype", "dst_dtype"), [("bfloat16", "float8_e4m3fn"),
                                                      ("float8_e4m3fn", "bfloat16")])  # fmt: skip
def test_the_wire_carries_the_narrower_dtype(src_dtype, dst_dtype):
    geometry = dict(tp=2, heads=4, block_size=4, head_dim=8)
    src_specs, dst_specs = _pair(src_dtype, dst_dtype, geometry, geometry)
    sc = make_scenario(src_specs, dst_specs, 16, seed=1)
    converting = reshard(sc.src, sc.dst, 16, strategy="pack+unpack", backend="torch")
    sc.assert_exact()
    wide_src, wide_dst = _pair("bfloat16", "bfloat16", geometry, geometry)
    plain = make_scenario(wide_src, wide_dst, 16, seed=1)
    unconverted = reshard(plain.src, plain.dst, 16, strategy="pack+unpack", backend="torch")
    assert converting.nbytes * 2 == unconverted.nbytes  # one byte an element, not two


def test_the_cost_model_never_picks_direct_between_two_dtypes_and_prefers_fewer_wire_bytes():
    src_specs, dst_specs = _pair("bfloat16", "float8_e4m3fn", dict(tp=2, heads=4),
                                 dict(tp=2, heads=4))  # fmt: skip
    plans = plan_pairs(src_specs, dst_specs)
    for plan in plans:
        assert "direct" not in {e.strategy for e in plan.estimates}
        assert plan.strategy in ("pack", "pack+unpack")  # quantized before the wire
        by = {e.strategy: e for e in plan.estimates}
        assert by["pack"].nbytes * 2 == by["unpack"].nbytes


@pytest.mark.parametrize(
    ("src_dtype", "dst_dtype", "scales", "message"),
    [
        ("float8_e4m3fn", "float8_e5m2", False, "not between two fp8 formats"),
        ("float8_e4m3fn", "float8_e4m3fn", True, "k_scales/v_scales differ at layer 0"),
    ],
)
def test_pairs_that_cannot_convert_are_refused_with_the_fix(src_dtype, dst_dtype, scales, message):
    geometry = dict(tp=1, heads=2)
    src_specs = side_specs(dtype=src_dtype, **geometry)
    dst_specs = side_specs(dtype=dst_dtype, **geometry)
    if scales:
        dst_specs = with_scales(dst_specs)
    with pytest.raises(ValueError, match=message):
        plan_pairs(src_specs, dst_specs)


def test_direct_is_refused_between_two_dtypes():
    src_specs, dst_specs = _pair("bfloat16", "float8_e4m3fn", dict(tp=1, heads=2),
                                 dict(tp=1, heads=2))  # fmt: skip
    with pytest.raises(ValueError, match="'direct' cannot move KV here"):
        plan_pairs(src_specs, dst_specs, strategy="direct")


def _cpu_fp8(specs):
    """`specs` as vLLM CPU attention's fp8 caches: K transposed, its fp8 write truncating."""
    return [
        msgspec.structs.replace(s, kv_placement="k_transposed", fp8_rounding="toward_zero")
        for s in specs
    ]


@pytest.mark.parametrize(
    ("src_placement", "strategy"),
    [
        ("kv_first", "unpack"),
        ("kv_first", "pack+unpack"),
        ("kv_first", None),
        ("k_transposed", "pack+unpack"),  # a CPU prefill: it packs, the decode converts
        ("k_transposed", None),
    ],
)
def test_a_cpu_fp8_decode_holds_its_own_truncating_write(src_placement, strategy):
    """bf16 prefill -> an fp8 decode of vLLM CPU attention: the decode's cache holds what its
    own write (truncating, `cpu_truncated_fp8`) makes of the prefill's KV, converted on the
    decode's side: the wire carries bf16, never fp8 rounded to nearest."""
    src = dict(tp=2, heads=4, block_size=8, head_dim=8, layout="HND", placement=src_placement)
    dst = dict(tp=1, heads=4, block_size=16, head_dim=8, layout="HND")
    src_specs, dst_specs = _pair("bfloat16", "float8_e5m2", src, dst)
    dst_specs = _cpu_fp8(dst_specs)
    sc = make_scenario(src_specs, dst_specs, 21, start_token=3, seed=5)
    result = reshard(sc.src, sc.dst, 21, 3, strategy=strategy, backend="torch")
    sc.assert_exact()
    assert {p.strategy for p in result.pairs} <= {"unpack", "pack+unpack"}
    assert all(p.nbytes == 2 * 18 * 2 * 2 * 2 * 8 for p in result.pairs)  # bf16 on the wire


def test_a_truncating_fp8_destination_refuses_a_pack_with_the_reason():
    geometry = dict(tp=1, heads=2, layout="HND")
    src_specs, dst_specs = _pair("bfloat16", "float8_e4m3fn", geometry, geometry)
    dst_specs = [msgspec.structs.replace(s, fp8_rounding="toward_zero") for s in dst_specs]
    with pytest.raises(ValueError, match="destination's fp8 write rounds 'toward_zero'"):
        plan_pairs(src_specs, dst_specs, strategy="pack")
    plans = plan_pairs(src_specs, dst_specs)
    assert {p.strategy for p in plans} <= {"unpack", "pack+unpack"}


SGLANG_CASES = [
    pytest.param(src, dst, strategy, id=f"{name}-{strategy}")
    for name, src, dst in GEOMETRIES
    for strategy in STRATEGIES
]


@pytest.mark.parametrize(("src", "dst", "strategy"), SGLANG_CASES)
@pytest.mark.parametrize(
    ("src_dtype", "dst_dtype"), [("bfloat16", "float8_e4m3fn"), ("float16", "float8_e5m2")]
)
def test_an_sglang_fp8_decode_holds_its_own_write(src_dtype, dst_dtype, src, dst, strategy):
    """An fp8 decode whose write is SGLang's (`fp8_rounding` "torch_cast": the scale and the
    quotient in the prefill's dtype, torch's cast) holds that write of the prefill's KV
    (`kvxfer.reference.sglang_fp8`), whichever side converts: `pack` converts on the prefill."""
    src_specs, dst_specs = _pair(src_dtype, dst_dtype, src, dst, layers=4)
    dst_specs = [msgspec.structs.replace(s, fp8_rounding="torch_cast") for s in dst_specs]
    sc = make_scenario(src_specs, dst_specs, 21, start_token=3, seed=5)
    result = reshard(sc.src, sc.dst, 21, 3, strategy=strategy, backend="torch")
    assert {p.strategy for p in result.pairs} == {strategy}
    sc.assert_exact()
