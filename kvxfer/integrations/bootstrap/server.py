"""The bootstrap service's server: the registry, served over HTTP on a thread of its own (an
aiohttp application on an asyncio loop). The registry lives on that loop, so it needs no lock.

An entry of the same (engine, DP, TP, PP) rank with another `generation` is replaced: the
worker restarted (one that started earlier than the entry's is refused with 409: a stale
incarnation). Entries expire `ttl_s` after their last registration. Writes must carry the
proof of the service's secret when it has one (`schema.write_proof`); reads stay open.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from concurrent.futures import Future
from typing import Any

import msgspec
from aiohttp import web

from kvxfer.integrations.bootstrap.schema import (
    MAX_BODY_BYTES,
    PROOF_HEADER,
    EngineWorkers,
    Unregister,
    WorkerInfo,
    WorkerKey,
    check_worker_info,
    describe,
    write_proof,
)
from kvxfer.session import auth

log = logging.getLogger(__name__)


class _Entry:
    __slots__ = ("expires_at", "info")

    def __init__(self, info: WorkerInfo, expires_at: float) -> None:
        self.info, self.expires_at = info, expires_at


class BootstrapServer:
    """The registry, served over HTTP on a thread of its own (an asyncio loop).

    Args:
        host: the address to bind and to advertise (`address`).
        port: the port (0: a free one; see `address`).
        secret: writes must prove it (HMAC); None: anyone who reaches the port may register.
        max_workers: the most entries at once (more registrations get 503).
        clock: the monotonic clock entries expire by (tests pass their own).

    Raises (at `start`):
        OSError: the port cannot be bound, naming it.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        secret: str | None = None,
        max_workers: int = 4096,
        clock: Any = time.monotonic,
    ) -> None:
        self.host, self.port = host, port
        self._secret = secret or None
        self._max_workers = max_workers
        self._clock = clock
        self._entries: dict[WorkerKey, _Entry] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_json_errors])
        self._app.router.add_post("/v1/register", self._register)
        self._app.router.add_post("/v1/unregister", self._unregister)
        self._app.router.add_get("/v1/engines", self._engines)
        self._app.router.add_get("/v1/engines/{engine_id}", self._engine)
        self._app.router.add_get("/v1/health", self._health)
        # vLLM MooncakeConnector's bootstrap contract: `vllm-router --kv-connector mooncake`
        # reads it to learn the prefill engine's id per DP rank (docs/vllm.md, "Routers").
        self._app.router.add_get("/query", self._query)

    @property
    def address(self) -> str:
        """`http://host:port`, the port resolved once started."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> BootstrapServer:
        """Bind and serve (once per object); returns once the service answers."""
        if self._thread is not None:
            raise RuntimeError("BootstrapServer.start: already started")
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        try:
            sock = socket.create_server((self.host, self.port), family=family)
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"cannot start the kvxfer bootstrap service on {self.host}:{self.port}: "
                f"{exc.strerror or exc}; choose another port (bootstrap_port), or run one "
                "service for the engine and name it with bootstrap_address",
            ) from exc
        self.port = sock.getsockname()[1]
        started: Future[None] = Future()
        self._thread = threading.Thread(
            target=self._serve, args=(sock, started), name="kvxfer-bootstrap", daemon=True
        )
        self._thread.start()
        try:
            started.result(timeout=30)
        except BaseException:
            sock.close()
            self._thread.join(5)
            self._thread = None
            raise
        log.info("kvxfer bootstrap service at %s", self.address)
        return self

    def close(self) -> None:
        """Stop serving (entries are dropped; workers register again with a new service)."""
        loop, thread = self._loop, self._thread
        self._loop, self._thread = None, None
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)
        if thread is not None:
            thread.join(10)

    def __enter__(self) -> BootstrapServer:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _serve(self, sock: socket.socket, started: Future[None]) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        runner = web.AppRunner(self._app, access_log=None, handle_signals=False)
        try:
            loop.run_until_complete(runner.setup())
            loop.run_until_complete(web.SockSite(runner, sock).start())
        except BaseException as exc:
            loop.close()
            started.set_exception(exc)
            return
        self._loop = loop
        started.set_result(None)
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(runner.cleanup())
            loop.close()

    # ---- handlers (the loop's thread: no lock) ---------------------------------------------

    def _live(self) -> dict[WorkerKey, _Entry]:
        now = self._clock()
        for key in [k for k, e in self._entries.items() if e.expires_at <= now]:
            entry = self._entries.pop(key)
            log.info(
                "kvxfer bootstrap: %s expired (no registration for %.1f s)",
                describe(key),
                entry.info.ttl_s,
            )
        return self._entries

    async def _register(self, request: web.Request) -> web.Response:
        body = await _signed_body(request, self._secret)
        try:
            info = check_worker_info(body)
        except ValueError as exc:
            raise _error(web.HTTPBadRequest, str(exc)) from None
        entries = self._live()
        key = info.key
        old = entries.get(key)
        status = "registered"
        if old is not None and old.info.generation != info.generation:
            if info.started_at < old.info.started_at:
                raise _error(
                    web.HTTPConflict,
                    f"{describe(key)}: superseded by generation {old.info.generation} "
                    f"(started later); this worker is a stale incarnation",
                )
            status = "replaced"
            log.info(
                "kvxfer bootstrap: %s restarted at %s (was %s)",
                describe(key),
                info.address,
                old.info.address,
            )
        elif old is not None:
            status = "renewed"
        elif len(entries) >= self._max_workers:
            raise _error(
                web.HTTPServiceUnavailable,
                f"the registry is full ({self._max_workers} workers); entries expire "
                "when their workers stop renewing them",
            )
        entries[key] = _Entry(info, self._clock() + info.ttl_s)
        return _json({"status": status, "worker": describe(key)})

    async def _unregister(self, request: web.Request) -> web.Response:
        body = await _signed_body(request, self._secret)
        try:
            gone = msgspec.json.decode(body, type=Unregister)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise _error(web.HTTPBadRequest, f"unregister: {exc}") from None
        key = gone.key
        entry = self._live().get(key)
        removed = entry is not None and entry.info.generation == gone.generation
        if removed:
            del self._entries[key]
        return _json({"removed": removed})

    async def _engine(self, request: web.Request) -> web.Response:
        engine_id = request.match_info["engine_id"]
        dp_text = request.query.get("dp_rank")
        dp_rank = None
        if dp_text is not None:
            if not dp_text.isascii() or not dp_text.isdigit():
                raise _error(
                    web.HTTPBadRequest, f"dp_rank={dp_text!r}: expected a non-negative integer"
                )
            dp_rank = int(dp_text)
        workers = sorted(
            (
                e.info
                for k, e in self._live().items()
                if k.engine_id == engine_id and (dp_rank is None or k.dp_rank == dp_rank)
            ),
            key=lambda w: (w.dp_rank, w.pp_rank, w.tp_rank),
        )
        if not workers:
            where = f"engine {engine_id!r}" + (f" DP rank {dp_rank}" if dp_rank is not None else "")
            known = sorted({k.engine_id for k in self._entries})
            raise _error(
                web.HTTPNotFound,
                f"{where} has no registered worker; engines registered here: {known[:20]}",
            )
        return _json(EngineWorkers(engine_id=engine_id, dp_rank=dp_rank, workers=workers))

    async def _engines(self, request: web.Request) -> web.Response:
        ranks: dict[str, set[int]] = {}
        for key in self._live():
            ranks.setdefault(key.engine_id, set()).add(key.dp_rank)
        return _json(
            {"engines": [{"engine_id": e, "dp_ranks": sorted(r)} for e, r in sorted(ranks.items())]}
        )

    async def _query(self, request: web.Request) -> web.Response:
        """`{dp_rank: {"engine_id": ..., "worker_addr": {tp_rank: {pp_rank: address}}}}`, as
        vLLM's MooncakeConnector bootstrap answers it (object keys are strings in JSON)."""
        by_dp: dict[int, dict[str, Any]] = {}
        engines: dict[int, set[str]] = {}
        for key, entry in sorted(
            self._live().items(), key=lambda kv: (kv[0].dp_rank, kv[0].tp_rank, kv[0].pp_rank)
        ):
            engines.setdefault(key.dp_rank, set()).add(key.engine_id)
            rank = by_dp.setdefault(key.dp_rank, {"engine_id": key.engine_id, "worker_addr": {}})
            rank["worker_addr"].setdefault(str(key.tp_rank), {})[str(key.pp_rank)] = (
                entry.info.address
            )
        shared = {dp: sorted(ids) for dp, ids in engines.items() if len(ids) > 1}
        if shared:
            dp, ids = next(iter(sorted(shared.items())))
            raise _error(
                web.HTTPConflict,
                f"/query: DP rank {dp} is registered by engines {ids}; the MooncakeConnector "
                "contract names one engine per DP rank: run one bootstrap service per prefill "
                "engine for vllm-router's mooncake mode",
            )
        return _json({str(dp): rank for dp, rank in sorted(by_dp.items())})

    async def _health(self, request: web.Request) -> web.Response:
        return _json({"status": "ok", "workers": len(self._live())})


def _json(payload: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(payload), status=status, content_type="application/json"
    )


def _error(kind: type[web.HTTPException], message: str) -> web.HTTPException:
    return kind(
        text=msgspec.json.encode({"error": message}).decode(), content_type="application/json"
    )


async def _signed_body(request: web.Request, secret: str | None) -> bytes:
    """The request's body, once its proof of `secret` checks (a 403 otherwise)."""
    body = await request.read()
    if secret is not None:
        claimed = request.headers.get(PROOF_HEADER, "")
        expected = write_proof(secret, request.path, body)
        if not claimed or not auth.proof_matches(expected, claimed):
            raise _error(
                web.HTTPForbidden,
                f"{request.path}: not signed with this service's secret; set the same secret "
                "on the prefill workers and the bootstrap service",
            )
    return body


@web.middleware
async def _json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every error as `{"error": ...}` JSON (aiohttp's own 404, 405 and 413 are text)."""
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except web.HTTPException as exc:
        if exc.content_type == "application/json" or exc.status < 400:
            raise
        if exc.status == 413:
            message = f"the body is larger than {MAX_BODY_BYTES} bytes"
        elif exc.status == 404:
            message = (
                f"no route {request.path}; the service answers /v1/register, "
                "/v1/unregister, /v1/engines[/ENGINE_ID] and /v1/health"
            )
        elif exc.status == 405:
            message = f"{request.method} is not allowed on {request.path}"
        else:
            message = exc.text or exc.reason
        answer = _json({"error": message}, status=exc.status)
        if "Allow" in exc.headers:
            answer.headers["Allow"] = exc.headers["Allow"]
        return answer
