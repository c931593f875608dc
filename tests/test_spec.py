"""KVCacheSpec validation, serialization and the layout contract's shapes."""

from __future__ import annotations

import msgspec
import pytest
import torch

from kvxfer import KVCacheSpec, allocate_kv_caches, decode_spec, encode_spec

BASE = dict(
    num_layers=2,
    num_kv_heads=8,
    head_dim=16,
    dtype="bfloat16",
    tp_size=4,
    tp_rank=1,
    block_size=16,
    num_blocks=10,
)


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
    ],
)
def test_invalid_fields_are_named(changes, field):
    with pytest.raises(ValueError, match=rf"KVCacheSpec\.{field}:"):
        spec(**changes)


def test_roundtrips_through_msgpack():
    original = spec(layout="HND", kv_placement="blocks_first")
    assert decode_spec(encode_spec(original)) == original


def test_decoding_validates():
    data = msgspec.msgpack.encode({**BASE, "tp_rank": 9})
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
