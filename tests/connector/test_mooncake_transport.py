"""MooncakeTransport over real Mooncake TCP on 127.0.0.1 (two engines in one process)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvxfer.plan import Segments
from kvxfer.transport import Peer, TransferError
from kvxfer.transport.mooncake import MAX_BATCH, MooncakeTransport


@pytest.fixture
def pair():
    a, b = MooncakeTransport(), MooncakeTransport()
    yield a, b
    a.close()
    b.close()


def segs(src_id, src_off, dst_id, dst_off, length):
    n = len(src_off)
    return Segments(
        np.full(n, src_id),
        np.asarray(src_off),
        np.full(n, dst_id),
        np.asarray(dst_off),
        np.asarray(length),
    )


def test_writes_more_segments_than_one_batch_exactly(pair):
    a, b = pair
    src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
    dst = torch.full((1 << 20,), 0xA5, dtype=torch.uint8)
    ra, rb = a.register(src), b.register(dst)
    n = 2 * MAX_BATCH + 17  # three batches
    src_off = np.arange(n) * 300
    dst_off = (np.arange(n) * 301)[::-1].copy()
    a.write(
        segs(ra.region_id, src_off, rb.region_id, dst_off, [200] * n), Peer(b.endpoint, b.regions)
    )
    want = torch.full_like(dst, 0xA5)
    for s, d in zip(src_off.tolist(), dst_off.tolist(), strict=True):
        want[d : d + 200] = src[s : s + 200]
    assert torch.equal(dst, want)


def test_segment_outside_the_peer_region_is_refused_before_any_write(pair):
    a, b = pair
    src, dst = torch.ones(4096, dtype=torch.uint8), torch.zeros(4096, dtype=torch.uint8)
    ra, rb = a.register(src), b.register(dst)
    bad = segs(ra.region_id, [0, 0], rb.region_id, [0, 4000], [64, 200])
    with pytest.raises(TransferError, match=r"segment 1 .* destination region"):
        a.submit(bad, Peer(b.endpoint, b.regions))
    assert int(dst.sum()) == 0


def test_a_peer_that_advertises_a_short_region_is_caught(pair):
    a, b = pair
    src, dst = torch.ones(4096, dtype=torch.uint8), torch.zeros(4096, dtype=torch.uint8)
    ra, rb = a.register(src), b.register(dst)
    lying = {rb.region_id: type(rb)(rb.region_id, rb.address, 1024)}  # claims 1 KiB only
    with pytest.raises(TransferError, match="does not lie inside destination region"):
        a.write(segs(ra.region_id, [0], rb.region_id, [2048], [512]), Peer(b.endpoint, lying))
    assert int(dst.sum()) == 0


def test_write_to_an_unknown_endpoint_fails_with_context(pair):
    a, _ = pair
    src = torch.ones(64, dtype=torch.uint8)
    ra = a.register(src)
    peer = Peer("127.0.0.1:1", {0: type(ra)(0, 4096, 64)})  # nobody listens there
    with pytest.raises(TransferError, match=r"Mooncake write to 127\.0\.0\.1:1 failed"):
        a.write(segs(ra.region_id, [0], 0, [0], [64]), peer)
