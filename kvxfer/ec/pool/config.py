"""The encoder-cache pool connector's configuration: one typed, checked table per role.

`ProducerSettings.from_config` and `ConsumerSettings.from_config` parse the dict that
`ECConnectorFactory.create` passes (under vLLM: `ec_connector_extra_config`, less
`KvxferECConnector`'s own keys). A key of either role is accepted, and checked, in either (one
config may serve the encoder and the prefill instance alike); a key neither role reads, a value
of the wrong type or out of range raises `ValueError` naming the key and what it accepts.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from kvxfer.transport.factory import DEFAULT_KIND, KINDS, transport_kind
from kvxfer.transport.mooncake import PROTOCOLS
from kvxfer.validation import check_host

WHERE = "PoolECConnector config"
_ADDRESS = re.compile(r"^tcp://[^\s/:]+:\d{1,5}$")
S = TypeVar("S", "ProducerSettings", "ConsumerSettings")


@dataclass(frozen=True)
class ProducerSettings:
    """An encoder-cache producer's keys.

    Attributes:
        host: where the side channel and the transport bind (127.0.0.1).
        port: the side channel's port (0: a free one; see the connector's `address`).
        pool_bytes: the registered pool's bytes (256 MiB); the least recently used items that
            no read pins are evicted to make room.
        secret: the shared secret consumers must prove ("": none, docs/encoder-cache.md,
            "Trust").
        transport: the transport's kind (`kvxfer.transport.factory.KINDS`; "mooncake"); its
            consumers must run the same kind.
        protocol: the Mooncake transport's protocol, "tcp" or "rdma".
        rdma_fallback: with "rdma", run TCP when this machine has no RDMA device.
        lease_s: the longest a consumer's read pins an item (30).
        max_leases: pinned reads per consumer session (64).
        session_timeout_s: an idle session is forgotten after this long (600); its consumer
            shakes hands again.
        max_sessions: consumer sessions open at once (256).
        load_workers: read by every connector's base class (4); a producer does not load.
    """

    host: str = "127.0.0.1"
    port: int = 0
    pool_bytes: int = 256 << 20
    secret: str = ""
    transport: str = DEFAULT_KIND
    protocol: str = "tcp"
    rdma_fallback: bool = False
    lease_s: float = 30.0
    max_leases: int = 64
    session_timeout_s: float = 600.0
    max_sessions: int = 256
    load_workers: int = 4

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None) -> ProducerSettings:
        """Parse and check a producer's config.

        Raises:
            ValueError: an unknown key, a value of the wrong type or out of range, naming the
                key and what it accepts.
        """
        return _parse(cls, config)


@dataclass(frozen=True)
class ConsumerSettings:
    """An encoder-cache consumer's keys.

    Attributes:
        producer_addresses: the producers' `address`es, "tcp://host:port" (required; one
            address may be given as a string).
        recv_bytes: the receive buffer's bytes (256 MiB), registered in one transport
            per producer.
        secret: the shared secret ("": none).
        timeout_s: one load from one producer (30).
        query_timeout_s: one round of queries to every producer (0.5).
        retry_after_s: how long a producer that did not answer is skipped (5; 0: never).
        fetch_workers: loads in flight per producer (4).
        load_workers: loads being located at once (4).
        close_timeout_s: how long `close` waits for reads from a frozen producer to settle (2).
        host: where this consumer's transports bind (127.0.0.1).
        transport: the transport's kind, its producers' (`kvxfer.transport.factory.KINDS`;
            "mooncake").
        protocol: the Mooncake transport's protocol, "tcp" or "rdma".
        rdma_fallback: with "rdma", run TCP when this machine has no RDMA device.
        name: this consumer's name in the producers' logs (default: host name and pid).
    """

    producer_addresses: tuple[str, ...] = ()
    recv_bytes: int = 256 << 20
    secret: str = ""
    timeout_s: float = 30.0
    query_timeout_s: float = 0.5
    retry_after_s: float = 5.0
    fetch_workers: int = 4
    load_workers: int = 4
    close_timeout_s: float = 2.0
    host: str = "127.0.0.1"
    transport: str = DEFAULT_KIND
    protocol: str = "tcp"
    rdma_fallback: bool = False
    name: str = ""

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None) -> ConsumerSettings:
        """Parse and check a consumer's config.

        Raises:
            ValueError: an unknown key, a value of the wrong type or out of range, no
                `producer_addresses`, naming the key and what it accepts.
        """
        settings = _parse(cls, config)
        if not settings.producer_addresses:
            raise ValueError(
                f"{WHERE}: a consumer needs producer_addresses (the producers' `address`, "
                "'tcp://host:port')"
            )
        if not settings.name:
            settings = dataclasses.replace(settings, name=f"{socket.gethostname()}:{os.getpid()}")
        return settings


def _keys(cls: type[Any]) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _parse(cls: type[S], config: Mapping[str, Any] | None) -> S:
    config = dict(config or {})
    unknown = sorted(set(config) - set(_keys(ProducerSettings)) - set(_keys(ConsumerSettings)))
    if unknown:
        raise ValueError(
            f"{WHERE}: unknown key(s) {unknown}; a producer reads {_keys(ProducerSettings)}, a "
            f"consumer reads {_keys(ConsumerSettings)}"
        )
    checked = {name: _CHECKS[name](name, value) for name, value in config.items()}
    return cls(**{name: value for name, value in checked.items() if name in _keys(cls)})


class _Refused(ValueError):
    """What a key accepts (the caller names the key and the value)."""


def _problem(name: str, value: object, accepts: str) -> ValueError:
    return ValueError(f"{WHERE}[{name!r}] = {value!r}; expected {accepts}")


def _checked(check: Callable[[Any], Any]) -> Callable[[str, Any], Any]:
    """A check of one value, raising `_Refused(accepts)`, as a check of one key."""

    def of_key(name: str, value: Any) -> Any:
        try:
            return check(value)
        except _Refused as refused:
            raise _problem(name, value, str(refused)) from None

    return of_key


@_checked
def _positive_bytes(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _Refused("a positive number of bytes, e.g. 268435456 for 256 MiB")
    return value


@_checked
def _positive_count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _Refused("a positive integer")
    return value


@_checked
def _seconds(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise _Refused("a positive number of seconds")
    return float(value)


@_checked
def _seconds_or_zero(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise _Refused("a number of seconds, 0 or more")
    return float(value)


@_checked
def _port(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise _Refused("0 (any free port) or a port in 1..65535")
    return value


@_checked
def _secret(value: Any) -> str:
    if value is not None and not isinstance(value, str):
        raise _Refused("a string (or null for none)")
    return value or ""


@_checked
def _protocol(value: Any) -> str:
    if value not in PROTOCOLS:
        raise _Refused(f'one of {list(PROTOCOLS)} ("tcp" works everywhere, "rdma" needs a NIC)')
    return str(value)


@_checked
def _transport(value: Any) -> str:
    try:
        return transport_kind(value).name
    except ValueError:
        raise _Refused(f"one of {sorted(KINDS)}") from None


@_checked
def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise _Refused("true or false")
    return value


@_checked
def _name(value: Any) -> str:
    if value is not None and not isinstance(value, str):
        raise _Refused("a string (or null for the host name and pid)")
    return value or ""


def _host(name: str, value: Any) -> str:
    return check_host(value, f"{WHERE}[{name!r}]")


def _addresses(name: str, value: Any) -> tuple[str, ...]:
    addresses = [value] if isinstance(value, str) else value
    if not isinstance(addresses, list | tuple):
        raise _problem(name, value, "a list of producer addresses, 'tcp://host:port'")
    for address in addresses:
        if not isinstance(address, str) or not _ADDRESS.match(address):
            raise ValueError(
                f"{WHERE}[{name!r}]: {address!r} is not a producer address; use the producer's "
                "`address`, 'tcp://host:port'"
            )
    return tuple(dict.fromkeys(addresses))  # each producer once, in the order given


_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "host": _host,
    "port": _port,
    "pool_bytes": _positive_bytes,
    "recv_bytes": _positive_bytes,
    "secret": _secret,
    "transport": _transport,
    "protocol": _protocol,
    "rdma_fallback": _flag,
    "lease_s": _seconds,
    "max_leases": _positive_count,
    "session_timeout_s": _seconds,
    "max_sessions": _positive_count,
    "load_workers": _positive_count,
    "producer_addresses": _addresses,
    "timeout_s": _seconds,
    "query_timeout_s": _seconds,
    "retry_after_s": _seconds_or_zero,
    "fetch_workers": _positive_count,
    "close_timeout_s": _seconds_or_zero,
    "name": _name,
}
