"""A minimal P/D proxy for vLLM's OpenAI-compatible API: prefill on one engine, decode on another.

For each `POST /v1/completions` or `/v1/chat/completions`, in the sequential flow (the default)
it
1. sends the request to a prefill engine with `max_tokens = 1`, no streaming, and
   `kv_transfer_params = {"do_remote_decode": true}`;
2. takes the `kv_transfer_params` of that response (kvxfer's connector fills in where the KV
   lies) and sends the original request, with those parameters, to a decode engine;
3. relays the decode engine's response (streamed or not) to the client.

In the concurrent flow (`--flow concurrent`, vLLM MooncakeConnector's convention, as
`vllm-router --kv-connector mooncake` speaks it) it mints a `transfer_id` and sends both at
once: the prefill request with `{"do_remote_decode": true, "transfer_id": ...}`, the decode
request with `{"do_remote_prefill": true, "transfer_id": ..., "remote_engine_id": ...,
"remote_bootstrap_addr": ...}`, the engine id read from the prefill's bootstrap service
(`GET /query`, one entry per DP rank, taken round-robin). The decode engine's fetch starts while
the prefill computes: the transfer begins the moment the prefill engine offers the KV, with no
hop through the proxy in between.

Engines are picked round-robin. Standard library only, so it runs wherever kvxfer does::

    python -m kvxfer.integrations.pd_proxy --port 8000 \\
        --prefill http://10.0.0.1:8100 --decode http://10.0.0.2:8200
    python -m kvxfer.integrations.pd_proxy --port 8000 --flow concurrent \\
        --prefill http://10.0.0.1:8100 5690 --decode http://10.0.0.2:8200

It carries no retries, authentication or load balancing by queue length: a starting point for
a production router, which should keep steps 1 and 2 as they are.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Generic, TypeVar

ROUTES = ("/v1/completions", "/v1/chat/completions")
FLOWS = ("sequential", "concurrent")
_CHUNK = 64 << 10
_QUERY_TTL_S = 5.0  # how long a bootstrap service's /query answer is reused

log = logging.getLogger(__name__)
T = TypeVar("T")


def prefill_body(body: dict[str, Any], transfer_id: str | None = None) -> dict[str, Any]:
    """The request for the prefill engine: one token, no stream, KV kept for a decoder (under
    `transfer_id` in the concurrent flow)."""
    params: dict[str, Any] = {"do_remote_decode": True}
    if transfer_id is not None:
        params.update(do_remote_prefill=False, transfer_id=transfer_id)
    prefill = dict(body)
    prefill.update(max_tokens=1, stream=False, kv_transfer_params=params)
    prefill.pop("stream_options", None)
    if "max_completion_tokens" in prefill:
        prefill["max_completion_tokens"] = 1
    return prefill


def decode_body(body: dict[str, Any], prefill_response: dict[str, Any]) -> dict[str, Any]:
    """The request for the decode engine: the client's, with the prefill's transfer params.

    Raises:
        ValueError: the prefill engine returned no `kv_transfer_params` (it does not run a KV
            connector in the producer role).
    """
    params = prefill_response.get("kv_transfer_params")
    if not params:
        raise ValueError(
            "the prefill engine's response has no kv_transfer_params; start it with "
            '--kv-transfer-config \'{"kv_connector": "KvxferConnector", "kv_role": '
            '"kv_producer", ...}\''
        )
    decode = dict(body)
    decode["kv_transfer_params"] = params
    return decode


def concurrent_decode_body(
    body: dict[str, Any], transfer_id: str, engine_id: str, bootstrap_addr: str
) -> dict[str, Any]:
    """The request for the decode engine in the concurrent flow: the client's, with where the
    prefill engine will offer the KV (its engine id, its bootstrap service, the transfer id)."""
    decode = dict(body)
    decode["kv_transfer_params"] = {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "transfer_id": transfer_id,
        "remote_engine_id": engine_id,
        "remote_bootstrap_addr": bootstrap_addr,
    }
    return decode


class PrefillEngine:
    """A prefill engine's URL and, for the concurrent flow, its bootstrap service, whose
    `/query` names the engine id of each of its DP ranks (taken round-robin)."""

    def __init__(self, url: str, bootstrap_port: int | None = None) -> None:
        self.url = url.rstrip("/")
        host = urllib.parse.urlsplit(self.url).hostname or "127.0.0.1"
        host = f"[{host}]" if ":" in host else host
        self.bootstrap = None if bootstrap_port is None else f"http://{host}:{bootstrap_port}"
        self._lock = threading.Lock()
        self._engine_ids: list[str] = []
        self._read_at = -_QUERY_TTL_S
        self._turn = itertools.count()

    def engine_id(self, timeout: float) -> str:
        """The engine id of the next DP rank, from the bootstrap service's `/query`.

        Raises:
            ValueError: no bootstrap port was given, or the service lists no engine.
            OSError: the service cannot be reached.
        """
        if self.bootstrap is None:
            raise ValueError(
                f"the concurrent flow needs {self.url}'s bootstrap port: --prefill URL PORT"
            )
        with self._lock:
            if time.monotonic() - self._read_at > _QUERY_TTL_S:
                with urllib.request.urlopen(self.bootstrap + "/query", timeout=timeout) as answer:
                    self._engine_ids = _engine_ids(answer.read(), self.bootstrap)
                self._read_at = time.monotonic()
            if not self._engine_ids:
                raise ValueError(f"{self.bootstrap}/query lists no prefill worker yet")
            return self._engine_ids[next(self._turn) % len(self._engine_ids)]


def _engine_ids(answer: bytes, bootstrap: str) -> list[str]:
    """The engine id of each DP rank, in rank order, from a `/query` answer.

    Raises:
        ValueError: the answer is not `{dp_rank: {"engine_id": ...}}`, naming the service.
    """
    try:
        ranks = json.loads(answer)
        return [str(ranks[k]["engine_id"]) for k in sorted(ranks, key=int)]
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ValueError(
            f'{bootstrap}/query did not answer {{dp_rank: {{"engine_id": ...}}}} '
            f"({type(exc).__name__}: {exc}); give --prefill a kvxfer or vLLM Mooncake "
            "bootstrap port"
        ) from None


class _RoundRobin(Generic[T]):
    """Engines taken in turn, from any thread."""

    def __init__(self, engines: Sequence[T]) -> None:
        if not engines:
            raise ValueError("at least one engine URL is needed")
        self._cycle = itertools.cycle(engines)
        self._lock = threading.Lock()

    def next(self) -> T:
        with self._lock:
            return next(self._cycle)


class ProxyServer(ThreadingHTTPServer):
    """The proxy's HTTP server: a thread per connection, and a listen backlog for a burst of
    clients. socketserver's default backlog is 5: 16 clients connecting at once to a proxy
    whose thread was not scheduled in time had connections reset (the e2e suite's 16 requests
    in flight, with SYN cookies on, as Linux has by default)."""

    request_queue_size = 1024


def make_server(
    host: str,
    port: int,
    prefill_urls: Sequence[str],
    decode_urls: Sequence[str],
    timeout: float,
    flow: str = "sequential",
    bootstrap_ports: Sequence[int | None] = (),
) -> ProxyServer:
    """An HTTP server that routes as the module says (call `serve_forever` on it).
    `bootstrap_ports`: each prefill engine's bootstrap port, in `prefill_urls`' order (the
    concurrent flow needs them).

    Raises:
        ValueError: an unknown flow, or the concurrent flow without a prefill's bootstrap port.
    """
    if flow not in FLOWS:
        raise ValueError(f"flow: {flow!r} is not one of {list(FLOWS)}")
    ports = list(bootstrap_ports) + [None] * (len(prefill_urls) - len(bootstrap_ports))
    engines = [PrefillEngine(u, p) for u, p in zip(prefill_urls, ports, strict=True)]
    if flow == "concurrent" and any(e.bootstrap is None for e in engines):
        raise ValueError(
            "the concurrent flow needs every prefill engine's bootstrap port: --prefill URL PORT"
        )
    prefills = _RoundRobin(engines)
    decodes = _RoundRobin([u.rstrip("/") for u in decode_urls])

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # the relayed body ends when the connection closes

        def do_POST(self) -> None:
            if self.path not in ROUTES:
                self._error(404, f"unknown route {self.path}; the proxy serves {list(ROUTES)}")
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            except (ValueError, TypeError) as exc:
                self._error(400, f"request body is not JSON: {exc}")
                return
            prefill = prefills.next()
            try:
                if flow == "concurrent":
                    forward = self._start_concurrent(prefill, body)
                else:
                    prefilled = _post_json(prefill.url + self.path, prefill_body(body), timeout)
                    forward = decode_body(body, prefilled)
            except (urllib.error.URLError, ValueError, OSError) as exc:
                self._error(502, f"prefill failed: {exc}")
                return
            try:
                response = _post(decodes.next() + self.path, forward, timeout)
            except (urllib.error.URLError, OSError) as exc:
                self._error(502, f"decode failed: {exc}")
                return
            with response:
                self.send_response(response.status)
                self.send_header("Content-Type", response.headers.get("Content-Type", ""))
                self.end_headers()
                for chunk in _chunks(response):
                    self.wfile.write(chunk)
                    self.wfile.flush()

        def _start_concurrent(self, prefill: PrefillEngine, body: dict[str, Any]) -> dict:
            """Send the prefill request on a thread of its own; the decode request to send
            now. A prefill that fails leaves the decode's load to fail: the decode engine
            then computes the prompt itself (its `kv_load_failure_policy`)."""
            transfer_id = f"kvxfer-{uuid.uuid4().hex}"
            engine_id = prefill.engine_id(timeout)
            assert prefill.bootstrap is not None
            url, prefill_request = prefill.url + self.path, prefill_body(body, transfer_id)

            def run_prefill() -> None:
                try:
                    _post_json(url, prefill_request, timeout)
                except (urllib.error.URLError, ValueError, OSError) as exc:
                    log.warning("prefill of %s at %s failed: %s", transfer_id, url, exc)

            threading.Thread(target=run_prefill, name="pd-proxy-prefill", daemon=True).start()
            return concurrent_decode_body(body, transfer_id, engine_id, prefill.bootstrap)

        def _error(self, status: int, message: str) -> None:
            payload = json.dumps({"error": {"message": message, "code": status}}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return ProxyServer((host, port), Handler)


def _post(url: str, body: dict[str, Any], timeout: float) -> Any:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    return urllib.request.urlopen(request, timeout=timeout)


def _post_json(url: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    with _post(url, body, timeout) as response:
        result: dict[str, Any] = json.loads(response.read())
        return result


def _chunks(response: Any) -> Iterator[bytes]:
    while chunk := response.read1(_CHUNK) if hasattr(response, "read1") else response.read():
        yield chunk


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: `python -m kvxfer.integrations.pd_proxy --prefill URL --decode URL`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--prefill",
        action="append",
        nargs="+",
        required=True,
        metavar=("URL", "BOOTSTRAP_PORT"),
        help="prefill engine URL, and its bootstrap port (the concurrent flow needs it)",
    )
    parser.add_argument("--decode", action="append", required=True, help="decode engine URL")
    parser.add_argument("--timeout", type=float, default=600.0, help="per engine call, seconds")
    parser.add_argument(
        "--flow", choices=FLOWS, default="sequential", help="sequential (default) or concurrent"
    )
    args = parser.parse_args(argv)
    urls, ports = [], []
    for given in args.prefill:
        if len(given) > 2 or (len(given) == 2 and not given[1].isdigit()):
            parser.error(f"--prefill {' '.join(given)}: give URL, then an optional port number")
        urls.append(given[0])
        ports.append(int(given[1]) if len(given) == 2 else None)
    try:
        server = make_server(
            args.host, args.port, urls, args.decode, args.timeout, args.flow, ports
        )
    except ValueError as exc:
        parser.error(str(exc))
    print(
        f"P/D proxy ({args.flow} flow) on http://{args.host}:{args.port}: prefill {urls}, "
        f"decode {args.decode}"
    )
    server.serve_forever()


if __name__ == "__main__":
    main()
