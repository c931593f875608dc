"""Bad input to `reshard` raises a ValueError that names the problem."""

from __future__ import annotations

import pytest
from helpers import make_scenario, side_specs

from kvxfer import reshard
from kvxfer.kernels.copy_cells import INTERPRETED


def scenario(**dst_changes):
    src = side_specs(2, heads=4, block_size=8)
    dst = side_specs(4, heads=4, block_size=16, **dst_changes)
    return make_scenario(src, dst, 30)


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(head_dim=16), "head_dim differs"),
        (dict(num_layers=3), "num_layers differs"),
        (dict(dtype="bfloat16"), "dtype differs"),
        (dict(heads=8), "num_kv_heads differs"),
    ],
)
def test_mismatched_sides(changes, message):
    src = side_specs(2, heads=4)
    dst_kwargs = {"heads": 4, **changes}
    sc = make_scenario(src, src, 10)
    dst = make_scenario(side_specs(4, **dst_kwargs), side_specs(4, **dst_kwargs), 10).dst
    with pytest.raises(ValueError, match=message):
        reshard(sc.src, dst, 10)


def test_too_few_block_ids():
    sc = scenario()
    spec, caches, ids = sc.dst[1]
    sc.dst[1] = (spec, caches, ids[:1])
    with pytest.raises(ValueError, match=r"destination rank 1: too few block ids: 1 for 30"):
        reshard(sc.src, sc.dst, 30)


def test_block_id_out_of_range():
    sc = scenario()
    spec, caches, ids = sc.src[0]
    ids = ids.copy()
    ids[2] = spec.num_blocks
    sc.src[0] = (spec, caches, ids)
    with pytest.raises(ValueError, match=r"source rank 0: block id 64 \(position 2\) is out of"):
        reshard(sc.src, sc.dst, 30)


def test_duplicated_block_id():
    sc = scenario()
    spec, caches, ids = sc.dst[0]
    ids = ids.copy()
    ids[1] = ids[0]
    sc.dst[0] = (spec, caches, ids)
    with pytest.raises(ValueError, match="appear more than once"):
        reshard(sc.src, sc.dst, 30)


def test_missing_rank():
    sc = scenario()
    with pytest.raises(ValueError, match=r"destination: missing rank\(s\) \[2\]"):
        reshard(sc.src, [sc.dst[0], sc.dst[1], sc.dst[3]], 30)


def test_duplicated_rank():
    sc = scenario()
    with pytest.raises(ValueError, match=r"source: duplicated rank\(s\) \[0\]"):
        reshard([sc.src[0], sc.src[0], sc.src[1]], sc.dst, 30)


def test_ranks_of_one_side_must_agree():
    sc = scenario()
    other = make_scenario(side_specs(2), side_specs(4, block_size=32), 30)
    with pytest.raises(ValueError, match="rank 3 has block_size=32"):
        reshard(sc.src, [*sc.dst[:3], other.dst[3]], 30)


def test_cache_shape_must_match_spec():
    sc = scenario()
    spec, caches, ids = sc.src[1]
    sc.src[1] = (spec, [caches[0], caches[1][:, :10]], ids)
    with pytest.raises(ValueError, match="source rank 1: layer 1 has shape"):
        reshard(sc.src, sc.dst, 30)


def test_cache_count_must_match_layers():
    sc = scenario()
    spec, caches, ids = sc.src[1]
    sc.src[1] = (spec, caches[:1], ids)
    with pytest.raises(ValueError, match="1 cache tensors for num_layers=2"):
        reshard(sc.src, sc.dst, 30)


@pytest.mark.parametrize(
    "num_tokens,start,message",
    [(0, 0, "num_tokens"), (30, 31, "start_token"), (30, -1, "start_token")],
)
def test_token_range(num_tokens, start, message):
    sc = scenario()
    with pytest.raises(ValueError, match=message):
        reshard(sc.src, sc.dst, num_tokens, start)


def test_unknown_strategy():
    sc = scenario()
    with pytest.raises(ValueError, match="unknown strategy 'zero-copy'"):
        reshard(sc.src, sc.dst, 30, strategy="zero-copy")


def test_unknown_backend():
    sc = scenario()
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        reshard(sc.src, sc.dst, 30, backend="cuda")


@pytest.mark.skipif(INTERPRETED, reason="the Triton interpreter runs CPU tensors")
def test_triton_backend_needs_cuda_or_the_interpreter():
    sc = scenario()
    with pytest.raises(RuntimeError, match="set TRITON_INTERPRET=1"):
        reshard(sc.src, sc.dst, 30, backend="triton")
    sc.assert_untouched()  # refused before any byte moved


def test_bad_entry_shape():
    sc = scenario()
    with pytest.raises(ValueError, match=r"\(spec, caches, block_ids\)"):
        reshard([s[:2] for s in sc.src], sc.dst, 30)
