"""The bootstrap service's wire: what a worker registers (`WorkerInfo`), what a look-up answers
(`EngineWorkers`), the proof a write carries, and the checks both ends apply. No I/O.

Entries are keyed by (engine, DP, TP, PP) rank (`WorkerKey`); a worker's `generation` is unique
per start (a new one is a restart), and its `started_at` tells a restart from a stale
incarnation. Every field is checked on the way in, and an error names the field.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Annotated, Any

import msgspec

from kvxfer.addresses import check_host, check_side_channel_address
from kvxfer.session import auth

PROOF_HEADER = "X-Kvxfer-Proof"
DEFAULT_TTL_S = 30.0
MAX_BODY_BYTES = 64 << 10
SECRET_ENV = "KVXFER_BOOTSTRAP_SECRET"
PROOF_ROLE = "bootstrap"  # what a write's proof is bound to, besides its path and body

_Rank = Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]
_Size = Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]
_EngineId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
_Generation = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
_Address = Annotated[str, msgspec.Meta(min_length=1, max_length=300)]
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
    address: _Address
    tp_size: _Size
    pp_size: _Size = 1
    generation: _Generation
    started_at: Annotated[float, msgspec.Meta(ge=0)]
    ttl_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = DEFAULT_TTL_S
    geometry: dict[str, Any] = {}
    group_addresses: list[_Address] = []

    @property
    def key(self) -> WorkerKey:
        """Its place."""
        return msgspec.convert(self, WorkerKey, from_attributes=True)


class Unregister(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """An unregistration: a worker's place and the generation whose entry it removes."""

    engine_id: _EngineId
    dp_rank: _Rank
    tp_rank: _Rank
    pp_rank: _Rank = 0
    generation: _Generation

    @property
    def key(self) -> WorkerKey:
        """The place it names."""
        return msgspec.convert(self, WorkerKey, from_attributes=True)


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


class AmbiguousEngine(LookupError):
    """An engine id registered by several DP ranks, asked for without a DP rank: waiting does
    not help."""


def complete_workers(info: EngineWorkers) -> list[WorkerInfo]:
    """Every rank of one DP rank of an engine, in (PP rank, TP rank) order.

    Raises:
        LookupError: ranks are missing or the workers disagree on the engine's sizes (a restart
            in progress), naming them.
    """
    where = f"engine {info.engine_id!r} DP rank {info.dp_rank}"
    if not info.workers:
        raise LookupError(f"{where}: no worker is registered")
    dp_ranks = sorted({w.dp_rank for w in info.workers})
    if len(dp_ranks) > 1:  # asked by engine id alone
        raise AmbiguousEngine(
            f"engine {info.engine_id!r} has workers of DP ranks {dp_ranks}: name the DP rank "
            "(remote_dp_rank in kv_transfer_params), or give each DP rank its own engine id"
        )
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


def describe(key: WorkerKey) -> str:
    """A worker's place, as log lines and errors name it."""
    return f"engine {key.engine_id!r} DP {key.dp_rank} TP {key.tp_rank} PP {key.pp_rank}"


def write_proof(secret: str, path: str, body: bytes) -> str:
    """The proof a write to `path` with `body` carries in `PROOF_HEADER`: kvxfer's proof
    (`kvxfer.session.auth.proof`) of the secret, bound to the role "bootstrap", the path
    (without its query) and the body."""
    return auth.proof(secret, PROOF_ROLE, path, body)
