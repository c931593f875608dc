"""Bad input to `reshard` and to the connectors' checks raises a ValueError that names the
problem and the fix."""

from __future__ import annotations

import numpy as np
import pytest

from kvxfer import reshard
from kvxfer.kernels.copy_cells import INTERPRETED
from kvxfer.testing import make_scenario, side_specs
from kvxfer.validation import (
    MAX_REQUEST_ID_BYTES,
    check_block_ids,
    check_host,
    check_num_tokens,
    check_request_id,
    check_side_channel_address,
    check_token_range,
    check_transport_endpoint,
)


def scenario(**dst_changes):
    src = side_specs(2, heads=4, block_size=8)
    dst = side_specs(4, heads=4, block_size=16, **dst_changes)
    return make_scenario(src, dst, 30)


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(head_dim=16), "head_dim differs"),
        (dict(num_layers=3), "num_layers differs"),
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


def _replaced(ids: np.ndarray, position: int, block: int) -> np.ndarray:
    ids = ids.copy()
    ids[position] = block
    return ids


@pytest.mark.parametrize(
    ("side", "rank", "edit", "message"),
    [
        pytest.param(
            "dst",
            1,
            lambda spec, ids: ids[:1],
            r"destination rank 1: too few block ids: 1 for 30",
            id="too-few",
        ),
        pytest.param(
            "src",
            0,
            lambda spec, ids: _replaced(ids, 2, spec.num_blocks),
            r"source rank 0: block id 64 \(position 2\) is out of",
            id="out-of-range",
        ),
        pytest.param(
            "dst",
            0,
            lambda spec, ids: _replaced(ids, 1, ids[0]),
            "appear more than once",
            id="duplicated",
        ),
    ],
)
def test_bad_block_ids_name_the_rank_and_the_problem(side, rank, edit, message):
    sc = scenario()
    ranks = sc.src if side == "src" else sc.dst
    spec, caches, ids = ranks[rank]
    ranks[rank] = (spec, caches, edit(spec, ids))
    with pytest.raises(ValueError, match=message):
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


# --- Checks the connectors call on their callers' input -------------------------------------


def test_num_tokens_must_be_at_least_one():
    with pytest.raises(ValueError, match=r"num_tokens: must be a positive integer, got 0;"):
        check_num_tokens(0)
    assert check_num_tokens(np.int64(5)) == 5 and type(check_num_tokens(np.int64(5))) is int


@pytest.mark.parametrize("value", [True, 3.0, "3", None])
def test_num_tokens_must_be_an_integer(value):
    with pytest.raises(ValueError, match=r"publish\('r'\): num_tokens: must be a positive integer"):
        check_num_tokens(value, "publish('r'): num_tokens")


def test_block_ids_refuse_zero_tokens_naming_the_call():
    spec = side_specs(1)[0]
    with pytest.raises(ValueError, match=r"publish\('r1'\): num_tokens: .* got 0; .* >= 1"):
        check_block_ids(spec, [0, 1], 0, "publish('r1')")


def test_token_range_returns_plain_ints():
    assert check_token_range(np.int32(30), np.int64(16)) == (30, 16)
    with pytest.raises(ValueError, match="start_token: must be an integer"):
        check_token_range(30, True)


@pytest.mark.parametrize("request_id", ["r1", "cmpl-9f1c-0", "x" * MAX_REQUEST_ID_BYTES])
def test_request_id_accepted(request_id):
    assert check_request_id(request_id, "publish") == request_id


@pytest.mark.parametrize(
    "request_id,message",
    [
        (7, r"publish: request_id must be a str, got 7 of type int; .* e\.g\. str\(7\)"),
        (b"r1", "request_id must be a str, got b'r1' of type bytes"),
        (None, "request_id must be a str, got None"),
        ("", "request_id is empty"),
        ("é" * 513, "request_id is 1026 bytes long, more than 1024; pass a shorter id"),
        ("\udc80", "not valid UTF-8"),
    ],
)
def test_request_id_refused(request_id, message):
    with pytest.raises(ValueError, match=message):
        check_request_id(request_id, "publish")


@pytest.mark.parametrize(
    "address",
    [
        "tcp://127.0.0.1:5700",
        "tcp://[::1]:5700",
        "tcp://localhost:1",
        "tcp://prefill-0.kv.svc.cluster.local:65535",
    ],
)
def test_side_channel_address_accepted(address):
    assert check_side_channel_address(address) == address


@pytest.mark.parametrize(
    "address,message",
    [
        ("127.0.0.1:5700", r"has no scheme; write tcp://127\.0\.0\.1:5700"),
        ("udp://127.0.0.1:5700", r"scheme 'udp://' .* not supported; .* write tcp://127\.0\.0\.1"),
        ("ipc:///tmp/kv", r"scheme 'ipc://' .* write tcp://HOST:PORT"),
        ("tcp://127.0.0.1:0", "port 0 is outside 1..65535"),
        ("tcp://127.0.0.1:65536", "port 65536 is outside 1..65535"),
        ("tcp://127.0.0.1:http", "port 'http' is not a number"),
        ("tcp://127.0.0.1", "has no port"),
        ("tcp://256.1.1.1:5700", "256.1.1.1 is not a valid IPv4 address"),
        ("tcp://::1:5700", r"IPv6 address without brackets \(write \[::1\]\)"),
        ("tcp://[::g]:5700", "not a valid IPv6 address"),
        ("tcp://bad_host:5700", "'bad_host' is not a valid hostname"),
        ("tcp://*:5700", r"bind address .* e\.g\. tcp://127\.0\.0\.1:5700"),
        ("", "is empty"),
        (" tcp://127.0.0.1:5700", "surrounding whitespace"),
        ("localhost", "not a side-channel address; write tcp://HOST:PORT"),
        (5700, "must be a str like 'tcp://127.0.0.1:5700', got 5700 of type int"),
    ],
)
def test_side_channel_address_refused(address, message):
    with pytest.raises(ValueError, match=rf"address: .*{message}"):
        check_side_channel_address(address)


@pytest.mark.parametrize("endpoint", ["127.0.0.1:15321", "[::1]:15321", "decode-3:1"])
def test_transport_endpoint_accepted(endpoint):
    assert check_transport_endpoint(endpoint) == endpoint


@pytest.mark.parametrize(
    "endpoint,message",
    [
        (
            "256.1.1.1:99999",
            "256.1.1.1 is not a valid IPv4 address and the port 99999 is outside 1..65535",
        ),
        ("127.0.0.1:0", "port 0 is outside"),
        ("127.0.0.1", "it is not HOST:PORT"),
        ("tcp://127.0.0.1:15321", r"has a scheme; .* e\.g\. 127\.0\.0\.1:15321"),
        (":15321", "the host is empty"),
        (15321, "must be a str"),
    ],
)
def test_transport_endpoint_refused(endpoint, message):
    with pytest.raises(ValueError, match=rf"endpoint: .*{message}"):
        check_transport_endpoint(endpoint)


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "[::1]", "decode-3.local"])
def test_host_accepted(host):
    assert check_host(host) == host


@pytest.mark.parametrize("host", ["", "256.0.0.1", "a b", None, "tcp://127.0.0.1"])
def test_host_refused(host):
    with pytest.raises(ValueError, match=r"host: .*(pass|must be a str)"):
        check_host(host)


def test_free_ports_are_bindable_below_the_ephemeral_range_and_never_handed_out_twice():
    import socket

    from kvxfer.addresses import PORTS, free_port, free_port_run

    singles = [free_port() for _ in range(20)]
    base = free_port_run(8)
    run = list(range(base, base + 8))
    assert len(set(singles + run)) == len(singles) + len(run)
    for port in singles + run:
        assert PORTS[0] <= port <= PORTS[1]
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", port))  # free now: raises if not
