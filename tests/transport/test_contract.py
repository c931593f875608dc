"""The transport contract, run over every transport kind (`kvxfer.transport.factory.KINDS`).

What a connector relies on, whatever moves the bytes: reads and writes land exactly the listed
bytes and nothing else (checked on poisoned memory); a segment outside a region is refused
before a byte moves; a transfer's future settles once it landed or failed, and a failed one
lands nothing later; a driven transport moves only when driven; a closed transport refuses
work; a peer's endpoint is checked by its kind. Mooncake runs for real over TCP on 127.0.0.1.
What only Mooncake does (its in-flight caps, its pump's polling) is tested in
tests/connector/test_mooncake_transport.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future

import numpy as np
import pytest
import torch

from kvxfer.plan import Segments
from kvxfer.transport import Peer, TransferError, Transport
from kvxfer.transport.factory import (
    KINDS,
    TransportOptions,
    check_peer_endpoint,
    check_transport_available,
    create_transport,
    transport_kind,
)

POISON = 0xA5
SETTLE_S = 60.0  # a bound on a transfer of a few KiB, for a machine that stalls processes


@pytest.fixture(params=sorted(KINDS))
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


def new(kind: str, driven: bool = False) -> Transport:
    return create_transport(kind, TransportOptions(driven=driven))


@pytest.fixture
def pair(kind: str) -> Iterator[tuple[Transport, Transport]]:
    """A local transport and its peer, of one kind."""
    local, peer = new(kind), new(kind)
    yield local, peer
    local.close()
    peer.close()


def segments(src_id: int, src_off: list[int], dst_id: int, dst_off: list[int], length: int):
    n = len(src_off)
    return Segments(
        np.full(n, src_id, dtype=np.int64),
        np.asarray(src_off, dtype=np.int64),
        np.full(n, dst_id, dtype=np.int64),
        np.asarray(dst_off, dtype=np.int64),
        np.full(n, length, dtype=np.int64),
    )


def view(transport: Transport) -> Peer:
    """A transport as its peers see it: the endpoint and regions its handshake advertises."""
    return Peer(transport.endpoint, dict(transport.regions))  # type: ignore[attr-defined]


def source(nbytes: int = 64 << 10, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def poisoned(nbytes: int = 64 << 10) -> torch.Tensor:
    return torch.full((nbytes,), POISON, dtype=torch.uint8)


def expected(src: torch.Tensor, dst: torch.Tensor, src_off, dst_off, length) -> torch.Tensor:
    want = dst.clone()
    for s, d in zip(src_off, dst_off, strict=True):
        want[d : d + length] = src[s : s + length]
    return want


def settle(transport: Transport, future: Future[None]) -> None:
    """Wait for a transfer, driving a driven transport as its owner's loop would."""
    deadline = time.monotonic() + SETTLE_S
    while not future.done() and time.monotonic() < deadline:
        due = transport.drive() if transport.driven else 0.001
        time.sleep(min(due if due is not None else 0.001, 0.01))
    future.result(0)


SRC_OFF, DST_OFF, LENGTH = [0, 5000, 33000, 9], [40000, 7, 20000, 61000], 1500


def test_a_read_lands_every_listed_byte_and_no_other(pair):
    local, peer = pair
    src, dst = source(), poisoned()
    theirs, mine = peer.register(src), local.register(dst)
    want = expected(src, dst, SRC_OFF, DST_OFF, LENGTH)
    future = local.read(
        segments(theirs.region_id, SRC_OFF, mine.region_id, DST_OFF, LENGTH), view(peer)
    )
    settle(local, future)
    assert torch.equal(dst, want)
    assert local.in_flight() == 0


def test_a_write_lands_every_listed_byte_and_no_other(pair):
    local, peer = pair
    src, dst = source(seed=1), poisoned()
    mine, theirs = local.register(src), peer.register(dst)
    want = expected(src, dst, SRC_OFF, DST_OFF, LENGTH)
    local.write(
        segments(mine.region_id, SRC_OFF, theirs.region_id, DST_OFF, LENGTH), view(peer), SETTLE_S
    )
    assert torch.equal(dst, want)


def test_a_segment_outside_a_region_is_refused_before_a_byte_moves(pair):
    local, peer = pair
    dst = poisoned(4096)
    theirs, mine = peer.register(source(4096)), local.register(dst)
    past = segments(theirs.region_id, [0, 4000], mine.region_id, [0, 100], 200)
    with pytest.raises(TransferError, match=r"segment 1 .*source region"):
        local.read(past, view(peer))
    unknown = segments(theirs.region_id, [0], 99, [0], 16)
    with pytest.raises(TransferError, match=r"destination region\(s\) \[99\] are not registered"):
        local.read(unknown, view(peer))
    time.sleep(0.05)  # nothing was started that could land late
    assert bool((dst == POISON).all())


def test_a_read_from_a_closed_peer_fails_and_lands_nothing(kind):
    local, peer = new(kind), new(kind)
    try:
        theirs = peer.register(source(4096))
        dst = poisoned(4096)
        mine = local.register(dst)
        advertised = view(peer)
        peer.close()
        future = local.read(segments(theirs.region_id, [0], mine.region_id, [0], 4096), advertised)
        with pytest.raises(TransferError):
            settle(local, future)
        assert bool((dst == POISON).all())
    finally:
        local.close()


def test_a_closed_transport_refuses_new_transfers(pair):
    local, peer = pair
    theirs, mine = peer.register(source(1024)), local.register(poisoned(1024))
    wanted = segments(theirs.region_id, [0], mine.region_id, [0], 1024)
    advertised = view(peer)
    local.close()
    with pytest.raises(TransferError, match="closed"):
        local.read(wanted, advertised)


def test_a_driven_transport_moves_only_when_driven(kind):
    local, peer = new(kind, driven=True), new(kind)
    try:
        src, dst = source(seed=2), poisoned()
        theirs, mine = peer.register(src), local.register(dst)
        want = expected(src, dst, SRC_OFF, DST_OFF, LENGTH)
        future = local.read(
            segments(theirs.region_id, SRC_OFF, mine.region_id, DST_OFF, LENGTH), view(peer)
        )
        time.sleep(0.05)
        assert not future.done()  # no thread of its own settles it
        assert local.in_flight(peer.endpoint) > 0
        settle(local, future)
        assert torch.equal(dst, want)
        assert local.drive() is None  # nothing left in flight
    finally:
        local.close()
        peer.close()


def test_a_peer_endpoint_is_checked_by_its_kind(pair, kind):
    local, peer = pair
    assert local.kind == kind
    assert check_peer_endpoint(local.kind, peer.kind, peer.endpoint) == peer.endpoint
    assert transport_kind(kind).check_endpoint(peer.endpoint) == peer.endpoint
    other = next(name for name in KINDS if name != kind)
    with pytest.raises(ValueError, match=f"its transport is '{other}' and this side's is '{kind}'"):
        check_peer_endpoint(local.kind, other, peer.endpoint)
    with pytest.raises(ValueError, match="endpoint"):
        transport_kind(kind).check_endpoint("tcp://nowhere")


def test_a_kind_that_can_start_here_passes_its_availability_check(pair, kind):
    local, _ = pair  # it started, so its check must pass: a check that refuses it is wrong
    check_transport_available(kind, TransportOptions())
    assert local.protocol in {"tcp", "rdma", kind}


def test_an_unknown_kind_is_refused_naming_the_known_ones():
    with pytest.raises(
        ValueError,
        match=r"'nixl' is not a transport kvxfer has; use one of \['local', 'mooncake'\]",
    ):
        create_transport("nixl")
