"""The connector settings a serving engine passes to kvxfer (vLLM: `kv_connector_extra_config`).

Kept free of any engine import so that the keys, their defaults and their checks are one
table, documented in docs/vllm.md ("Extra-config keys") and tested without the engine installed.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from dataclasses import dataclass, field
from typing import Any

from kvxfer.integrations.bootstrap import bootstrap_url
from kvxfer.plan import DEFAULT_STAGING_SLOTS, STRATEGIES, CostModel
from kvxfer.rdma import PROTOCOLS, ProtocolChoice, choose_protocol
from kvxfer.transport.factory import DEFAULT_KIND, KINDS

_COST_PRESETS = {"rdma": CostModel, "tcp_loopback": CostModel.tcp_loopback}


@dataclass(frozen=True)
class ConnectorSettings:
    """Every extra-config key, its type and default.

    Attributes:
        side_channel_host: address the prefill ranks' side channels and transports bind to, and
            that decode engines are told to reach (default 127.0.0.1: set the node's address).
        side_channel_port: 0 (default): each prefill worker binds a free port and registers it
            with the bootstrap service; N: the worker of DP rank `d`, PP rank `p` and TP rank
            `t` listens on `N + (d * pp_size + p) * tp_size + t` (distinct for every worker of
            the engine, whatever node each DP rank runs on).
        bootstrap_port: port of the bootstrap service the prefill engine's DP rank 0 starts
            (where its workers register their side channels and decode workers find them).
        bootstrap_address: `host:port` of a bootstrap service run elsewhere: it replaces the
            built-in one (no prefill process starts a service), and every prefill worker
            registers there.
        transport: the transport between engines, by name
            (`kvxfer.transport.factory.KINDS`): "mooncake" (default), or another that reaches
            peers in other processes; both engines must name the same one.
        protocol: Mooncake transport: "auto" (RDMA when this machine has an RDMA device,
            else TCP; `transport_protocol` says which and why), "tcp" or "rdma".
        strategy: force one strategy for every rank pair ("direct", "pack", "unpack",
            "pack+unpack"); default: the cost model chooses per pair at handshake.
        cost_model: a preset name ("rdma", "tcp_loopback") or a dict of `CostModel` fields.
        secret: shared secret decode ranks present at handshake.
        request_timeout_s: longest time a prefill engine holds a finished request's blocks
            for decode engines before freeing them, counted while its side channel ran (a
            prefill engine the machine does not run holds what its decode engines still fetch;
            a decode engine that went away costs its blocks this long).
        fetch_timeout_s: longest time one request's load may take on a decode rank (connecting
            to its prefill engine included); its unfinished blocks are then reported as load
            errors (vLLM recomputes them). A hang guard for a prefill rank that is there but
            does not serve (frozen, hung, or not run by a loaded machine): a dead one fails
            its loads at once. 300 s: with 60 s, a load of the real-engine suite failed behind
            a prefill engine whose two worker processes the machine did not run for 48.6 s.
        handshake_timeout_s: longest wait for a prefill engine to be there: its bootstrap
            service and ranks to accept a connection, its ranks to be registered. One that
            accepted but has not answered yet (a loaded or frozen host) is waited for as long
            as the loads that wait for it (`fetch_timeout_s`); an address where nothing
            listens fails at once. A look-up and connect runs off the engine's step, a task
            per prefill engine and DP rank on the worker's thread pool: loads from other
            prefill engines go on meanwhile.
        heartbeat_s: how often a decode rank sends each prefill rank it is connected to a
            heartbeat (libzmq's ZMTP PING) and a ping of its own.
        peer_timeout_s: a prefill rank whose libzmq answers no heartbeat this long has its
            connection opened again. If its address refuses (the process ended; a killed one
            is found at once anyway, by its closed connection), it is dead: its loads fail at
            once with their blocks (vLLM recomputes them or fails the requests, by
            `kv_load_failure_policy`), and the next load looks it up again. If its kernel
            accepts, the process exists, frozen or not run by a loaded machine (whole vLLM CPU
            worker processes went unrun for 10-21 s under the real-engine suite on 2 cores):
            what it had not answered is asked again once it runs, and `fetch_timeout_s` bounds
            the wait. libzmq's I/O threads answer heartbeats without the GIL, so a prefill rank
            whose Python threads cannot run (a C call holding its GIL, as vLLM CPU workers' TP
            all-gather does for up to a minute on a loaded host) keeps its connection.
        session_timeout_s: a prefill rank drops a decode rank's session silent this long
            (counted while the prefill rank's side channel ran), and reuses its staging pool;
            the decode rank shakes hands again. It only reclaims memory (chunks leased to a
            decode rank are freed at their holds' end regardless), so it outlasts the stalls of
            a loaded host: a decode worker not run for 38 s kept its session with 120 s.
        staging_bytes, staging_slots: staging pool per remote rank, and chunks in flight.
        backend: pack/unpack backend, "auto", "torch" or "triton".
        stream_prefill: prefill: offer a request the moment its prompt is scheduled and mark
            each attention layer ready as the forward pass writes it, when that is safe (the
            concurrent flow; docs/vllm.md, "Streaming the prefill"); false: offer it when it
            finished. Decode: fetch a concurrent-flow request streamed (layer by layer).
    """

    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0
    bootstrap_port: int = 5690
    bootstrap_address: str | None = None
    transport: str = DEFAULT_KIND
    protocol: str = "auto"
    strategy: str | None = None
    cost_model: CostModel = field(default_factory=CostModel)
    secret: str | None = None
    request_timeout_s: float = 120.0
    fetch_timeout_s: float = 300.0
    handshake_timeout_s: float = 10.0
    heartbeat_s: float = 0.5
    peer_timeout_s: float = 10.0
    session_timeout_s: float = 120.0
    staging_bytes: int = 32 << 20
    staging_slots: int = DEFAULT_STAGING_SLOTS
    backend: str = "auto"
    stream_prefill: bool = True

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> ConnectorSettings:
        """Parse and check an extra-config dict.

        Raises:
            ValueError: an unknown key, a value of the wrong type or out of range, naming the
                key and what it accepts.
        """
        extra = dict(extra or {})
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ValueError(
                f"kv_connector_extra_config: unknown key(s) {unknown}; kvxfer reads {sorted(known)}"
            )
        values: dict[str, Any] = {}
        for name, value in extra.items():
            values[name] = _coerce(name, value, cls())
        settings = cls(**values)
        if settings.peer_timeout_s <= settings.heartbeat_s:
            raise ValueError(
                f"kv_connector_extra_config: peer_timeout_s {settings.peer_timeout_s} must be "
                f"longer than heartbeat_s {settings.heartbeat_s} (a peer is dead only after "
                "missing several pings); raise peer_timeout_s or lower heartbeat_s"
            )
        return settings

    def transport_protocol(self, sysfs: str | None = None) -> ProtocolChoice:
        """The Mooncake protocol these settings run on this machine, and why: `protocol` when
        "tcp" or "rdma"; for "auto", "rdma" when `sysfs` (default: `/sys/class/infiniband`, or
        `$KVXFER_INFINIBAND_SYSFS`) lists an RDMA device, else "tcp"."""
        return choose_protocol(self.protocol, sysfs)

    def producer_options(self, protocol: str) -> dict[str, Any]:
        """The `KVProducer` options these settings name, on transport `protocol` (one table for
        every engine integration's prefill ranks)."""
        return {
            **self._endpoint_options(protocol),
            "request_timeout_s": self.request_timeout_s,
            "session_timeout_s": self.session_timeout_s,
        }

    def consumer_options(self, protocol: str) -> dict[str, Any]:
        """The `KVConsumer` options these settings name, on transport `protocol` (one table for
        every engine integration's decode ranks)."""
        return {
            **self._endpoint_options(protocol),
            "cost_model": self.cost_model,
            "strategy": self.strategy,
            "timeout_s": self.fetch_timeout_s,
            "heartbeat_s": self.heartbeat_s,
            "peer_timeout_s": self.peer_timeout_s,
        }

    def _endpoint_options(self, protocol: str) -> dict[str, Any]:
        """The options a producer and a consumer share."""
        return {
            "secret": self.secret,
            "transport": self.transport,
            "protocol": protocol,
            "staging_bytes": self.staging_bytes,
            "staging_slots": self.staging_slots,
            "backend": self.backend,
        }

    def bootstrap_host(self, data_parallel_master_ip: str | None = None) -> str:
        """Where the built-in bootstrap service runs: the engine's DP master address when it is
        not a loopback address (vLLM's `--data-parallel-address`: DP rank 0's node, when DP
        ranks span nodes), else `side_channel_host`."""
        if data_parallel_master_ip and not _is_loopback(data_parallel_master_ip):
            return data_parallel_master_ip
        return self.side_channel_host

    def bootstrap_url(self, data_parallel_master_ip: str | None = None) -> str:
        """The bootstrap service's URL: `bootstrap_address`, else the built-in service's."""
        if self.bootstrap_address is not None:
            return self.bootstrap_address
        host = self.bootstrap_host(data_parallel_master_ip)
        host = f"[{host}]" if ":" in host and not host.startswith("[") else host
        return f"http://{host}:{self.bootstrap_port}"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _coerce(name: str, value: Any, defaults: ConnectorSettings) -> Any:
    def fail(accepts: str) -> ValueError:
        return ValueError(f"kv_connector_extra_config[{name!r}] = {value!r}; expected {accepts}")

    if name == "cost_model":
        if isinstance(value, str):
            if value not in _COST_PRESETS:
                raise fail(f"one of {sorted(_COST_PRESETS)} or a dict of CostModel fields")
            return _COST_PRESETS[value]()
        if not isinstance(value, dict):
            raise fail(f"one of {sorted(_COST_PRESETS)} or a dict of CostModel fields")
        fields = {f.name for f in dataclasses.fields(CostModel)}
        if set(value) - fields:
            raise fail(f"CostModel fields only: {sorted(fields)}")
        return dataclasses.replace(CostModel(), **value)
    if name == "strategy":
        if value is not None and value not in STRATEGIES:
            raise fail(f"null or one of {list(STRATEGIES)}")
        return value
    if name == "transport":
        between = sorted(name for name, kind in KINDS.items() if kind.between_processes)
        if value not in KINDS:
            raise fail(f"one of {between}")
        kind = KINDS[value]
        if not kind.between_processes:
            raise fail(
                f"a transport between processes ({kind.name!r} reaches peers in its own "
                f"process only, and engines run in processes of their own): one of {between}"
            )
        return value
    if name == "protocol":
        if value not in PROTOCOLS:
            raise fail('"auto", "tcp" or "rdma"')
        return value
    if name == "backend":
        if value not in ("auto", "torch", "triton"):
            raise fail('"auto", "torch" or "triton"')
        return value
    if name in ("side_channel_port", "bootstrap_port"):
        lowest = 0 if name == "side_channel_port" else 1
        if isinstance(value, bool) or not isinstance(value, int) or not lowest <= value <= 65535:
            what = "0 (any free port) or a port" if lowest == 0 else "a port"
            raise fail(f"{what} in {lowest or 1}..65535")
        return value
    if name == "bootstrap_address":
        if value is None:
            return None
        try:
            return bootstrap_url(value, f"kv_connector_extra_config[{name!r}]")
        except ValueError as exc:
            raise ValueError(str(exc)) from None
    if name in ("side_channel_host", "secret"):
        if not isinstance(value, str) and not (name == "secret" and value is None):
            raise fail("a string")
        return value
    default = getattr(defaults, name)
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise fail("true or false")
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise fail("a positive integer")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise fail("a positive number of seconds")
    return float(value)
