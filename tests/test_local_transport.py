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
