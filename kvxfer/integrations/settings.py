"""The connector settings a serving engine passes to kvxfer (vLLM: `kv_connector_extra_config`).

Kept free of any engine import so that the keys, their defaults and their checks are one
table, documented in the README and tested without the engine installed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from kvxfer.plan import STRATEGIES, CostModel

_COST_PRESETS = {"rdma": CostModel, "tcp_loopback": CostModel.tcp_loopback}


@dataclass(frozen=True)
class ConnectorSettings:
    """Every extra-config key, its type and default.

    Attributes:
        side_channel_host: address the prefill ranks' side channels and transports bind to, and
            that decode engines are told to reach (default 127.0.0.1: set the node's address).
        side_channel_port: base port; prefill TP rank `r` listens on `side_channel_port + r`.
        protocol: Mooncake transport, "tcp" or "rdma".
        strategy: force one strategy for every rank pair ("direct", "pack", "unpack",
            "pack+unpack"); default: the cost model chooses per pair at handshake.
        cost_model: a preset name ("rdma", "tcp_loopback") or a dict of `CostModel` fields.
        secret: shared secret decode ranks present at handshake.
        request_timeout_s: longest time a prefill engine holds a finished request's blocks
            for decode engines before freeing them.
        fetch_timeout_s: longest time one request's load may take on a decode rank (connecting
            to its prefill engine included); its unfinished blocks are then reported as load
            errors (vLLM recomputes them).
        handshake_timeout_s: longest wait for a prefill engine's ranks to answer a handshake
            (a connect runs off the engine's step, on a thread per prefill engine: loads from
            other prefill engines go on meanwhile).
        staging_bytes, staging_slots: staging pool per remote rank, and chunks in flight.
        backend: pack/unpack backend, "auto", "torch" or "triton".
    """

    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 5700
    protocol: str = "tcp"
    strategy: str | None = None
    cost_model: CostModel = field(default_factory=CostModel)
    secret: str | None = None
    request_timeout_s: float = 120.0
    fetch_timeout_s: float = 60.0
    handshake_timeout_s: float = 10.0
    staging_bytes: int = 32 << 20
    staging_slots: int = 4
    backend: str = "auto"

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
        return cls(**values)


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
    if name == "protocol":
        if value not in ("tcp", "rdma"):
            raise fail('"tcp" or "rdma"')
        return value
    if name == "backend":
        if value not in ("auto", "torch", "triton"):
            raise fail('"auto", "torch" or "triton"')
        return value
    if name in ("side_channel_host", "secret"):
        if not isinstance(value, str) and not (name == "secret" and value is None):
            raise fail("a string")
        return value
    default = getattr(defaults, name)
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise fail("a positive integer")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise fail("a positive number of seconds")
    return float(value)
