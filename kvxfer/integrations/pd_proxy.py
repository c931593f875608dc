"""A minimal P/D proxy for vLLM's OpenAI-compatible API: prefill on one engine, decode on another.

For each `POST /v1/completions` or `/v1/chat/completions` it
1. sends the request to a prefill engine with `max_tokens = 1`, no streaming, and
   `kv_transfer_params = {"do_remote_decode": true}`;
2. takes the `kv_transfer_params` of that response (kvxfer's connector fills in where the KV
   lies) and sends the original request, with those parameters, to a decode engine;
3. relays the decode engine's response (streamed or not) to the client.

Engines are picked round-robin. Standard library only, so it runs wherever kvxfer does::

    python -m kvxfer.integrations.pd_proxy --port 8000 \\
        --prefill http://10.0.0.1:8100 --decode http://10.0.0.2:8200

It carries no retries, authentication or load balancing by queue length: a starting point for
a production router, which should keep steps 1 and 2 as they are.
"""

from __future__ import annotations

import argparse
import itertools
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

ROUTES = ("/v1/completions", "/v1/chat/completions")
_CHUNK = 64 << 10


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request for the prefill engine: one token, no stream, KV kept for a decoder."""
    prefill = dict(body)
    prefill.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
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


class _Backends:
    def __init__(self, urls: Sequence[str]) -> None:
        if not urls:
            raise ValueError("at least one engine URL is needed")
        self._cycle = itertools.cycle([u.rstrip("/") for u in urls])
        self._lock = threading.Lock()

    def next(self) -> str:
        with self._lock:
            return next(self._cycle)


def make_server(
    host: str, port: int, prefill_urls: Sequence[str], decode_urls: Sequence[str], timeout: float
) -> ThreadingHTTPServer:
    """An HTTP server that routes as the module says (call `serve_forever` on it)."""
    prefills, decodes = _Backends(prefill_urls), _Backends(decode_urls)

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
            try:
                prefilled = _post_json(prefills.next() + self.path, prefill_body(body), timeout)
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

        def _error(self, status: int, message: str) -> None:
            payload = json.dumps({"error": {"message": message, "code": status}}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return ThreadingHTTPServer((host, port), Handler)


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
    parser.add_argument("--prefill", action="append", required=True, help="prefill engine URL")
    parser.add_argument("--decode", action="append", required=True, help="decode engine URL")
    parser.add_argument("--timeout", type=float, default=600.0, help="per engine call, seconds")
    args = parser.parse_args(argv)
    server = make_server(args.host, args.port, args.prefill, args.decode, args.timeout)
    print(
        f"P/D proxy on http://{args.host}:{args.port}: prefill {args.prefill}, decode {args.decode}"
    )
    server.serve_forever()


if __name__ == "__main__":
    main()
