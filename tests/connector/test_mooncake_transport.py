"""MooncakeTransport over real Mooncake TCP on 127.0.0.1 (two engines in one process)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

import kvxfer.transport.mooncake as mooncake_mod
from kvxfer.connector.registration import CacheRegistration
from kvxfer.plan import Segments
from kvxfer.transport import Peer, TransferError
from kvxfer.transport.completion import (
    MAX_POLL_SECONDS,
    POLL_SECONDS,
    TOTAL_IN_FLIGHT,
    poll_interval,
)
from kvxfer.transport.mooncake import MooncakeTransport, rdma_devices


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


def test_writes_more_segments_than_the_in_flight_cap_exactly(pair):
    a, b = pair
    src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
    dst = torch.full((1 << 20,), 0xA5, dtype=torch.uint8)
    ra, rb = a.register(src), b.register(dst)
    n = 2 * TOTAL_IN_FLIGHT + 17  # more than the engine may have in flight at once
    src_off = np.arange(n) * 300
    dst_off = (np.arange(n) * 301)[::-1].copy()
    a.write(
        segs(ra.region_id, src_off, rb.region_id, dst_off, [200] * n), Peer(b.endpoint, b.regions)
    )
    want = torch.full_like(dst, 0xA5)
    for s, d in zip(src_off.tolist(), dst_off.tolist(), strict=True):
        want[d : d + 200] = src[s : s + 200]
    assert torch.equal(dst, want)


def test_a_driven_transport_reads_more_than_the_cap_exactly_on_its_owners_thread(pair):
    """No thread of its own: submits at `read`, settles in `drive`, on the caller's thread."""
    a, _ = pair
    b = MooncakeTransport(driven=True)
    try:
        src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
        dst = torch.full((1 << 20,), 0xA5, dtype=torch.uint8)
        ra, rb = a.register(src), b.register(dst)
        n = 2 * TOTAL_IN_FLIGHT + 17  # more than the engine may have in flight at once
        src_off = (np.arange(n) * 301)[::-1].copy()
        dst_off = np.arange(n) * 300
        settled_on: list[str] = []
        future = b.read(
            segs(ra.region_id, src_off, rb.region_id, dst_off, [200] * n),
            Peer(a.endpoint, a.regions),
        )
        future.add_done_callback(lambda _: settled_on.append(threading.current_thread().name))
        assert b.in_flight() > 0  # submitted by `read` itself
        deadline = time.monotonic() + 60.0
        while (due_in := b.drive()) is not None:
            assert 0.0 <= due_in <= MAX_POLL_SECONDS  # the next poll, never further away
            assert time.monotonic() < deadline, "the read never settled"
            time.sleep(due_in)
        assert future.done() and future.exception() is None
        assert settled_on == [threading.current_thread().name]
        want = torch.full_like(dst, 0xA5)
        for s, d in zip(src_off.tolist(), dst_off.tolist(), strict=True):
            want[d : d + 200] = src[s : s + 200]
        assert torch.equal(dst, want)
    finally:
        b.close()


def test_a_driven_read_from_nobody_fails_at_once_and_only_a_driven_transport_drives(pair):
    a, _ = pair
    b = MooncakeTransport(driven=True)
    try:
        dst = torch.zeros(64, dtype=torch.uint8)
        rb = b.register(dst)
        peer = Peer("127.0.0.1:1", {0: type(rb)(0, 4096, 64)})  # nobody listens there
        future = b.read(segs(0, [0], rb.region_id, [0], [64]), peer)
        deadline = time.monotonic() + 60.0
        while (due_in := b.drive()) is not None:
            assert time.monotonic() < deadline, "the read never settled"
            time.sleep(due_in)
        with pytest.raises(TransferError, match=r"Mooncake read from 127\.0\.0\.1:1 failed"):
            future.result(0)
        assert int(dst.sum()) == 0
    finally:
        b.close()
    with pytest.raises(TransferError, match="runs its own thread"):
        a.drive()


@pytest.mark.parametrize(
    ("since_submit", "wait"),
    [
        (0.0, POLL_SECONDS),
        (0.001, POLL_SECONDS),
        (0.008, 0.001),
        (0.016, MAX_POLL_SECONDS),
        (9.0, MAX_POLL_SECONDS),
    ],
)
def test_a_young_read_is_polled_every_0_2_ms_an_old_one_less_often(since_submit, wait):
    """An eighth of the time since the last submit, between 0.2 and 2 ms: a small read is found
    at once, a long one is not polled a hundred times."""
    assert poll_interval(since_submit) == pytest.approx(wait)


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


# --- Protocols ---------------------------------------------------------------------------


@pytest.fixture
def no_rdma(tmp_path, monkeypatch):
    """A machine without RDMA devices, whatever this one has."""
    monkeypatch.setenv("KVXFER_INFINIBAND_SYSFS", str(tmp_path / "missing"))


def roundtrip(a: MooncakeTransport, b: MooncakeTransport) -> None:
    """Write 4 KiB from `a` to `b` and check every byte."""
    src = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    dst = torch.zeros(4096, dtype=torch.uint8)
    ra, rb = a.register(src), b.register(dst)
    a.write(segs(ra.region_id, [0], rb.region_id, [0], [4096]), Peer(b.endpoint, b.regions))
    assert torch.equal(src, dst)


@pytest.mark.parametrize("protocol", ["udp", "TCP", "", None, "nvlink"])
def test_an_unknown_protocol_is_refused_naming_the_accepted_ones(protocol):
    with pytest.raises(
        ValueError, match=r"protocol: .* is not supported; use one of \['tcp', 'rdma'\]"
    ):
        MooncakeTransport(protocol=protocol)


def test_rdma_devices_lists_sysfs(tmp_path, monkeypatch):
    for name in ("mlx5_1", "mlx5_0"):
        (tmp_path / name).mkdir()
    monkeypatch.setenv("KVXFER_INFINIBAND_SYSFS", str(tmp_path))
    assert rdma_devices() == ["mlx5_0", "mlx5_1"]
    monkeypatch.setenv("KVXFER_INFINIBAND_SYSFS", str(tmp_path / "missing"))
    assert rdma_devices() == []


def test_rdma_without_a_device_is_refused_with_the_fix(no_rdma):
    with pytest.raises(
        TransferError,
        match=r'protocol="rdma": no RDMA device found .*; use protocol="tcp", or pass '
        r"rdma_fallback=True",
    ):
        MooncakeTransport(protocol="rdma")


@pytest.mark.skipif(bool(rdma_devices()), reason="this machine has RDMA devices")
def test_rdma_is_refused_on_this_machine():
    with pytest.raises(TransferError, match=r'use protocol="tcp", or pass rdma_fallback=True'):
        MooncakeTransport(protocol="rdma")


def test_a_named_rdma_device_that_is_missing_is_refused(tmp_path, monkeypatch):
    (tmp_path / "mlx5_0").mkdir()
    monkeypatch.setenv("KVXFER_INFINIBAND_SYSFS", str(tmp_path))
    with pytest.raises(
        TransferError,
        match=r"RDMA device\(s\) \['mlx5_9'\] not found; this machine has \['mlx5_0'\]",
    ):
        MooncakeTransport(protocol="rdma", device="mlx5_9")


def test_rdma_fallback_runs_tcp_and_says_so(no_rdma, caplog):
    with caplog.at_level(logging.WARNING, logger="kvxfer.transport.mooncake"):
        a = MooncakeTransport(protocol="rdma", rdma_fallback=True)
    try:
        assert a.protocol == "tcp"
        assert "using TCP instead because rdma_fallback=True" in caplog.text
        with MooncakeTransport() as b:
            assert b.protocol == "tcp"
            roundtrip(a, b)
    finally:
        a.close()


def _losing_ports(monkeypatch, losses, error="bind: Address already in use"):
    """Mooncake's own engine class, whose first `losses` starts fail with `error` the way
    its native bind does when another process took the port between Mooncake's check and its
    bind (a race that cannot be provoked on demand); every later start is the real one."""
    real = mooncake_mod._engine_class()
    started = []

    class LosesPorts(real):
        def initialize(self, *args):
            started.append(self)
            if len(started) <= losses:
                raise RuntimeError(error)
            return super().initialize(*args)

    monkeypatch.setattr(mooncake_mod, "_engine_class", lambda: LosesPorts)
    return started


def test_an_engine_that_lost_a_port_to_another_process_starts_again(monkeypatch, caplog):
    started = _losing_ports(monkeypatch, losses=mooncake_mod.PORT_ATTEMPTS - 1)
    with caplog.at_level(logging.INFO, logger="kvxfer.transport.mooncake"):
        a = MooncakeTransport()
    try:
        assert len(started) == mooncake_mod.PORT_ATTEMPTS
        assert a.endpoint == f"127.0.0.1:{started[-1].get_rpc_port()}"
        assert caplog.text.count("lost a port to another process") == mooncake_mod.PORT_ATTEMPTS - 1
        with MooncakeTransport() as b:
            roundtrip(a, b)
    finally:
        a.close()


def test_an_engine_that_keeps_losing_its_ports_is_refused_with_the_fix(monkeypatch):
    started = _losing_ports(monkeypatch, losses=mooncake_mod.PORT_ATTEMPTS)
    with pytest.raises(TransferError, match=r"Address already in use on each of 5 attempts"):
        MooncakeTransport()
    assert len(started) == mooncake_mod.PORT_ATTEMPTS


def test_any_other_failure_to_start_is_reported_at_once(monkeypatch):
    started = _losing_ports(monkeypatch, losses=1, error="open: Permission denied")
    with pytest.raises(TransferError, match=r"protocol='tcp'\) failed: open: Permission"):
        MooncakeTransport()
    assert len(started) == 1


def test_a_bad_host_is_refused_before_mooncake_starts():
    with pytest.raises(ValueError, match=r"host: 256\.1\.1\.1 is not a valid IPv4 address"):
        MooncakeTransport("256.1.1.1")


def test_mooncake_log_level_defaults_to_error_unless_set(monkeypatch):
    monkeypatch.delenv("MC_LOG_LEVEL", raising=False)
    mooncake_mod._engine_class()
    assert os.environ["MC_LOG_LEVEL"] == "ERROR"
    monkeypatch.setenv("MC_LOG_LEVEL", "INFO")
    mooncake_mod._engine_class()
    assert os.environ["MC_LOG_LEVEL"] == "INFO"


def test_the_tcp_slice_size_is_the_measured_default_unless_the_user_set_one(monkeypatch):
    monkeypatch.delenv("MC_TCP_SLICE_SIZE", raising=False)
    mooncake_mod._engine_class()
    assert os.environ["MC_TCP_SLICE_SIZE"] == str(mooncake_mod.TCP_SLICE_SIZE)
    monkeypatch.setenv("MC_TCP_SLICE_SIZE", "1048576")
    mooncake_mod._engine_class()
    assert os.environ["MC_TCP_SLICE_SIZE"] == "1048576"


def test_a_user_tcp_slice_size_reaches_mooncake_and_moves_bytes_exactly():
    """In a fresh process (Mooncake reads the variable once per process), a transfer with the
    user's slice size lands every byte, and kvxfer leaves the value as the user set it."""
    script = """
import os, numpy as np, torch
from kvxfer.plan import Segments
from kvxfer.transport import Peer
from kvxfer.transport.mooncake import MooncakeTransport
a, b = MooncakeTransport(), MooncakeTransport()
src = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)
dst = torch.zeros(3 << 20, dtype=torch.uint8)
ra, rb = a.register(src), b.register(dst)
one = np.ones(1, dtype=np.int64)
segments = Segments(one * ra.region_id, one * 0, one * rb.region_id, one * 0, one * (3 << 20))
b.read(segments, Peer(a.endpoint, {ra.region_id: ra})).result(30)
assert torch.equal(src, dst)
print(os.environ["MC_TCP_SLICE_SIZE"])
a.close()
b.close()
"""
    env = {**os.environ, "MC_TCP_SLICE_SIZE": "1048576", "MC_LOG_LEVEL": "ERROR"}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "1048576"


# --- Registration is all or nothing ------------------------------------------------------


def layer_tensors() -> list[torch.Tensor]:
    return [torch.zeros(64, 64, dtype=torch.float16) for _ in range(3)]


@pytest.mark.parametrize("bad", ["not_contiguous", "overlapping"])
def test_a_failed_registration_on_a_shared_transport_leaves_nothing(bad):
    caches = layer_tensors()
    if bad == "not_contiguous":
        failing = [caches[0], caches[1], caches[2].t()]  # fails in kvxfer's check
        error: type[Exception] = ValueError
    else:
        failing = [caches[0], caches[1], caches[0]]  # Mooncake refuses (-7): overlapping
        error = TransferError
    with MooncakeTransport() as shared:
        with pytest.raises(error):
            CacheRegistration(failing, shared, "127.0.0.1", "tcp")
        assert shared.regions == {}  # the first two were given back
        again = CacheRegistration(caches, shared, "127.0.0.1", "tcp")  # no -7 now
        assert len(again.regions) == 3 and len(shared.regions) == 3
        again.close()
        assert shared.regions == {}


def test_a_failed_registration_closes_the_transport_it_created(monkeypatch):
    created: list[MooncakeTransport] = []

    class Recorded(MooncakeTransport):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            created.append(self)

    monkeypatch.setattr(mooncake_mod, "MooncakeTransport", Recorded)  # the factory's class
    caches = layer_tensors()
    with pytest.raises(ValueError, match="must be contiguous"):
        CacheRegistration([caches[0], caches[1], caches[2].t()], None, "127.0.0.1", "tcp")
    (transport,) = created
    assert transport.regions == {} and transport._closed
    fresh = CacheRegistration(caches, None, "127.0.0.1", "tcp")
    assert len(fresh.regions) == 3
    fresh.close()
