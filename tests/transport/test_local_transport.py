"""LocalTransport copies exactly the listed bytes and refuses segments outside regions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvxfer.plan import Segments
from kvxfer.transport import LocalTransport, TransferError


def segments(src_region, src_off, dst_region, dst_off, length):
    arr = lambda v: np.asarray(v, dtype=np.int64)  # noqa: E731
    return Segments(arr(src_region), arr(src_off), arr(dst_region), arr(dst_off), arr(length))


@pytest.mark.parametrize("length", [1, 3, 8, 24, 40000])  # byte, odd, word and slice paths
def test_copies_exactly_the_listed_bytes(length):
    gen = torch.Generator().manual_seed(length)
    size = 12 * length + 64
    src = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen)
    dst = torch.full((size,), 0xA5, dtype=torch.uint8)
    want = dst.clone()
    t = LocalTransport()
    a, b = t.register(src), t.register(dst)
    src_off = [0, 3 * length, 7 * length + 8]
    dst_off = [5 * length, 8, 2 * length + 16]
    if length > 8:
        dst_off[1] = 10 * length
    t.write(
        segments([a.region_id] * 3, src_off, [b.region_id] * 3, dst_off, [length] * 3), t.peer()
    )
    for s, d in zip(src_off, dst_off, strict=True):
        want[d : d + length] = src[s : s + length]
    assert torch.equal(dst, want)


def test_copies_between_dtypes_by_bits():
    src = torch.randn(64, dtype=torch.bfloat16)
    dst = torch.zeros(32, dtype=torch.float32)
    t = LocalTransport()
    a, b = t.register(src), t.register(dst)
    t.write(segments([a.region_id], [0], [b.region_id], [0], [128]), t.peer())
    assert torch.equal(dst.view(torch.bfloat16), src)


def test_segment_past_the_region_end_is_refused_before_any_copy():
    src, dst = torch.ones(100, dtype=torch.uint8), torch.zeros(100, dtype=torch.uint8)
    t = LocalTransport()
    a, b = t.register(src), t.register(dst)
    bad = segments([a.region_id] * 2, [0, 90], [b.region_id] * 2, [0, 50], [10, 20])
    with pytest.raises(TransferError, match=r"segment 1 .* source region"):
        t.write(bad, t.peer())
    assert int(dst.sum()) == 0  # the valid first segment did not run either


def test_unregistered_region_is_refused():
    t = LocalTransport()
    a = t.register(torch.ones(8))
    with pytest.raises(TransferError, match=r"destination region\(s\) \[7\] are not registered"):
        t.write(segments([a.region_id], [0], [7], [0], [4]), t.peer())


def test_registering_requires_contiguous_memory():
    with pytest.raises(ValueError, match="contiguous"):
        LocalTransport().register(torch.zeros(4, 4).t())


def test_segments_over_several_regions_are_checked_each_against_its_own():
    """Segments spread over regions of different sizes: each is bounded by its own region, and
    an unregistered one among registered ones is named."""
    t = LocalTransport()
    small, large = t.register(torch.zeros(4, dtype=torch.uint8)), t.register(torch.zeros(64))
    dst = t.register(torch.zeros(512, dtype=torch.uint8))
    ok = segments(
        [small.region_id, large.region_id], [0, 200], [dst.region_id] * 2, [0, 8], [4, 56]
    )
    t.write(ok, t.peer())
    past = segments([large.region_id, small.region_id], [200, 1], [dst.region_id] * 2, [0, 8],
                    [56, 4])  # fmt: skip
    with pytest.raises(TransferError, match=r"segment 1 \(4 bytes at source offset 1\)"):
        t.write(past, t.peer())
    stray = segments([small.region_id, 99], [0, 0], [dst.region_id] * 2, [0, 8], [4, 4])
    with pytest.raises(TransferError, match=r"source region\(s\) \[99\] are not registered"):
        t.write(stray, t.peer())


@pytest.mark.parametrize("places", [1, 2])
def test_region_keys_without_a_place_are_named(places):
    """`Segments.with_regions` places each key in its registered buffer, and names the keys
    it has no place for (one buffer on a side, or several)."""
    plan = segments([0, 0, 1], [0, 8, 16], [5, 5, 5], [0, 8, 16], [8, 8, 8])
    src_places = {0: (40, 1000), 1: (41, 0)} if places == 2 else {0: (40, 1000)}
    if places == 1:
        with pytest.raises(KeyError, match=r"region keys \[1\]"):
            plan.with_regions(src_places, {5: (50, 64)})
        return
    placed = plan.with_regions(src_places, {5: (50, 64)})
    assert placed.src_region.tolist() == [40, 40, 41]
    assert placed.src_offset.tolist() == [1000, 1008, 16]
    assert placed.dst_region.tolist() == [50, 50, 50]
    assert placed.dst_offset.tolist() == [64, 72, 80]
    with pytest.raises(KeyError, match=r"region keys \[5\]"):
        plan.with_regions(src_places, {6: (50, 64), 7: (51, 0)})
