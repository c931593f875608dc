"""fp8 KV caches (float8_e4m3fn, float8_e5m2): moved as bytes on every path, bit for bit.

Only data movement is tested, never fp8 arithmetic: the reference fills fp8 requests with
uniformly random bytes (NaN patterns included) and every comparison is on uint8 views, with
destinations poisoned (0xA5) beforehand.
"""

from __future__ import annotations

import json

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from kvxfer import STRATEGIES, KVCacheSpec, allocate_kv_caches, reshard
from kvxfer.cli import main
from kvxfer.integrations.kv_tensors import EngineGeometry, spec_from_layers
from kvxfer.kernels import KVBuffer, copy_cells_torch
from kvxfer.reference import random_global_kv
from kvxfer.spec import DTYPE_ITEMSIZE, TORCH_DTYPES, decode_spec, encode_spec
from kvxfer.testing import make_scenario, side_specs
from kvxfer.testing.strategies import geometries, reshard_random_geometry

FP8 = ["float8_e4m3fn", "float8_e5m2"]


def _spec(dtype: str, **kw) -> KVCacheSpec:
    fields = dict(
        num_layers=2,
        num_kv_heads=4,
        head_dim=3,
        dtype=dtype,
        tp_size=2,
        tp_rank=1,
        block_size=16,
        num_blocks=8,
    )
    return KVCacheSpec(**{**fields, **kw})


@pytest.mark.parametrize("dtype", FP8)
def test_spec_validates_and_round_trips(dtype):
    spec = _spec(dtype, layout="HND", kv_placement="kv_inner")
    assert spec.itemsize == DTYPE_ITEMSIZE[dtype] == 1
    assert spec.torch_dtype == TORCH_DTYPES[dtype] == getattr(torch, dtype)
    assert spec.layer_bytes == 8 * 2 * 16 * 3 * 2  # [blocks, heads, slots, 2 * head_dim] bytes
    assert decode_spec(encode_spec(spec)) == spec
    caches = allocate_kv_caches(spec)
    assert all(t.dtype == spec.torch_dtype and t.element_size() == 1 for t in caches)


def test_unknown_fp8_names_are_refused():
    with pytest.raises(ValueError, match=r"KVCacheSpec.dtype.*float8_e4m3fn"):
        _spec("float8_e4m3fnuz")
    wire = msgspec.msgpack.encode({**msgspec.structs.asdict(_spec("float8_e5m2")), "dtype": "fp8"})
    with pytest.raises(msgspec.ValidationError, match="dtype"):
        decode_spec(wire)


@pytest.mark.parametrize("dtype", FP8)
def test_reference_request_holds_every_byte_value(dtype):
    kv = random_global_kv(_spec(dtype), 300, seed=1)
    assert kv.dtype == getattr(torch, dtype)
    assert torch.unique(kv.view(torch.uint8)).numel() == 256  # NaN and inf patterns too
    same = random_global_kv(_spec(dtype), 300, seed=1)
    assert torch.equal(kv.view(torch.uint8), same.view(torch.uint8))


CASES = [
    pytest.param(
        dict(tp=2, heads=4, block_size=16, head_dim=3),
        dict(tp=4, heads=4, block_size=48, head_dim=3, layout="HND"),
        0,
        id="P2-D4-bs16-bs48-d3-NHD-HND",
    ),
    pytest.param(
        dict(tp=3, heads=6, block_size=5, head_dim=8, placement="kv_inner"),
        dict(tp=2, heads=6, block_size=7, head_dim=8, layout="HND", placement="blocks_first"),
        9,
        id="P3-D2-bs5-bs7-d8-kv_inner-blocks_first-start9",
    ),
    pytest.param(
        dict(tp=1, heads=2, block_size=16, head_dim=5),
        dict(tp=8, heads=2, block_size=8, head_dim=5, placement="kv_inner"),
        0,
        id="P1-D8-replicated-d5",
    ),
    pytest.param(
        dict(tp=4, mla=True, block_size=16, head_dim=7),
        dict(tp=2, mla=True, block_size=32, head_dim=7),
        3,
        id="MLA-P4-D2-d7-start3",
    ),
]


@pytest.mark.parametrize("strategy", [None, *STRATEGIES])
@pytest.mark.parametrize("src,dst,start", CASES)
@pytest.mark.parametrize("dtype", FP8)
def test_reshard_fp8_is_bit_exact(dtype, src, dst, start, strategy):
    tokens = 61
    src_specs = side_specs(dtype=dtype, **src)
    dst_specs = side_specs(dtype=dtype, **dst)
    sc = make_scenario(src_specs, dst_specs, tokens, start, seed=4)
    result = reshard(sc.src, sc.dst, tokens, start, strategy=strategy, backend="torch")
    sc.assert_exact()  # uint8 comparison; untouched cells keep the 0xA5 poison
    if strategy is not None:
        assert {p.strategy for p in result.pairs} == {strategy}
    planes = 1 if src_specs[0].mla else 2
    head_dim = src_specs[0].head_dim
    fed = sum(len(p.heads) for p in result.pairs)
    assert result.nbytes == fed * planes * (tokens - start) * head_dim * 2  # 1 byte, 2 layers


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(geometries())
def test_reshard_fp8_matches_reference_on_random_geometries(g):
    for dtype in FP8:
        reshard_random_geometry({**g, "dtype": dtype}, backend="torch")


@pytest.mark.parametrize("dtype", FP8)
def test_torch_backend_copies_fp8_cells_as_bytes(dtype):
    """copy_cells_torch directly: an odd head_dim forces one-byte words (index_copy_ has no
    fp8 kernel on CPU; the backend moves the bytes as uint8)."""
    (spec,) = side_specs(1, heads=3, block_size=4, head_dim=3, dtype=dtype, num_blocks=6)
    src = allocate_kv_caches(spec)
    for t in src:
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8))
    dst = [torch.empty_like(t) for t in src]
    for t in dst:
        t.view(torch.uint8).fill_(0xA5)
    ids = torch.tensor([4, 1, 3], dtype=torch.int64)
    dst_ids = torch.tensor([0, 5, 2], dtype=torch.int64)
    copy_cells_torch(
        KVBuffer(src, block_ids=ids, head_offset=1),
        KVBuffer(dst, block_ids=dst_ids, head_offset=0),
        1,
        11,
        2,
    )
    for s, d in zip(src, dst, strict=True):
        for t in range(12):
            b, db, slot = int(ids[t // 4]), int(dst_ids[t // 4]), t % 4
            got, want = d[:, db, slot].view(torch.uint8), s[:, b, slot].view(torch.uint8)
            if 1 <= t < 11:
                assert torch.equal(got[:, :2], want[:, 1:3]) and (got[:, 2] == 0xA5).all()
            else:
                assert (got == 0xA5).all()


# ---- the vLLM tensor reader -------------------------------------------------------------------

GEOMETRY = dict(total_kv_heads=8, head_dim=16, block_size=4, tp_size=2, tp_rank=1)


@pytest.mark.parametrize("dtype", FP8)
def test_reader_takes_fp8_tensors_as_they_are(dtype):
    layers = [torch.empty(2, 6, 4, 4, 16, dtype=getattr(torch, dtype)) for _ in range(2)]
    spec, views = spec_from_layers(layers, EngineGeometry(**GEOMETRY))
    assert spec.dtype == dtype and spec.itemsize == 1
    assert [v.data_ptr() for v in views] == [t.data_ptr() for t in layers]


@pytest.mark.parametrize(
    "setting,dtype",
    [("fp8", "float8_e4m3fn"), ("fp8_e4m3", "float8_e4m3fn"), ("fp8_e5m2", "float8_e5m2")],
)
def test_reader_names_uint8_caches_by_the_engines_cache_dtype(setting, dtype):
    """vLLM stores fp8 caches as uint8; its cache_dtype setting says which format."""
    layers = [torch.empty(6, 4, 4, 32, dtype=torch.uint8).permute(0, 2, 1, 3)]  # [B, H, N, C]
    spec, views = spec_from_layers(layers, EngineGeometry(**GEOMETRY, kv_cache_dtype=setting))
    assert (spec.dtype, spec.layout, spec.kv_placement) == (dtype, "NHD", "kv_inner")
    # The connectors get the format itself, over the same bytes (no copy).
    assert views[0].dtype == spec.torch_dtype
    assert views[0].data_ptr() == layers[0].data_ptr()


def test_reader_keeps_an_fp8_caches_scales_in_layer_order():
    """vLLM's attention layers carry k_scale and v_scale; a stage's tensors may come in any
    order, the spec lists the scales by layer."""
    geometry = EngineGeometry(**GEOMETRY, kv_cache_dtype="fp8", kv_layers=(0, 1, 2))
    layers = [torch.empty(6, 4, 4, 32, dtype=torch.uint8).permute(0, 2, 1, 3) for _ in range(3)]
    spec, _ = spec_from_layers(layers, geometry, [2, 0, 1], [(3.0, 30.0), (1.0, 10.0), (2.0, 20.0)])
    assert spec.k_scales == (1.0, 2.0, 3.0) and spec.v_scales == (10.0, 20.0, 30.0)
    plain = EngineGeometry(**GEOMETRY)
    bf16 = [torch.empty(6, 4, 4, 32, dtype=torch.bfloat16).permute(0, 2, 1, 3)]
    spec, _ = spec_from_layers(bf16, plain, None, [(2.0, 2.0)])  # vLLM's 1.0s: not fp8, unused
    assert spec.k_scales == spec.v_scales == ()


def test_reader_refuses_uint8_caches_of_unknown_format():
    layers = [torch.empty(2, 6, 4, 4, 16, dtype=torch.uint8)]
    for setting in (None, "auto", "fp8_ds_mla"):
        with pytest.raises(ValueError, match=r"uint8.*kv_cache_dtype.*fp8_e5m2"):
            spec_from_layers(layers, EngineGeometry(**GEOMETRY, kv_cache_dtype=setting))
    e5m2 = [torch.empty(2, 6, 4, 4, 16, dtype=torch.float8_e5m2)]
    with pytest.raises(ValueError, match="float8_e5m2 but kv_cache_dtype 'fp8_e4m3'"):
        spec_from_layers(e5m2, EngineGeometry(**GEOMETRY, kv_cache_dtype="fp8_e4m3"))


# ---- the command line ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FP8)
def test_plan_command_takes_fp8(dtype, capsys):
    args = ["plan", "--num-layers", "2", "--head-dim", "64", "--tokens", "100", "--json"]
    assert main([*args, "--dtype", dtype]) == 0
    fp8 = json.loads(capsys.readouterr().out)
    assert main([*args, "--dtype", "bfloat16"]) == 0
    bf16 = json.loads(capsys.readouterr().out)
    assert 2 * fp8["total"]["bytes"] == bf16["total"]["bytes"]
