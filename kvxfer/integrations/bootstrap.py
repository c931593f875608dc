"""The bootstrap service: where a prefill engine's workers say where their side channels are,
and where decode workers look them up, by engine, data-parallel (DP) rank, tensor-parallel (TP)
rank and pipeline-parallel (PP) rank.

A small HTTP/JSON service, as vLLM's Mooncake connector runs one, built on aiohttp (server and
client): already a dependency of Mooncake's wheels and of vLLM, maintained by aio-libs, and one
library for both ends. The registry lives on the server's event loop, so it needs no lock.

- `POST /v1/register` (a `WorkerInfo`): add or renew a worker's entry. An entry of the same
  (engine, DP, TP, PP) rank with another `generation` is replaced: the worker restarted (one
  that started earlier than the entry's is refused with 409: a stale incarnation). Entries
  expire `ttl_s` after their last registration; `Registration` renews them every `ttl_s / 3`.
- `POST /v1/unregister` (`WorkerKey` and its generation): remove an entry, at shutdown.
- `GET /v1/engines/{engine_id}[?dp_rank=N]`: an engine's live workers (404 when none).
- `GET /v1/engines`: every engine with live workers, and its DP ranks.
- `GET /v1/health`: `{"status": "ok", "workers": N}`.

Errors come back as `{"error": "..."}` with 400 (a bad request, naming the field), 403 (a
write not signed with the service's secret), 404, 405, 409, 413 or 503 (registry full). With a
`secret`, writes carry an HMAC proof of it (`X-Kvxfer-Proof`); reads stay open: they reveal
addresses only, and decode workers authenticate every producer at handshake anyway.

Run one on its own (what `bootstrap_address` names in the vLLM integration)::

    KVXFER_BOOTSTRAP_SECRET=... python -m kvxfer.integrations.bootstrap --host 10.0.0.1 --port 5690

Nothing here imports a serving engine.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Annotated, Any

import aiohttp
import msgspec
from aiohttp import web

from kvxfer.validation import check_host, check_side_channel_address

log = logging.getLogger(__name__)

PROOF_HEADER = "X-Kvxfer-Proof"
DEFAULT_TTL_S = 30.0
MAX_BODY_BYTES = 64 << 10
SECRET_ENV = "KVXFER_BOOTSTRAP_SECRET"

_Rank = Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]
_Size = Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]
_EngineId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
_ENGINE_ID = re.compile(r"^[\x21-\x7e]+$")  # printable ASCII, no space


class WorkerKey(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One worker's place in its engine."""

    engine_id: _EngineId
    dp_rank: _Rank
    tp_rank: _Rank
    pp_rank: _Rank = 0


class WorkerInfo(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a prefill worker registers.

    Attributes:
        engine_id, dp_rank, tp_rank, pp_rank: its place (vLLM: the DP rank's engine id, which
            vLLM suffixes with `_dp<rank>`, and `data_parallel_index`).
        address: its side channel, `tcp://host:port` (`KVProducer.address`).
        tp_size, pp_size: its engine's sizes, so a reader knows when every rank is there.
        generation: unique per start of the worker; a new one means a restart.
        started_at: when it started (seconds since the epoch): a registration older than the
            entry it would replace is refused.
        ttl_s: the entry expires this long after its last registration.
        geometry: a summary of its cache (layers, heads, block size...), for people and checks.
        group_addresses: with several KV cache groups, each group's side channel in group
            order (the first is `address`); empty with one group.
    """

    engine_id: _EngineId
    dp_rank: _Rank
    tp_rank: _Rank
    pp_rank: _Rank = 0
    address: Annotated[str, msgspec.Meta(min_length=1, max_length=300)]
    tp_size: _Size
    pp_size: _Size = 1
    generation: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    started_at: Annotated[float, msgspec.Meta(ge=0)]
    ttl_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = DEFAULT_TTL_S
    geometry: dict[str, Any] = {}
    group_addresses: list[Annotated[str, msgspec.Meta(min_length=1, max_length=300)]] = []

    @property
    def key(self) -> WorkerKey:
        """Its place."""
        return WorkerKey(
            engine_id=self.engine_id,
            dp_rank=self.dp_rank,
            tp_rank=self.tp_rank,
            pp_rank=self.pp_rank,
        )


class _Unregister(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    engine_id: _EngineId
    dp_rank: _Rank
    tp_rank: _Rank
    pp_rank: _Rank = 0
    generation: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]


class EngineWorkers(msgspec.Struct, frozen=True, kw_only=True):
    """An engine's live workers (of one DP rank when `dp_rank` is set)."""

    engine_id: str
    dp_rank: int | None
    workers: list[WorkerInfo]


def new_worker_info(
    engine_id: str,
    dp_rank: int,
    tp_rank: int,
    pp_rank: int,
    address: str,
    tp_size: int,
    pp_size: int = 1,
    *,
    ttl_s: float = DEFAULT_TTL_S,
    geometry: dict[str, Any] | None = None,
    group_addresses: list[str] | None = None,
) -> WorkerInfo:
    """A worker's registration, with a fresh generation and start time; checked.

    Raises:
        ValueError: a field out of range, naming it.
    """
    info = WorkerInfo(
        engine_id=engine_id,
        dp_rank=dp_rank,
        tp_rank=tp_rank,
        pp_rank=pp_rank,
        address=address,
        tp_size=tp_size,
        pp_size=pp_size,
        generation=uuid.uuid4().hex,
        started_at=time.time(),
        ttl_s=ttl_s,
        geometry=dict(geometry or {}),
        group_addresses=list(group_addresses or []),
    )
    return check_worker_info(msgspec.to_builtins(info))


def check_worker_info(data: Any) -> WorkerInfo:
    """A `WorkerInfo` from its JSON form (a dict, or bytes), every field checked.

    Raises:
        ValueError: a missing, unknown or ill-typed field, or a value out of range, naming it.
    """
    try:
        if isinstance(data, (bytes, bytearray, memoryview)):
            info = msgspec.json.decode(data, type=WorkerInfo)
        else:
            info = msgspec.convert(data, WorkerInfo)
    except msgspec.ValidationError as exc:
        raise ValueError(f"registration: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ValueError(f"registration: the body is not JSON: {exc}") from None
    _check_engine_id(info.engine_id)
    if info.tp_rank >= info.tp_size:
        raise ValueError(
            f"registration: tp_rank {info.tp_rank} is not below tp_size {info.tp_size}"
        )
    if info.pp_rank >= info.pp_size:
        raise ValueError(
            f"registration: pp_rank {info.pp_rank} is not below pp_size {info.pp_size}"
        )
    try:
        for address in (info.address, *info.group_addresses):
            check_side_channel_address(address)
    except ValueError as exc:
        raise ValueError(f"registration: {exc}") from None
    if info.group_addresses and info.group_addresses[0] != info.address:
        raise ValueError(
            f"registration: group_addresses {info.group_addresses[:4]} must start with address "
            f"{info.address!r} (KV cache group 0's side channel)"
        )
    return info


def _check_engine_id(engine_id: str) -> None:
    if not _ENGINE_ID.match(engine_id):
        raise ValueError(
            f"engine_id {engine_id!r}: use printable ASCII without spaces (1-256 characters)"
        )


def bootstrap_url(address: object, where: str = "bootstrap address") -> str:
    """The canonical form, `http://host:port`, of a bootstrap address (`host:port`,
    `[v6]:port`, or either behind `http://`).

    Raises:
        ValueError: naming `where`, the problem and the accepted forms.
    """
    accepted = "write HOST:PORT or http://HOST:PORT, e.g. 10.0.0.1:5690"
    if not isinstance(address, str) or not address.strip():
        raise ValueError(f"{where}: {address!r} is not an address; {accepted}")
    text = address.strip().rstrip("/")
    scheme, sep, rest = text.partition("://")
    if not sep:
        rest = text
    elif scheme != "http":
        raise ValueError(f"{where}: {address!r}: scheme {scheme!r} is not supported; {accepted}")
    if rest.startswith("["):
        end = rest.find("]")
        host, port = (rest[: end + 1], rest[end + 2 :]) if end > 0 else (rest, "")
        if end < 0 or rest[end + 1 : end + 2] != ":":
            raise ValueError(f"{where}: {address!r} has no port; {accepted}")
    else:
        host, colon, port = rest.rpartition(":")
        if not colon or not host:
            raise ValueError(f"{where}: {address!r} has no port; {accepted}")
        if ":" in host:
            raise ValueError(
                f"{where}: {address!r}: write an IPv6 address in brackets, e.g. [::1]:5690"
            )
    if not port.isascii() or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{where}: {address!r}: the port must be in 1..65535; {accepted}")
    check_host(host.strip("[]"), where)
    return f"http://{host}:{int(port)}"


def complete_workers(info: EngineWorkers) -> list[WorkerInfo]:
    """Every rank of one DP rank of an engine, in (PP rank, TP rank) order.

    Raises:
        LookupError: ranks are missing or the workers disagree on the engine's sizes (a restart
            in progress), naming them.
    """
    where = f"engine {info.engine_id!r} DP rank {info.dp_rank}"
    if not info.workers:
        raise LookupError(f"{where}: no worker is registered")
    sizes = {(w.tp_size, w.pp_size) for w in info.workers}
    if len(sizes) != 1:
        raise LookupError(f"{where}: workers disagree on (tp_size, pp_size): {sorted(sizes)}")
    ((tp_size, pp_size),) = sizes
    by_rank = {(w.pp_rank, w.tp_rank): w for w in info.workers}
    missing = [
        f"TP {tp} PP {pp}"
        for pp in range(pp_size)
        for tp in range(tp_size)
        if (pp, tp) not in by_rank
    ]
    if missing:
        raise LookupError(
            f"{where}: {len(by_rank)} of {tp_size * pp_size} workers registered; missing "
            + ", ".join(missing)
        )
    return [by_rank[pp, tp] for pp in range(pp_size) for tp in range(tp_size)]


# ---- server ---------------------------------------------------------------------------------


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
                _describe(key),
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
                    f"{_describe(key)}: superseded by generation {old.info.generation} "
                    f"(started later); this worker is a stale incarnation",
                )
            status = "replaced"
            log.info(
                "kvxfer bootstrap: %s restarted at %s (was %s)",
                _describe(key),
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
        return _json({"status": status, "worker": _describe(key)})

    async def _unregister(self, request: web.Request) -> web.Response:
        body = await _signed_body(request, self._secret)
        try:
            gone = msgspec.json.decode(body, type=_Unregister)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise _error(web.HTTPBadRequest, f"unregister: {exc}") from None
        key = WorkerKey(
            engine_id=gone.engine_id,
            dp_rank=gone.dp_rank,
            tp_rank=gone.tp_rank,
            pp_rank=gone.pp_rank,
        )
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

    async def _health(self, request: web.Request) -> web.Response:
        return _json({"status": "ok", "workers": len(self._live())})


def _describe(key: WorkerKey) -> str:
    return f"engine {key.engine_id!r} DP {key.dp_rank} TP {key.tp_rank} PP {key.pp_rank}"


def _json(payload: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(payload), status=status, content_type="application/json"
    )


def _error(kind: type[web.HTTPException], message: str) -> web.HTTPException:
    return kind(
        text=msgspec.json.encode({"error": message}).decode(), content_type="application/json"
    )


async def _signed_body(request: web.Request, secret: str | None) -> bytes:
    body = await request.read()
    if secret is not None:
        claimed = request.headers.get(PROOF_HEADER, "")
        if not claimed or not hmac.compare_digest(_proof(secret, request.path, body), claimed):
            raise _error(
                web.HTTPForbidden,
                f"{request.path}: not signed with this service's secret; set the same secret "
                "on the prefill workers and the bootstrap service",
            )
    return body


def _proof(secret: str, path: str, body: bytes) -> str:
    """HMAC-SHA256 of a write under the secret, as `kvxfer.connector.auth.proof` builds its
    proofs (not imported: this module stays as light as a standalone service should be)."""
    mac = hmac.new(secret.encode(), b"bootstrap", hashlib.sha256)
    for part in (path.encode(), body):
        mac.update(len(part).to_bytes(4, "big"))  # unambiguous concatenation
        mac.update(part)
    return mac.hexdigest()


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


# ---- client ---------------------------------------------------------------------------------


class BootstrapError(RuntimeError):
    """The service answered with an error (`status`, and its message)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"bootstrap service: {message} (HTTP {status})")
        self.status = status


class BootstrapUnavailable(ConnectionError):
    """The service could not be reached (or did not answer in time)."""


class BootstrapClient:
    """Calls a bootstrap service. Blocking calls (each runs its own short asyncio loop): call
    them off any thread whose latency matters, and from no running event loop.

    Args:
        address: the service (`host:port` or `http://host:port`).
        secret: the service's secret, to sign writes (None: unsigned).
        timeout_s: the longest one call may take.
    """

    def __init__(self, address: str, *, secret: str | None = None, timeout_s: float = 5.0):
        self.url = bootstrap_url(address)
        self._secret = secret or None
        self._timeout_s = timeout_s

    def register(self, info: WorkerInfo) -> str:
        """Add or renew `info`'s entry: "registered", "renewed" or "replaced" (a restart).

        Raises:
            BootstrapError: refused (409: a later incarnation of this worker registered).
            BootstrapUnavailable: the service did not answer.
        """
        answer = self._call("POST", "/v1/register", msgspec.json.encode(info))
        return str(answer["status"])

    def unregister(self, info: WorkerInfo, timeout_s: float | None = None) -> bool:
        """Remove `info`'s entry (only while it is this generation's); whether it was there."""
        gone = _Unregister(
            engine_id=info.engine_id,
            dp_rank=info.dp_rank,
            tp_rank=info.tp_rank,
            pp_rank=info.pp_rank,
            generation=info.generation,
        )
        answer = self._call("POST", "/v1/unregister", msgspec.json.encode(gone), timeout_s)
        return bool(answer["removed"])

    def workers(self, engine_id: str, dp_rank: int | None = None) -> EngineWorkers:
        """An engine's live workers (of one DP rank when given).

        Raises:
            BootstrapError: 404 when none is registered.
        """
        query = "" if dp_rank is None else f"?dp_rank={int(dp_rank)}"
        path = f"/v1/engines/{_quote(engine_id)}{query}"
        return msgspec.convert(self._call("GET", path), EngineWorkers)

    def lookup(self, engine_id: str, dp_rank: int, timeout_s: float) -> list[WorkerInfo]:
        """Every worker of one DP rank of an engine, in (PP, TP) rank order; waits up to
        `timeout_s` for ranks that have not registered yet (an engine starting or restarting).

        Raises:
            LookupError: ranks still missing, or the service unreachable, at the deadline; the
                message names the service, the engine and what is missing.
        """
        deadline = time.monotonic() + timeout_s
        pause = 0.05
        while True:
            try:
                return complete_workers(self.workers(engine_id, dp_rank))
            except (BootstrapError, BootstrapUnavailable, LookupError) as exc:
                if isinstance(exc, BootstrapError) and exc.status != 404:
                    raise LookupError(f"{self.url}: {exc}") from exc
                if time.monotonic() + pause > deadline:
                    raise LookupError(
                        f"engine {engine_id!r} DP rank {dp_rank} not found through the "
                        f"bootstrap service {self.url} in {timeout_s:g} s: {exc}"
                    ) from exc
            time.sleep(pause)
            pause = min(pause * 2, 0.5)

    def engines(self) -> dict[str, list[int]]:
        """Every engine with live workers, and its DP ranks."""
        answer = self._call("GET", "/v1/engines")
        return {e["engine_id"]: list(e["dp_ranks"]) for e in answer["engines"]}

    def health(self) -> dict[str, Any]:
        """`{"status": "ok", "workers": N}`."""
        result: dict[str, Any] = self._call("GET", "/v1/health")
        return result

    def _call(
        self, method: str, path: str, body: bytes | None = None, timeout_s: float | None = None
    ) -> Any:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        if body is not None and self._secret is not None:
            headers[PROOF_HEADER] = _proof(self._secret, path.partition("?")[0], body)
        timeout = self._timeout_s if timeout_s is None else timeout_s
        return asyncio.run(self._request(method, path, body, headers, timeout))

    async def _request(
        self, method: str, path: str, body: bytes | None, headers: dict[str, str], timeout: float
    ) -> Any:
        try:
            async with (
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session,
                session.request(method, self.url + path, data=body, headers=headers) as response,
            ):
                payload = await response.read()
                status = response.status
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise BootstrapUnavailable(
                f"bootstrap service {self.url} did not answer {method} {path.partition('?')[0]}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        try:
            decoded = msgspec.json.decode(payload)
        except msgspec.DecodeError:
            decoded = None
        if status >= 400:
            message = decoded.get("error") if isinstance(decoded, dict) else None
            raise BootstrapError(status, str(message or payload[:200].decode(errors="replace")))
        if decoded is None:
            raise BootstrapError(status, f"{self.url}{path} answered with a body that is not JSON")
        return decoded


def _quote(engine_id: str) -> str:
    from urllib.parse import quote

    return quote(engine_id, safe="")


class Registration:
    """Keeps one worker registered while `run` runs: registers (again and again until the
    service answers: it may start after the worker), renews every `ttl_s / 3` (so an entry
    comes back after the service restarts), and unregisters when `stop` is called.

    `start` runs it on a daemon thread of its own, which sleeps between calls: a loop that
    lasts as long as the worker must not keep the interpreter from exiting, as a pool thread
    would (Python joins those at exit). `run` is the same loop, blocking.
    """

    def __init__(self, client: BootstrapClient, info: WorkerInfo) -> None:
        self.client, self.info = client, info
        self.registered = threading.Event()  # set by the first registration that succeeded
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Registration:
        """Run `run` on a daemon thread."""
        self._thread = threading.Thread(target=self.run, name="kvxfer-registration", daemon=True)
        self._thread.start()
        return self

    def run(self) -> None:
        """Register and renew until `stop`; then unregister."""
        renew = self.info.ttl_s / 3
        pause, failing_since, complained = 0.05, None, ""
        where = f"{_describe(self.info.key)} at {self.info.address}"
        while not self._stop.is_set():
            try:
                status = self.client.register(self.info)
            except Exception as exc:  # unreachable, refused, or the interpreter is ending
                now = time.monotonic()
                failing_since = failing_since or now
                refused = isinstance(exc, BootstrapError)
                if isinstance(exc, BootstrapError) and exc.status == 409:
                    log.error("kvxfer: %s stops registering: %s", where, exc)
                    return
                # The service may not be up yet (the engine starts it after its workers): say
                # so only when it lasts, or when the service refuses (a configuration error).
                if (refused or now - failing_since > 5.0) and complained != str(exc):
                    complained = str(exc)
                    log.warning("kvxfer: cannot register %s: %s (retrying)", where, exc)
                self._wait(renew if refused else pause)
                pause = min(pause * 2, 1.0, renew)
                continue
            if not self.registered.is_set() or status == "registered":  # first, or lost
                log.info("kvxfer: %s %s with %s", where, status, self.client.url)
            self.registered.set()
            pause, failing_since, complained = 0.05, None, ""
            self._wait(renew)
        if self.registered.is_set():
            try:
                self.client.unregister(self.info, timeout_s=2.0)
            except Exception as exc:  # unreachable, or the interpreter is shutting down
                log.info("kvxfer: could not unregister %s: %s (it expires)", where, exc)

    def stop(self, timeout: float | None = None) -> None:
        """End `run`, which unregisters first (within about 2 s, or a call in flight's
        timeout); with `timeout`, wait that long for `start`'s thread to end."""
        self._stop.set()
        if self._thread is not None and timeout is not None:
            self._thread.join(timeout)

    def _wait(self, seconds: float) -> None:
        self._stop.wait(seconds)


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: `python -m kvxfer.integrations.bootstrap --host H --port P` (the secret,
    if any, from the environment variable KVXFER_BOOTSTRAP_SECRET)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=int, default=5690)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    server = BootstrapServer(args.host, args.port, secret=os.environ.get(SECRET_ENV)).start()
    print(f"kvxfer bootstrap service on {server.address}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        server.close()


if __name__ == "__main__":
    main()
