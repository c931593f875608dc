"""The bootstrap service's client: `BootstrapClient` (register, unregister, look up; blocking
calls, each on a short asyncio loop of its own) and `Registration`, which keeps one worker
registered for as long as it runs."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any
from urllib.parse import quote

import aiohttp
import msgspec

from kvxfer.integrations.bootstrap.schema import (
    PROOF_HEADER,
    AmbiguousEngine,
    EngineWorkers,
    Unregister,
    WorkerInfo,
    bootstrap_url,
    complete_workers,
    describe,
    write_proof,
)

log = logging.getLogger(__name__)


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
        connect_timeout_s: the longest a call waits for the service to accept its connection
            (default `timeout_s`): a service that accepted it may take `timeout_s` to answer.
    """

    def __init__(
        self,
        address: str,
        *,
        secret: str | None = None,
        timeout_s: float = 5.0,
        connect_timeout_s: float | None = None,
    ):
        self.url = bootstrap_url(address)
        self._secret = secret or None
        self._timeout_s = timeout_s
        self._connect_timeout_s = connect_timeout_s

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
        gone = Unregister(**msgspec.structs.asdict(info.key), generation=info.generation)
        answer = self._call("POST", "/v1/unregister", msgspec.json.encode(gone), timeout_s)
        return bool(answer["removed"])

    def workers(self, engine_id: str, dp_rank: int | None = None) -> EngineWorkers:
        """An engine's live workers (of one DP rank when given).

        Raises:
            BootstrapError: 404 when none is registered.
        """
        query = "" if dp_rank is None else f"?dp_rank={int(dp_rank)}"
        path = f"/v1/engines/{quote(engine_id, safe='')}{query}"
        return msgspec.convert(self._call("GET", path), EngineWorkers)

    def lookup(self, engine_id: str, dp_rank: int | None, timeout_s: float) -> list[WorkerInfo]:
        """Every worker of one DP rank of an engine, in (PP, TP) rank order; waits up to
        `timeout_s` for ranks that have not registered yet (an engine starting or restarting).
        `dp_rank` None: the engine id's only DP rank (vLLM's ids are per DP rank: a router
        that names the engine id only, as vllm-router does, names one DP rank).

        Raises:
            LookupError: ranks still missing, or the service unreachable, at the deadline; the
                message names the service, the engine and what is missing.
        """
        deadline = time.monotonic() + timeout_s
        pause = 0.05
        while True:
            try:
                return complete_workers(self.workers(engine_id, dp_rank))
            except AmbiguousEngine:
                raise
            except (BootstrapError, BootstrapUnavailable, LookupError) as exc:
                if isinstance(exc, BootstrapError) and exc.status != 404:
                    raise LookupError(f"{self.url}: {exc}") from exc
                if time.monotonic() + pause > deadline:
                    where = "" if dp_rank is None else f" DP rank {dp_rank}"
                    raise LookupError(
                        f"engine {engine_id!r}{where} not found through the "
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
            headers[PROOF_HEADER] = write_proof(self._secret, path.partition("?")[0], body)
        timeout = self._timeout_s if timeout_s is None else timeout_s
        return asyncio.run(self._request(method, path, body, headers, timeout))

    def _client_timeout(self, total: float) -> aiohttp.ClientTimeout:
        connect = self._connect_timeout_s
        return aiohttp.ClientTimeout(
            total=total, sock_connect=None if connect is None else min(connect, total)
        )

    async def _request(
        self, method: str, path: str, body: bytes | None, headers: dict[str, str], timeout: float
    ) -> Any:
        try:
            async with (
                aiohttp.ClientSession(timeout=self._client_timeout(timeout)) as session,
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
        where = f"{describe(self.info.key)} at {self.info.address}"
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
