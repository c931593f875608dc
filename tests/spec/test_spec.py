"""KVCacheSpec validation, serialization and the layout contract's shapes."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from kvxfer import KVCacheSpec, allocate_kv_caches, decode_spec, encode_spec

MODEL = dict(num_layers=2, num_kv_heads=8, head_dim=16, dtype="bfloat16")  # the model fixes
RANK = dict(tp_size=4, tp_rank=1, block_size=16, num_blocks=10)  # one engine rank chooses
BASE = {**MODEL, **RANK}


def spec(**changes) -> KVCacheSpec:
    return KVCacheSpec(**{**BASE, **changes})


def test_fields_are_exactly_the_public_contract():
    assert KVCacheSpec.__struct_fields__ == (
        "num_layers",
        "num_kv_heads",
        "head_dim",
        "dtype",
        "tp_size",
        "tp_rank",
        "block_size",
        "num_blocks",
        "layout",
        "kv_placement",
        "mla",
        "pp_size",
        "pp_rank",
        "layer_start",
        "total_layers",
        "block_stride",
        "k_scales",
        "v_scales",
        "fp8_rounding",
    )


@pytest.mark.parametrize(
    "changes,field",
    [
        (dict(num_layers=0), "num_layers"),
        (dict(head_dim=-1), "head_dim"),
        (dict(block_size=0), "block_size"),
        (dict(num_blocks=0), "num_blocks"),
        (dict(tp_size=0), "tp_size"),
        (dict(tp_rank=4), "tp_rank"),
        (dict(tp_rank=-1), "tp_rank"),
        (dict(dtype="int8"), "dtype"),
        (dict(layout="NDH"), "layout"),
        (dict(kv_placement="planes_first"), "kv_placement"),
        (dict(num_kv_heads=6, tp_size=4, tp_rank=0), "num_kv_heads"),  # 4 does not divide 6
        (dict(num_kv_heads=4, tp_size=6, tp_rank=0), "num_kv_heads"),  # 4 does not divide 6
        (dict(mla=True), "num_kv_heads"),  # MLA has one latent head
        (dict(pp_size=0), "pp_size"),
        (dict(pp_size=2, pp_rank=2, total_layers=4), "pp_rank"),
        (dict(pp_size=2, pp_rank=-1, total_layers=4), "pp_rank"),
        (dict(pp_size=2, pp_rank=1, layer_start=-1, total_layers=4), "layer_start"),
        (dict(pp_size=2, total_layers=-1), "total_layers"),
        (dict(pp_size=2), "total_layers"),  # required with pipeline parallelism
        (dict(pp_size=2, pp_rank=1, layer_start=3, total_layers=4), "num_layers"),  # past it
        (dict(pp_size=3, pp_rank=1, layer_start=3, total_layers=4), "num_layers"),
        (dict(pp_size=2, layer_start=1, total_layers=4), "layer_start"),  # stage 0 starts at 0
        (dict(pp_size=2, pp_rank=1, layer_start=1, total_layers=4), "num_layers"),  # last: end
        (dict(layer_start=1), "layer_start"),  # pp_size 1 holds every layer
        (dict(total_layers=3), "total_layers"),  # pp_size 1: num_layers is the model's
    ],
)
def test_invalid_fields_are_named(changes, field):
    with pytest.raises(ValueError, match=rf"KVCacheSpec\.{field}:"):
        spec(**changes)


# Every field the contract types as int (read from the struct, not from kvxfer.spec's list).
INT_FIELDS = tuple(f.name for f in msgspec.structs.fields(KVCacheSpec) if f.type is int)
PP_BASE = dict(pp_size=3, pp_rank=1, layer_start=2, total_layers=6)


def test_every_count_index_and_stride_is_an_int_field():
    others = {"dtype", "layout", "kv_placement", "mla", "k_scales", "v_scales", "fp8_rounding"}
    assert set(KVCacheSpec.__struct_fields__) - set(INT_FIELDS) == others


@pytest.mark.parametrize("np_type", [np.int64, np.int32, np.uint16, np.intp])
def test_numpy_integers_are_plain_ints(np_type):
    s = KVCacheSpec(
        **{**{k: np_type(v) for k, v in BASE.items() if k != "dtype"}, "dtype": "bfloat16"}
    )
    assert s == spec()
    assert all(type(getattr(s, name)) is int for name in INT_FIELDS)
    assert hash(s) == hash(spec())
    assert decode_spec(encode_spec(s)) == spec()  # msgpack cannot encode numpy scalars
    s = KVCacheSpec(**{**BASE, **{k: np_type(v) for k, v in PP_BASE.items()}})
    assert s == spec(**PP_BASE)
    assert all(type(getattr(s, name)) is int for name in INT_FIELDS)


def test_numpy_bool_is_accepted_for_mla():
    s = spec(num_kv_heads=1, mla=np.bool_(True))
    assert s.mla is True
    assert decode_spec(encode_spec(s)) == s


def test_with_rank_takes_a_numpy_integer():
    assert type(spec().with_rank(np.int64(2)).tp_rank) is int


@pytest.mark.parametrize("field", INT_FIELDS)
@pytest.mark.parametrize("value", [True, False, np.bool_(True)])
def test_bools_are_refused_for_integer_fields(field, value):
    with pytest.raises(
        ValueError, match=rf"KVCacheSpec\.{field}: must be an integer, got the bool"
    ):
        spec(**{field: value})


@pytest.mark.parametrize("value", [2.0, "2", None, np.float32(2)])
def test_non_integers_are_refused_with_their_type(value):
    with pytest.raises(
        ValueError, match=r"KVCacheSpec\.num_layers: must be an integer, got .* type"
    ):
        spec(num_layers=value)


def test_the_bool_message_names_the_accepted_form():
    with pytest.raises(ValueError, match=r"tp_rank: .*; pass an int such as 1 \(numpy integers"):
        spec(tp_rank=True)


def test_roundtrips_through_msgpack():
    original = spec(layout="HND", kv_placement="blocks_first")
    assert decode_spec(encode_spec(original)) == original


def test_pipeline_fields_roundtrip_and_default_to_no_pipeline():
    staged = spec(**PP_BASE)
    assert decode_spec(encode_spec(staged)) == staged
    assert (staged.layers, staged.model_layers) == (range(2, 4), 6)
    assert (staged.engine_rank, staged.engine_size) == (1 * 4 + 1, 12)
    plain = spec()
    assert (plain.pp_size, plain.pp_rank, plain.layer_start, plain.total_layers) == (1, 0, 0, 0)
    assert (plain.layers, plain.model_layers, plain.engine_rank) == (range(0, 2), 2, 1)
    # A spec of the fields before pipeline parallelism decodes as a rank holding every layer.
    assert decode_spec(msgspec.msgpack.encode(BASE)) == plain
    # total_layers may also be given equal to num_layers without pipeline parallelism.
    assert spec(total_layers=2).model_layers == 2


def test_decoding_validates_pipeline_fields():
    data = msgspec.msgpack.encode({**BASE, **PP_BASE, "layer_start": 5})
    with pytest.raises(msgspec.ValidationError, match="num_layers"):
        decode_spec(data)


def test_decoding_validates():
    data = msgspec.msgpack.encode({**BASE, "tp_rank": 9})
    with pytest.raises(msgspec.ValidationError, match="tp_rank"):
        decode_spec(data)


def test_decoding_refuses_a_bool_rank():
    data = msgspec.msgpack.encode({**BASE, "tp_rank": True})
    with pytest.raises(msgspec.ValidationError, match="tp_rank"):
        decode_spec(data)


@pytest.mark.parametrize(
    "layout,placement,shape",
    [
        ("NHD", "kv_first", (2, 10, 16, 2, 16)),
        ("HND", "kv_first", (2, 10, 2, 16, 16)),
        ("NHD", "blocks_first", (10, 2, 16, 2, 16)),
        ("HND", "blocks_first", (10, 2, 2, 16, 16)),
        ("NHD", "kv_inner", (10, 16, 2, 32)),
        ("HND", "kv_inner", (10, 2, 16, 32)),
    ],
)
def test_allocate_follows_the_layout_contract(layout, placement, shape):
    caches = allocate_kv_caches(spec(layout=layout, kv_placement=placement))
    assert len(caches) == 2
    assert all(t.shape == shape and t.dtype == torch.bfloat16 for t in caches)
    assert all(t.is_contiguous() for t in caches)


def test_allocate_mla():
    caches = allocate_kv_caches(spec(num_kv_heads=1, mla=True, layout="HND"))
    assert [tuple(t.shape) for t in caches] == [(10, 16, 16), (10, 16, 16)]


@pytest.mark.parametrize(
    "heads,tp,rank,first,count",
    [(8, 4, 1, 2, 2), (8, 8, 7, 7, 1), (2, 8, 5, 1, 1), (1, 4, 3, 0, 1), (3, 6, 4, 2, 1)],
)
def test_head_ownership(heads, tp, rank, first, count):
    s = spec(num_kv_heads=heads, tp_size=tp, tp_rank=rank)
    assert (s.first_head, s.heads_per_rank) == (first, count)


def test_engine_ranks_lists_every_rank_of_the_engine():
    ranks = spec(tp_rank=2).engine_ranks()
    assert [s.tp_rank for s in ranks] == [0, 1, 2, 3]
    assert all(s.layer_shape == ranks[0].layer_shape for s in ranks)
    assert ranks[0].first_head == 0 and ranks[3].first_head == 6


def test_engine_ranks_with_pipeline_parallelism_are_pp_major():
    # 6 layers over 3 stages: vLLM's default split gives 2 each; rank (pp 1, tp 1) holds 2-3.
    ranks = spec(**PP_BASE).engine_ranks()
    assert [(s.pp_rank, s.tp_rank) for s in ranks] == [(p, t) for p in range(3) for t in range(4)]
    assert [s.engine_rank for s in ranks] == list(range(12))
    assert [s.layers for s in ranks[::4]] == [range(0, 2), range(2, 4), range(4, 6)]
    uneven = spec(pp_size=3, pp_rank=1, layer_start=1, num_layers=3, total_layers=6)
    ranks = uneven.engine_ranks([(0, 1), (1, 4), (4, 6)])
    assert [s.layers for s in ranks[::4]] == [range(0, 1), range(1, 4), range(4, 6)]
    assert all(s.model_layers == 6 for s in ranks)


@pytest.mark.parametrize(
    "ranges",
    [
        None,  # the default split (2, 2, 2) disagrees with this rank's layers 1-3
        [(0, 1), (1, 4)],  # two stages for pp_size 3
        [(0, 1), (2, 4), (4, 6)],  # a gap
        [(0, 1), (1, 3), (3, 6)],  # stage 1's range is not this rank's
        [(0, 1), (1, 4), (4, 5)],  # ends before total_layers
    ],
)
def test_engine_ranks_refuse_layer_ranges_that_do_not_fit(ranges):
    uneven = spec(pp_size=3, pp_rank=1, layer_start=1, num_layers=3, total_layers=6)
    with pytest.raises(ValueError, match="layer_ranges"):
        uneven.engine_ranks(ranges)


def test_fp8_scales_roundtrip_normalize_and_default_to_one():
    fp8 = spec(dtype="float8_e4m3fn", k_scales=[0.5, 2], v_scales=(1.0, 4.0))
    assert fp8.k_scales == (0.5, 2.0) and type(fp8.k_scales[1]) is float
    assert decode_spec(encode_spec(fp8)) == fp8
    assert fp8.layer_scales(1, 1).tolist() == [[2.0, 4.0]]
    assert spec(dtype="float8_e5m2").layer_scales(0, 2).tolist() == [[1.0, 1.0], [1.0, 1.0]]
    mla = spec(dtype="float8_e4m3fn", mla=True, num_kv_heads=1, k_scales=(3.0, 5.0))
    assert mla.layer_scales(0, 2).tolist() == [[3.0], [5.0]]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(k_scales=(1.0, 1.0)), "scales describe an fp8 cache"),
        (dict(dtype="float8_e4m3fn", k_scales=(1.0,)), "1 scales for 2 layers"),
        (dict(dtype="float8_e4m3fn", v_scales=(1.0, 0.0)), "0.0 is not a positive finite"),
        (dict(dtype="float8_e4m3fn", k_scales=(1.0, float("inf"))), "inf is not a positive"),
        (dict(dtype="float8_e4m3fn", mla=True, num_kv_heads=1, v_scales=(1.0, 1.0)),
         "one latent plane"),
        (dict(dtype="float8_e4m3fn", k_scales="ab"), "must be a sequence of floats"),
    ],
)  # fmt: skip
def test_bad_scales_are_refused_with_the_fix(changes, message):
    with pytest.raises(ValueError, match=message):
        spec(**changes)


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        (dict(fp8_rounding="toward_zero"), "describes an fp8 cache's write"),
        (dict(dtype="float8_e4m3fn", fp8_rounding="stochastic"), "unknown rounding"),
    ],
)
def test_an_fp8_rounding_is_an_fp8_caches_and_one_of_two(changes, problem):
    with pytest.raises(ValueError, match=problem):
        spec(**changes)


def test_an_fp8_rounding_survives_the_handshake():
    sent = spec(dtype="float8_e5m2", fp8_rounding="toward_zero")
    assert decode_spec(encode_spec(sent)).fp8_rounding == "toward_zero"
