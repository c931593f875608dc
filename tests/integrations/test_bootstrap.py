"""The bootstrap service (kvxfer.integrations.bootstrap) over real HTTP on 127.0.0.1: prefill
workers register their side channels by (engine, DP rank, TP rank, PP rank), decode workers
look them up; restarts replace entries, entries expire, bad requests get clear errors."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest

from kvxfer.addresses import free_port
from kvxfer.integrations.bootstrap import (
    PROOF_HEADER,
    BootstrapClient,
    BootstrapError,
    BootstrapServer,
    BootstrapUnavailable,
    EngineWorkers,
    Registration,
    WorkerInfo,
    bootstrap_url,
    check_worker_info,
    complete_workers,
    new_worker_info,
)


def _worker(engine="prefill_dp0", dp=0, tp=0, pp=0, port=None, tp_size=2, ttl_s=30.0):
    port = port if port is not None else 6000 + 100 * dp + 10 * pp + tp
    return new_worker_info(
        engine, dp, tp, pp, f"tcp://127.0.0.1:{port}", tp_size, ttl_s=ttl_s, geometry={"heads": 3}
    )


@pytest.fixture()
def server():
    with BootstrapServer("127.0.0.1", 0) as service:
        yield service


@pytest.fixture()
def client(server):
    return BootstrapClient(server.address, timeout_s=5)


def _raw(server, method, path, body=None, headers=None):
    """(status, JSON answer) of one request sent as is."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        server.address + path, data, {"Content-Type": "application/json", **(headers or {})}
    )
    request.method = method
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_register_and_query_by_engine_and_dp_rank(server, client):
    workers = [
        _worker("prefill_dp0", 0, 1),
        _worker("prefill_dp0", 0, 0),
        _worker("prefill_dp1", 1, 0),
        _worker("prefill_dp1", 1, 1),
    ]
    assert [client.register(w) for w in workers] == ["registered"] * 4
    found = client.workers("prefill_dp0", 0)
    assert found.engine_id == "prefill_dp0" and found.dp_rank == 0
    assert [w.tp_rank for w in found.workers] == [0, 1]  # in rank order
    assert found.workers[0] == workers[1]  # every field round-trips, geometry included
    assert found.workers[0].geometry == {"heads": 3}
    assert [w.address for w in client.lookup("prefill_dp1", 1, timeout_s=1)] == [
        "tcp://127.0.0.1:6100",
        "tcp://127.0.0.1:6101",
    ]
    assert client.engines() == {"prefill_dp0": [0], "prefill_dp1": [1]}
    assert client.health() == {"status": "ok", "workers": 4}
    # Another DP rank of the same engine id is not mixed in.
    with pytest.raises(BootstrapError, match=r"'prefill_dp0' DP rank 1 has no registered"):
        client.workers("prefill_dp0", 1)
    assert len(client.workers("prefill_dp0").workers) == 2  # every DP rank


def test_lookup_returns_every_pipeline_stage_pp_major(server, client):
    """A decode worker connects to every worker of a pipeline-parallel DP rank, whatever
    stage holds its layers: the look-up waits for all of them and lists them pp-major."""
    stages = [
        new_worker_info("prefill", 0, tp, pp, f"tcp://127.0.0.1:{6200 + 2 * pp + tp}", 2, 2)
        for pp, tp in [(1, 1), (0, 1), (1, 0), (0, 0)]
    ]
    for info in stages[:3]:
        client.register(info)
    with pytest.raises(LookupError, match=r"3 of 4 workers registered; missing TP 0 PP 0"):
        client.lookup("prefill", 0, timeout_s=0.2)
    client.register(stages[3])
    found = client.lookup("prefill", 0, timeout_s=1)
    assert [(w.pp_rank, w.tp_rank) for w in found] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [w.address for w in found] == [f"tcp://127.0.0.1:{6200 + r}" for r in range(4)]


def test_query_answers_vllm_mooncake_bootstrap_contract(server, client):
    """`GET /query` answers what vLLM's MooncakeConnector bootstrap serves and what
    `vllm-router --kv-connector mooncake` reads: by DP rank, the engine id and every worker's
    address by TP rank, then PP rank (JSON object keys are strings)."""
    status, answer = _raw(server, "GET", "/query")
    assert status == 200 and answer == {}
    for info in [
        _worker("prefill_dp0", 0, 1),
        _worker("prefill_dp0", 0, 0),
        new_worker_info("prefill_dp1", 1, 0, 1, "tcp://127.0.0.1:6110", 1, 2),
        new_worker_info("prefill_dp1", 1, 0, 0, "tcp://127.0.0.1:6100", 1, 2),
    ]:
        client.register(info)
    status, answer = _raw(server, "GET", "/query")
    assert status == 200
    assert answer == {
        "0": {
            "engine_id": "prefill_dp0",
            "worker_addr": {"0": {"0": "tcp://127.0.0.1:6000"}, "1": {"0": "tcp://127.0.0.1:6001"}},
        },
        "1": {
            "engine_id": "prefill_dp1",
            "worker_addr": {"0": {"0": "tcp://127.0.0.1:6100", "1": "tcp://127.0.0.1:6110"}},
        },
    }
    # Workers of one engine id under no DP rank filter: one DP rank, found by its engine id
    # alone, as a decode engine driven by vllm-router knows it (no remote_dp_rank).
    assert [w.address for w in client.lookup("prefill_dp0", None, timeout_s=1)] == [
        "tcp://127.0.0.1:6000",
        "tcp://127.0.0.1:6001",
    ]


def test_query_refuses_two_engines_on_one_dp_rank(server, client):
    client.register(_worker("prefill-a", 0, 0, tp_size=1))
    client.register(_worker("prefill-b", 0, 0, port=7000, tp_size=1))
    status, answer = _raw(server, "GET", "/query")
    assert status == 409
    assert "DP rank 0 is registered by engines ['prefill-a', 'prefill-b']" in answer["error"]
    assert "one bootstrap service per prefill engine" in answer["error"]


def test_lookup_without_dp_rank_refuses_an_engine_id_on_several_dp_ranks(server, client):
    client.register(_worker("shared", 0, 0, tp_size=1))
    client.register(_worker("shared", 1, 0, tp_size=1))
    with pytest.raises(LookupError, match=r"DP ranks \[0, 1\].*remote_dp_rank"):
        client.lookup("shared", None, timeout_s=0.2)


def test_renewal_and_restart_replace_the_entry(server, client):
    first = _worker(tp=0, port=7000)
    assert client.register(first) == "registered"
    assert client.register(first) == "renewed"
    # The worker restarts on another port: a new generation replaces the entry.
    restarted = _worker(tp=0, port=7005)
    assert restarted.generation != first.generation
    assert restarted.started_at >= first.started_at
    assert client.register(restarted) == "replaced"
    (entry,) = client.workers("prefill_dp0", 0).workers
    assert (entry.address, entry.generation) == ("tcp://127.0.0.1:7005", restarted.generation)
    # The old incarnation's late renewal is refused, and its unregister removes nothing.
    with pytest.raises(BootstrapError, match="superseded") as refused:
        client.register(first)
    assert refused.value.status == 409
    assert client.unregister(first) is False
    assert client.workers("prefill_dp0", 0).workers == [restarted]
    assert client.unregister(restarted) is True
    assert client.health()["workers"] == 0


def test_entries_expire_without_renewal():
    now = [100.0]
    with BootstrapServer("127.0.0.1", 0, clock=lambda: now[0]) as server:
        client = BootstrapClient(server.address)
        client.register(_worker(tp=0, ttl_s=5))
        client.register(_worker(tp=1, ttl_s=20))
        now[0] += 4.9
        assert len(client.workers("prefill_dp0", 0).workers) == 2
        now[0] += 0.2  # rank 0 was not renewed for 5.1 s
        assert [w.tp_rank for w in client.workers("prefill_dp0", 0).workers] == [1]
        with pytest.raises(LookupError, match=r"1 of 2 workers registered; missing TP 0 PP 0"):
            client.lookup("prefill_dp0", 0, timeout_s=0.2)
        client.register(_worker(tp=0, ttl_s=5))  # a renewal brings it back
        assert len(client.lookup("prefill_dp0", 0, timeout_s=0.2)) == 2
        now[0] += 21
        assert client.health()["workers"] == 0


def test_registration_waits_for_the_service_renews_and_unregisters():
    port = free_port()
    info = _worker(tp=0, ttl_s=0.6)  # renewed every 0.2 s
    registration = Registration(BootstrapClient(f"127.0.0.1:{port}", timeout_s=1), info).start()
    try:
        time.sleep(0.3)  # the worker comes up before the service (as vLLM starts them)
        assert not registration.registered.is_set()
        with BootstrapServer("127.0.0.1", port) as server:
            assert registration.registered.wait(5), "it did not register once the service came"
            client = BootstrapClient(server.address)
            time.sleep(1.0)  # longer than the TTL: renewals keep the entry
            assert client.workers("prefill_dp0", 0).workers == [info]
        # The service restarts (its registry is empty): the next renewal registers again.
        with BootstrapServer("127.0.0.1", port) as server:
            deadline = time.monotonic() + 5
            while client.health()["workers"] == 0:
                assert time.monotonic() < deadline, "the worker did not register again"
                time.sleep(0.05)
            registration.stop(timeout=5)  # a worker's shutdown: it unregisters
            assert registration._thread is not None and not registration._thread.is_alive()
            assert client.health()["workers"] == 0
    finally:
        registration.stop()


def test_lookup_waits_for_ranks_that_register_late(server, client):
    client.register(_worker(tp=1))
    late = threading.Timer(0.3, client.register, args=(_worker(tp=0),))
    late.start()
    began = time.monotonic()
    found = client.lookup("prefill_dp0", 0, timeout_s=5)
    assert [w.tp_rank for w in found] == [0, 1] and time.monotonic() - began >= 0.25
    late.join()
    with pytest.raises(LookupError) as missing:
        client.lookup("nobody", 3, timeout_s=0.2)
    message = str(missing.value)
    assert "'nobody' DP rank 3" in message and server.address in message


def test_unreachable_service_is_a_clear_error():
    client = BootstrapClient(f"127.0.0.1:{free_port()}", timeout_s=1)
    with pytest.raises(BootstrapUnavailable, match=r"did not answer GET /v1/health"):
        client.health()
    with pytest.raises(LookupError, match=r"not found through the bootstrap service"):
        client.lookup("prefill", 0, timeout_s=0.2)


def test_a_service_that_accepted_is_waited_for_longer_than_one_that_refuses():
    """`connect_timeout_s` bounds reaching the service; one that accepted the connection (its
    process not run yet) may take `timeout_s` to answer; a port where nothing listens fails
    at once."""
    import socket

    with socket.socket() as starved:  # the kernel accepts into the backlog; nobody answers
        starved.bind(("127.0.0.1", 0))
        starved.listen(8)
        client = BootstrapClient(
            f"127.0.0.1:{starved.getsockname()[1]}", timeout_s=1.5, connect_timeout_s=0.2
        )
        began = time.monotonic()
        with pytest.raises(BootstrapUnavailable, match="did not answer GET /v1/health"):
            client.health()
        assert time.monotonic() - began >= 1.5
    refused = BootstrapClient(f"127.0.0.1:{free_port()}", timeout_s=600, connect_timeout_s=600)
    began = time.monotonic()
    with pytest.raises(BootstrapUnavailable, match="did not answer GET /v1/health"):
        refused.health()
    assert time.monotonic() - began < 300  # at once: far from its timeouts


def test_concurrent_registrations(server, client):
    tp_size, dp_size = 8, 4
    workers = [
        _worker(f"engine_dp{dp}", dp, tp, port=20000 + 100 * dp + tp, tp_size=tp_size)
        for dp in range(dp_size)
        for tp in range(tp_size)
    ]

    def register_twice(info: WorkerInfo) -> list[str]:
        return [BootstrapClient(server.address).register(info) for _ in range(2)]

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(register_twice, workers))
    assert answers == [["registered", "renewed"]] * len(workers)
    for dp in range(dp_size):
        found = client.lookup(f"engine_dp{dp}", dp, timeout_s=1)
        assert [w.address for w in found] == [
            f"tcp://127.0.0.1:{20000 + 100 * dp + tp}" for tp in range(tp_size)
        ]
    assert client.health()["workers"] == tp_size * dp_size


def _with(**fields):
    return lambda base: {**base, **fields}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        pytest.param(b"{not json", "not JSON", id="not-json"),
        pytest.param(lambda _: {"engine_id": "e"}, "missing required field", id="missing-fields"),
        pytest.param(
            _with(tp_rank="0"), r"Expected `int`, got `str` - at `\$.tp_rank`", id="rank-as-str"
        ),
        pytest.param(_with(dp_rank=-1), r"Expected `int` >= 0 - at `\$.dp_rank`", id="dp-rank-<0"),
        pytest.param(_with(tp_rank=2), "tp_rank 2 is not below tp_size 2", id="tp-rank-too-big"),
        pytest.param(_with(pp_rank=1), "pp_rank 1 is not below pp_size 1", id="pp-rank-too-big"),
        pytest.param(
            _with(address="127.0.0.1:6000"),
            "has no scheme; write tcp://127.0.0.1:6000",
            id="address-without-scheme",
        ),
        pytest.param(
            _with(engine_id="has space"), "printable ASCII without spaces", id="engine-id-space"
        ),
        pytest.param(_with(ttl_s=0), r"Expected `float` > 0.0", id="zero-ttl"),
        pytest.param(_with(color="red"), "Object contains unknown field `color`", id="unknown"),
    ],
)
def test_bad_registrations_get_400_naming_the_field(server, body, message):
    payload = body if isinstance(body, bytes) else body(msgspec.to_builtins(_worker()))
    status, answer = _raw(server, "POST", "/v1/register", payload)
    assert status == 400
    assert set(answer) == {"error"}
    assert re.search(message, answer["error"]), answer["error"]
    assert _raw(server, "GET", "/v1/health")[1]["workers"] == 0  # nothing was stored


def test_routes_methods_sizes_and_queries_get_json_errors(server):
    status, answer = _raw(server, "GET", "/v1/nowhere")
    assert status == 404 and "the service answers /v1/register" in answer["error"]
    status, answer = _raw(server, "GET", "/v1/register")
    assert status == 405 and "GET is not allowed on /v1/register" in answer["error"]
    status, answer = _raw(server, "POST", "/v1/register", b"x" * (70 << 10))
    assert status == 413 and "larger than" in answer["error"]
    status, answer = _raw(server, "GET", "/v1/engines/e?dp_rank=one")
    assert status == 400 and "dp_rank='one': expected a non-negative integer" in answer["error"]
    status, answer = _raw(server, "POST", "/v1/unregister", {"engine_id": "e"})
    assert status == 400 and "missing required field" in answer["error"]


def test_a_secret_guards_writes_not_reads():
    with BootstrapServer("127.0.0.1", 0, secret="s3cret") as server:
        signed = BootstrapClient(server.address, secret="s3cret")
        info = _worker()
        assert signed.register(info) == "registered"
        for client in (
            BootstrapClient(server.address),
            BootstrapClient(server.address, secret="x"),
        ):
            with pytest.raises(BootstrapError, match="not signed with this service's secret") as e:
                client.register(_worker(tp=1))
            assert e.value.status == 403
            with pytest.raises(BootstrapError, match="not signed"):
                client.unregister(info)
        # A proof of another body does not carry over.
        body = msgspec.json.encode(_worker(tp=1))
        proof = {PROOF_HEADER: "0" * 64}
        assert _raw(server, "POST", "/v1/register", body, proof)[0] == 403
        # Anyone may read.
        assert BootstrapClient(server.address).workers("prefill_dp0", 0).workers == [info]


def _pinned_proof(secret: str, path: str, body: bytes) -> str:
    """The proof a write carries, built by hand: HMAC-SHA256 under the secret over "bootstrap",
    then the path and the body, each after its length (4 bytes, big-endian). Pinned here, so
    that workers and services of different kvxfer versions keep understanding each other."""
    mac = hmac.new(secret.encode(), b"bootstrap", hashlib.sha256)
    for part in (path.encode(), body):
        mac.update(len(part).to_bytes(4, "big"))
        mac.update(part)
    return mac.hexdigest()


def test_writes_are_signed_with_kvxfers_own_proof():
    """The service checks, and the client sends, `kvxfer.session.auth.proof` of the secret
    bound to "bootstrap", the path and the body: the wire format as it always was."""
    from kvxfer.session import auth

    body = msgspec.json.encode(_worker(tp=1))
    for secret, path in (("s3cret", "/v1/register"), ("ü", "/v1/unregister")):
        pinned = _pinned_proof(secret, path, body)
        assert auth.proof(secret, "bootstrap", path, body) == pinned
    with BootstrapServer("127.0.0.1", 0, secret="s3cret") as server:
        by_hand = {PROOF_HEADER: _pinned_proof("s3cret", "/v1/register", body)}
        assert _raw(server, "POST", "/v1/register", body, by_hand) == (
            200,
            {"status": "registered", "worker": "engine 'prefill_dp0' DP 0 TP 1 PP 0"},
        )
        # Bound to the path: the same proof does not unregister.
        assert _raw(server, "POST", "/v1/unregister", body, by_hand)[0] == 403
        # A header that is no hex digest at all is refused like any wrong proof.
        assert _raw(server, "POST", "/v1/register", body, {PROOF_HEADER: "zz"})[0] == 403


def _python(code_or_args: list[str], **kwargs):
    env = {**os.environ, "PYTHONWARNINGS": "error::RuntimeWarning"}
    return subprocess.run(
        [sys.executable, *code_or_args], capture_output=True, text=True, env=env, **kwargs
    )


def test_the_package_imports_neither_torch_nor_zeromq():
    """A standalone service (`pip install 'kvxfer[bootstrap]'`) stays light: its package, and
    every module of it, imports no torch, ZeroMQ or serving engine."""
    code = (
        "import sys, kvxfer.integrations.bootstrap as b, kvxfer.integrations.bootstrap.__main__\n"
        "heavy = sorted(m for m in ('torch', 'zmq', 'vllm') if m in sys.modules)\n"
        "print(heavy, callable(b.main))"
    )
    out = _python(["-c", code], timeout=60, check=True)
    assert out.stdout.split() == ["[]", "True"], out.stdout


def test_python_dash_m_serves_until_interrupted():
    port = free_port()
    service = subprocess.Popen(
        [sys.executable, "-m", "kvxfer.integrations.bootstrap", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "error::RuntimeWarning"},
    )
    try:
        assert service.stdout is not None
        line = service.stdout.readline()  # printed once the service answers
        assert line.strip() == f"kvxfer bootstrap service on http://127.0.0.1:{port}", (
            line + service.stderr.read() if service.poll() is not None else line
        )
        assert BootstrapClient(f"127.0.0.1:{port}").health() == {"status": "ok", "workers": 0}
    finally:
        service.terminate()
        service.wait(10)
    out = _python(["-m", "kvxfer.integrations.bootstrap", "--help"], timeout=60, check=True)
    assert out.stdout.startswith("usage: python -m kvxfer.integrations.bootstrap [-h]"), out.stdout
    assert "The bootstrap service: where a prefill engine's workers say" in out.stdout


def test_a_taken_port_names_the_setting():
    taken = r"bootstrap service on 127.0.0.1:\d+.*bootstrap_port"
    with BootstrapServer("127.0.0.1", 0) as first, pytest.raises(OSError, match=taken):
        BootstrapServer("127.0.0.1", first.port).start()


def test_complete_workers_names_what_is_missing():
    def engine(*workers):
        return EngineWorkers(engine_id="e", dp_rank=0, workers=list(workers))

    with pytest.raises(LookupError, match="no worker is registered"):
        complete_workers(engine())
    with pytest.raises(LookupError, match=r"2 of 4 workers registered; missing TP 1 PP 0, TP 2"):
        complete_workers(engine(_worker("e", tp=0, tp_size=4), _worker("e", tp=3, tp_size=4)))
    with pytest.raises(LookupError, match=r"disagree on \(tp_size, pp_size\)"):
        complete_workers(engine(_worker("e", tp=0, tp_size=2), _worker("e", tp=1, tp_size=4)))
    pp = [
        new_worker_info("e", 0, tp, p, f"tcp://h:{7000 + 2 * p + tp}", 2, 2)
        for p in (1, 0)
        for tp in (1, 0)
    ]
    assert [(w.pp_rank, w.tp_rank) for w in complete_workers(engine(*pp))] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    ]


@pytest.mark.parametrize(
    ("address", "url"),
    [
        ("10.0.0.1:5690", "http://10.0.0.1:5690"),
        ("http://10.0.0.1:5690/", "http://10.0.0.1:5690"),
        ("[::1]:5690", "http://[::1]:5690"),
        ("prefill-a.local:80", "http://prefill-a.local:80"),
    ],
)
def test_bootstrap_addresses_are_normalized(address, url):
    assert bootstrap_url(address) == url


@pytest.mark.parametrize(
    ("address", "message"),
    [
        ("10.0.0.1", "has no port"),
        ("https://10.0.0.1:5690", "scheme 'https' is not supported"),
        ("10.0.0.1:0", r"port must be in 1..65535"),
        ("10.0.0.1:http", r"port must be in 1..65535"),
        ("::1:5690", "IPv6 address in brackets"),
        ("bad_host:5690", "not a valid hostname"),
        (5690, "is not an address"),
    ],
)
def test_bad_bootstrap_addresses_say_the_accepted_form(address, message):
    with pytest.raises(ValueError, match=message):
        bootstrap_url(address, "where")


def test_worker_info_checks_in_python_as_on_the_wire():
    with pytest.raises(ValueError, match="tp_rank 3 is not below tp_size 2"):
        _worker(tp=3)
    with pytest.raises(ValueError, match=r"Expected `int` >= 1"):
        new_worker_info("e", 0, 0, 0, "tcp://h:1", 0)
    info = _worker()
    assert check_worker_info(msgspec.json.encode(info)) == info
    assert info.key.engine_id == "prefill_dp0" and info.key.tp_rank == 0
