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
`secret`, writes carry an HMAC proof of it (`X-Kvxfer-Proof`, kvxfer's own proof from
`kvxfer.session.auth`); reads stay open: they reveal addresses only, and decode workers
authenticate every producer at handshake anyway.

Run one on its own (what `bootstrap_address` names in the vLLM integration)::

    KVXFER_BOOTSTRAP_SECRET=... python -m kvxfer.integrations.bootstrap --host 10.0.0.1 --port 5690

The package: `schema` (the wire and its checks), `server` (`BootstrapServer`), `client`
(`BootstrapClient`, `Registration`), `__main__` (the command line). Nothing here imports a
serving engine, torch or ZeroMQ: a standalone service stays light.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvxfer.integrations.bootstrap.client import (
    BootstrapClient,
    BootstrapError,
    BootstrapUnavailable,
    Registration,
)
from kvxfer.integrations.bootstrap.schema import (
    DEFAULT_TTL_S,
    MAX_BODY_BYTES,
    PROOF_HEADER,
    SECRET_ENV,
    EngineWorkers,
    WorkerInfo,
    WorkerKey,
    bootstrap_url,
    check_worker_info,
    complete_workers,
    new_worker_info,
)
from kvxfer.integrations.bootstrap.server import BootstrapServer

__all__ = [
    "DEFAULT_TTL_S",
    "MAX_BODY_BYTES",
    "PROOF_HEADER",
    "SECRET_ENV",
    "BootstrapClient",
    "BootstrapError",
    "BootstrapServer",
    "BootstrapUnavailable",
    "EngineWorkers",
    "Registration",
    "WorkerInfo",
    "WorkerKey",
    "bootstrap_url",
    "check_worker_info",
    "complete_workers",
    "main",
    "new_worker_info",
]


def main(argv: Sequence[str] | None = None) -> None:
    """The command line, `python -m kvxfer.integrations.bootstrap` (see its `__main__`)."""
    # Imported here: a package that imported its own __main__ would make `python -m` warn.
    from kvxfer.integrations.bootstrap.__main__ import main as command

    command(argv)
