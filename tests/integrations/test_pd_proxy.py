"""The P/D proxy over real HTTP on 127.0.0.1. `vllm serve` cannot run on these CPU machines (its
build needs CUDA, and there are no weights), so two small HTTP servers answer in the shape of
vLLM's OpenAI API and record what the proxy sent them."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from kvxfer.integrations.pd_proxy import decode_body, make_server, prefill_body
from kvxfer.testing import wait_until

# What a prefill DP rank hands back: the proxy forwards it unchanged (the DP rank included).
PARAMS = {
    "do_remote_prefill": True,
    "remote_engine_id": "prefill-0_dp1",
    "remote_dp_rank": 1,
    "remote_bootstrap_addr": "http://10.0.0.1:5690",
}


def _serving(server: Any) -> Any:
    """`server`, answering on a daemon thread."""
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _url(server: Any) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


class _Quiet(BaseHTTPRequestHandler):
    """A request handler that logs nothing and answers in one call."""

    def log_message(self, *args):
        pass

    def reply(self, status: int, payload: bytes, content_type: str | None = None) -> None:
        self.send_response(status)
        if content_type is not None:
            self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


def _engine(answer):
    """An HTTP server whose POST handler records the JSON body and answers with `answer`."""
    seen: list[dict] = []

    class Handler(_Quiet):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append({"path": self.path, **body})
            status, content_type, payload = answer(body)
            self.reply(status, payload, content_type)

    server = _serving(ThreadingHTTPServer(("127.0.0.1", 0), Handler))
    return server, seen


def _prefill_answer(body):
    return 200, "application/json", json.dumps({"kv_transfer_params": PARAMS}).encode()


def _decode_answer(body):
    if body.get("stream"):
        events = b"".join(f"data: {json.dumps({'i': i})}\n\n".encode() for i in range(3))
        return 200, "text/event-stream", events + b"data: [DONE]\n\n"
    return 200, "application/json", json.dumps({"choices": [{"text": "ok"}]}).encode()


@pytest.fixture()
def stack():
    prefill, prefill_seen = _engine(_prefill_answer)
    decode, decode_seen = _engine(_decode_answer)
    proxy = make_server("127.0.0.1", 0, [_url(prefill)], [_url(decode)], timeout=10)
    _serving(proxy)
    yield _url(proxy), prefill_seen, decode_seen
    for server in (proxy, prefill, decode):
        server.shutdown()
        server.server_close()


def _post(url, body):
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.status, response.headers["Content-Type"], response.read()


@pytest.mark.parametrize("stream", [False, True])
def test_prefill_then_decode_with_the_prefills_params(stack, stream):
    proxy, prefill_seen, decode_seen = stack
    body = {"model": "m", "prompt": "hello", "max_tokens": 50, "stream": stream}
    status, content_type, payload = _post(proxy + "/v1/completions", body)
    assert prefill_seen == [
        {
            "path": "/v1/completions",
            "model": "m",
            "prompt": "hello",
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": {"do_remote_decode": True},
        }
    ]
    assert decode_seen == [{"path": "/v1/completions", **body, "kv_transfer_params": PARAMS}]
    assert status == 200
    expected = _decode_answer(body)
    assert (content_type, payload) == (expected[1], expected[2])


def test_errors_name_the_cause(stack):
    proxy, _, _ = stack
    with pytest.raises(urllib.error.HTTPError) as info:
        _post(proxy + "/v1/embeddings", {"input": "x"})
    assert info.value.code == 404 and "/v1/completions" in info.value.read().decode()


def test_a_prefill_engine_without_the_connector_is_reported():
    with pytest.raises(ValueError, match="KvxferConnector"):
        decode_body({"prompt": "x"}, {"choices": []})
    chat = prefill_body({"messages": [], "max_completion_tokens": 9, "stream_options": {}})
    assert chat["max_completion_tokens"] == 1 and "stream_options" not in chat


def test_a_prefill_with_no_kv_to_hand_over_is_decoded_from_the_prompt():
    """kvxfer's prefill scheduler answers a request it has no KV for (aborted, nothing
    computed) with parameters that say so; the proxy forwards them, and the decode engine
    computes the prompt itself instead of the client getting a 502."""
    # What kvxfer.integrations.vllm.scheduler.nothing_to_load() returns (that module needs vLLM).
    nothing = {"do_remote_prefill": False, "do_remote_decode": False}
    prefill, _ = _engine(
        lambda body: (200, "application/json", json.dumps({"kv_transfer_params": nothing}).encode())
    )
    decode, decode_seen = _engine(_decode_answer)
    proxy = make_server("127.0.0.1", 0, [_url(prefill)], [_url(decode)], timeout=10)
    _serving(proxy)
    try:
        body = {"model": "m", "prompt": [5], "max_tokens": 8}
        status, _, payload = _post(_url(proxy) + "/v1/completions", body)
    finally:
        for server in (proxy, prefill, decode):
            server.shutdown()
            server.server_close()
    assert status == 200 and json.loads(payload)["choices"][0]["text"] == "ok"
    assert decode_seen == [{"path": "/v1/completions", **body, "kv_transfer_params": nothing}]


def test_the_concurrent_flow_sends_both_engines_the_request_at_once():
    """`--flow concurrent`: the engine id from the prefill's bootstrap service (kvxfer's own,
    over HTTP), one fresh `transfer_id` named to both engines, the decode request sent without
    waiting for the prefill's answer (here the prefill engine answers only once the decode
    request has arrived: a sequential proxy would wait forever)."""
    from kvxfer.integrations.bootstrap import BootstrapClient, BootstrapServer, new_worker_info

    decode_arrived = {f"p{i}": threading.Event() for i in range(2)}  # by prompt

    def prefill_answer(body):
        waited = decode_arrived[body["prompt"]].wait(10)
        assert waited, "the decode request waited for the prefill's answer"
        return _prefill_answer(body)

    def decode_answer(body):
        decode_arrived[body["prompt"]].set()
        return _decode_answer(body)

    prefill, prefill_seen = _engine(prefill_answer)
    decode, decode_seen = _engine(decode_answer)
    with BootstrapServer("127.0.0.1", 0) as bootstrap:
        BootstrapClient(bootstrap.address).register(
            new_worker_info("prefill-7_dp0", 0, 0, 0, "tcp://127.0.0.1:6000", 1)
        )
        port = int(bootstrap.address.rsplit(":", 1)[1])
        proxy = make_server(
            "127.0.0.1", 0, [_url(prefill)], [_url(decode)], 10, "concurrent", [port]
        )
        _serving(proxy)
        try:
            bodies = [{"model": "m", "prompt": f"p{i}", "max_tokens": 5} for i in range(2)]
            answers = [_post(_url(proxy) + "/v1/completions", b) for b in bodies]
            # the prefill requests run on the proxy's own threads
            wait_until(lambda: len(prefill_seen) >= 2, 30.0, "both prefill requests")
        finally:
            for server in (proxy, prefill, decode):
                server.shutdown()
                server.server_close()
    assert [a[0] for a in answers] == [200, 200]
    transfer_ids = []
    # The prefill requests run on the proxy's threads, so they may reach the engine in any order.
    prefill_by_prompt = {sent["prompt"]: sent for sent in prefill_seen}
    assert len(prefill_by_prompt) == 2
    for body, sent_decode in zip(bodies, decode_seen, strict=True):
        sent_prefill = prefill_by_prompt[body["prompt"]]
        transfer_id = sent_decode["kv_transfer_params"]["transfer_id"]
        transfer_ids.append(transfer_id)
        assert sent_decode == {
            "path": "/v1/completions",
            **body,
            "kv_transfer_params": {
                "do_remote_decode": False,
                "do_remote_prefill": True,
                "transfer_id": transfer_id,
                "remote_engine_id": "prefill-7_dp0",
                "remote_bootstrap_addr": f"http://127.0.0.1:{port}",
            },
        }
        assert sent_prefill["kv_transfer_params"] == {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "transfer_id": transfer_id,
        }
        assert sent_prefill["max_tokens"] == 1 and sent_prefill["prompt"] == body["prompt"]
    assert len(set(transfer_ids)) == 2  # one per request


def test_the_concurrent_flow_needs_each_prefills_bootstrap_port():
    with pytest.raises(ValueError, match="bootstrap port: --prefill URL PORT"):
        make_server("127.0.0.1", 0, ["http://127.0.0.1:1"], ["http://127.0.0.1:2"], 1, "concurrent")
    with pytest.raises(ValueError, match="flow: 'push' is not one of"):
        make_server("127.0.0.1", 0, ["http://127.0.0.1:1"], ["http://127.0.0.1:2"], 1, "push")


@pytest.mark.parametrize("answer", [b"[1, 2]", b'{"0": {}}', b"not json", b'{"x": {}}'])
def test_a_bootstrap_port_that_is_not_one_is_a_clear_502(answer):
    class Query(_Quiet):
        def do_GET(self):
            self.reply(200, answer)

    bogus = _serving(ThreadingHTTPServer(("127.0.0.1", 0), Query))
    decode, decode_seen = _engine(_decode_answer)
    proxy = make_server(
        "127.0.0.1", 0, [_url(bogus)], [_url(decode)], 10, "concurrent", [bogus.server_address[1]]
    )
    _serving(proxy)
    try:
        with pytest.raises(urllib.error.HTTPError) as info:
            _post(_url(proxy) + "/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 2})
        assert info.value.code == 502
        assert "/query did not answer" in json.loads(info.value.read())["error"]["message"]
        assert decode_seen == []
    finally:
        for server in (proxy, bogus, decode):
            server.shutdown()
            server.server_close()


def test_a_burst_of_clients_is_queued_while_the_proxy_is_not_accepting():
    """64 clients connect at once while the proxy's thread accepts none (a proxy not scheduled
    in time): the kernel completes every connection, for the proxy to accept later. With
    socketserver's backlog of 5, the rest waited for SYN retries or were reset (the e2e suite's
    16 requests in flight)."""
    import socket

    proxy = make_server("127.0.0.1", 0, ["http://127.0.0.1:1"], ["http://127.0.0.1:2"], 1)
    clients = []
    try:
        for _ in range(64):
            client = socket.create_connection(proxy.server_address, timeout=30)
            clients.append(client)
        assert len(clients) == 64
    finally:
        for client in clients:
            client.close()
        proxy.server_close()
