"""What the scheduler side tells the worker side each step (vLLM's connector metadata), and where
a decode request's KV lies (`RemoteEngine`, read from its `kv_transfer_params`, and the `Route`
to its ranks)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
)

from kvxfer.integrations.bootstrap import bootstrap_url

# ---- where a request's KV lies -----------------------------------------------------------------


@dataclass(frozen=True)
class RemoteEngine:
    """One DP rank of a prefill engine, as a request's `kv_transfer_params` name it.

    Its workers are found through the bootstrap service at `bootstrap_addr` (the prefill
    engine's parameters always name one), or, for parameters without it, at fixed ports: the
    worker of PP rank `p` and TP rank `t` at `host:port + p * tp_size + t` (`pp_size` 1 when
    the parameters do not say).
    """

    engine_id: str
    dp_rank: int | None = 0  # None: the engine id's only DP rank (vllm-router names no rank)
    bootstrap_addr: str | None = None
    host: str | None = None
    port: int | None = None
    tp_size: int | None = None
    pp_size: int = 1

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> RemoteEngine:
        """Read `remote_engine_id`, `remote_dp_rank`, `remote_bootstrap_addr` (or, without it,
        `remote_host`, `remote_port`, `tp_size` and `pp_size`, 1 if absent).

        Raises:
            ValueError: a key missing or of the wrong type, naming it.
        """
        engine_id = params.get("remote_engine_id")
        if not isinstance(engine_id, str) or not engine_id:
            raise ValueError(f"remote_engine_id {engine_id!r} is not an engine id")
        dp_rank = _count(params, "remote_dp_rank", None, lowest=0)
        tp_size = _count(params, "tp_size", None, lowest=1)
        bootstrap = params.get("remote_bootstrap_addr")
        if bootstrap is not None:  # without remote_dp_rank, the service knows the engine's
            return cls(engine_id, dp_rank, bootstrap_url(bootstrap, "remote_bootstrap_addr"))
        dp_rank = dp_rank or 0  # fixed ports: the rank plays no part in the addresses
        host, port = params.get("remote_host"), _count(params, "remote_port", None, lowest=1)
        if not isinstance(host, str) or not host or port is None or tp_size is None:
            raise ValueError(
                "neither remote_bootstrap_addr nor all of remote_host, remote_port and tp_size"
            )
        pp_size = _count(params, "pp_size", 1, lowest=1) or 1
        if port + pp_size * tp_size - 1 > 65535:
            raise ValueError(
                f"remote_port {port} + {pp_size * tp_size} workers (pp_size x tp_size) runs past "
                "port 65535"
            )
        return cls(engine_id, dp_rank, None, host, port, tp_size, pp_size)

    def fixed_addresses(self) -> tuple[str, ...]:
        """The side channels of its workers at fixed ports, pp-major (PP rank `p`, TP rank `t`
        at `port + p * tp_size + t`): every stage's, for the consumer to connect to."""
        assert self.host is not None and self.port is not None and self.tp_size is not None
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return tuple(
            f"tcp://{host}:{self.port + rank}" for rank in range(self.pp_size * self.tp_size)
        )

    def __str__(self) -> str:
        where = self.bootstrap_addr or f"{self.host}:{self.port}"
        rank = "its DP rank" if self.dp_rank is None else f"DP rank {self.dp_rank}"
        return f"{self.engine_id} ({rank}, {where})"


@dataclass(frozen=True)
class Route:
    """How a remote engine's ranks are found: through a bootstrap service (the prefill
    engine's parameters name one), or at fixed addresses (parameters that name none)."""

    bootstrap: str | None
    addresses: tuple[str, ...] = ()

    @classmethod
    def of(cls, remote: RemoteEngine) -> Route:
        """The route a request's parameters name."""
        if remote.bootstrap_addr is not None:
            return cls(remote.bootstrap_addr)
        return cls(None, remote.fixed_addresses())

    def __str__(self) -> str:
        return self.bootstrap or ", ".join(self.addresses)


def _count(params: dict[str, Any], key: str, default: int | None, *, lowest: int) -> int | None:
    value = params.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
        raise ValueError(f"{key} {value!r} is not an integer >= {lowest}")
    return value


# ---- scheduler -> worker metadata -------------------------------------------------------------


@dataclass
class LoadSpec:
    """A decode worker's order: fetch tokens `[start_token, num_tokens)` of a remote request
    into `block_ids[g]`, the block table of KV cache group `g`."""

    request_id: str
    remote_request_id: str
    remote: RemoteEngine
    block_ids: list[list[int]]
    num_tokens: int
    start_token: int
    # The concurrent flow: the prefill engine may still be computing it (fetched layer by
    # layer, `KVConsumer.fetch(streamed=True)`).
    streamed: bool = False
    # The load ends the request's tokens, so vLLM recomputes its last one: a sliding-window
    # group fetches what the query at `num_tokens - 1` attends to (`GroupedConsumer.fetch`).
    recomputes_last: bool = False


@dataclass
class SendSpec:
    """A prefill worker's order: offer tokens `[0, num_tokens)` in `block_ids` (one table per KV
    cache group) to decoders."""

    request_id: str
    block_ids: list[list[int]]
    num_tokens: int
    # The id it is offered under, when not `request_id`: the router's `transfer_id`, which the
    # decode engine, sent the request at the same time, fetches by.
    published_id: str | None = None
    # Offered as its prefill is scheduled, tokens before it computed already (a local prefix
    # hit): the worker marks each attention layer ready as the step writes it (`save_kv_layer`)
    # and the whole request at the step's end (`wait_for_save`). None: computed, offered whole.
    ready_tokens: int | None = None
    # The prefill scheduler's events of the request (`kvxfer.connector.timeline`), published
    # with it for the decode engine's timeline.
    timeline: dict[str, float] = field(default_factory=dict)

    @property
    def offered_as(self) -> str:
        """The id decode engines fetch it by."""
        return self.published_id or self.request_id


@dataclass
class StreamStep:
    """A prefill worker's order for a request offered while computing (`SendSpec.ready_tokens`)
    that this step computes: tokens before `tokens` are computed once the step is done (each
    attention layer marked as it writes them, the whole at `wait_for_save`). `block_ids`: the
    request's whole tables so far, when this step allocated more (a chunked prefill)."""

    request_id: str
    offered_as: str
    tokens: int
    block_ids: list[list[int]] | None = None


@dataclass
class SendFailure:
    """A prefill worker's order: a request offered while computing (`SendSpec.ready_tokens`)
    will not be handed over (vLLM finished it otherwise): fail its publication, so that its
    fetches fail with their blocks and the producer releases it (then vLLM frees its blocks)."""

    request_id: str
    offered_as: str
    reason: str


@dataclass
class AbortSpec:
    """A decode worker's order: vLLM finished a request before its KV was loaded (aborted,
    or finished while waiting). The worker gives up its load, if one runs, and tells the
    prefill engine, which frees the request's blocks at once."""

    request_id: str
    remote_request_id: str
    remote: RemoteEngine


@dataclass
class KvxferConnectorMetadata(KVConnectorMetadata):
    """What one step asks of every worker."""

    loads: list[LoadSpec] = field(default_factory=list)
    sends: list[SendSpec] = field(default_factory=list)
    aborts: list[AbortSpec] = field(default_factory=list)
    send_failures: list[SendFailure] = field(default_factory=list)
    stream_steps: list[StreamStep] = field(default_factory=list)
