"""The transports by name: the `transport` setting picks one, and a connector creates it here.

A new transport (NIXL, say) is one module implementing `kvxfer.transport.base.Transport` and
one `TransportKind` in `KINDS`; nothing outside `kvxfer/transport/` names a transport class.
Both sides of a session must run the same kind: the producer's terms name its kind, and a
consumer of another kind refuses them (`check_peer_endpoint`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvxfer.addresses import check_transport_endpoint
from kvxfer.transport.base import Transport

DEFAULT_KIND = "mooncake"


@dataclass(frozen=True)
class TransportOptions:
    """What a connector asks of the transport it creates.

    Attributes:
        host: the address peers reach it at.
        protocol: the wire protocol, for kinds that have several (Mooncake: "tcp", "rdma").
        rdma_fallback: run TCP (with a warning) when RDMA is asked but unavailable.
        driven: no thread of its own; the owner calls `drive` every turn.
    """

    host: str = "127.0.0.1"
    protocol: str = "tcp"
    rdma_fallback: bool = False
    driven: bool = False


@dataclass(frozen=True)
class TransportKind:
    """One transport by name.

    Attributes:
        name: the `transport` setting's value, and every such transport's `kind`.
        create: a new transport with the given options.
        check_endpoint: checks a peer's endpoint of this kind (returns it, or raises
            ValueError naming the expected form).
        between_processes: whether peers in other processes are reached.
        check_available: raises when a transport of these options cannot start on this
            machine (its library or device missing), without starting one.
    """

    name: str
    create: Callable[[TransportOptions], Transport]
    check_endpoint: Callable[[object], str]
    between_processes: bool
    check_available: Callable[[TransportOptions], None] = lambda _options: None


def _mooncake(options: TransportOptions) -> Transport:
    from kvxfer.transport.mooncake import MooncakeTransport  # imports Mooncake itself lazily

    return MooncakeTransport(
        options.host,
        options.protocol,
        rdma_fallback=options.rdma_fallback,
        driven=options.driven,
    )


def _mooncake_available(options: TransportOptions) -> None:
    from kvxfer.transport.mooncake import check_mooncake_available

    check_mooncake_available(options.protocol, options.rdma_fallback)


def _local(options: TransportOptions) -> Transport:
    from kvxfer.transport.local import LocalTransport

    return LocalTransport(driven=options.driven)


def _check_local(endpoint: object) -> str:
    from kvxfer.transport.local import check_local_endpoint

    return check_local_endpoint(endpoint)


KINDS: dict[str, TransportKind] = {
    kind.name: kind
    for kind in (
        TransportKind(
            "mooncake",
            _mooncake,
            check_transport_endpoint,
            between_processes=True,
            check_available=_mooncake_available,
        ),
        TransportKind("local", _local, _check_local, between_processes=False),
    )
}
"""Every transport by name: Mooncake Transfer Engine (TCP or RDMA, between processes and
hosts), and the in-process `LocalTransport` (producer and consumer in one process: tests,
notebooks)."""


def transport_kind(name: object) -> TransportKind:
    """The transport named `name`.

    Raises:
        ValueError: an unknown name, listing the known ones.
    """
    if not isinstance(name, str) or name not in KINDS:
        raise ValueError(
            f"transport: {name!r} is not a transport kvxfer has; use one of {sorted(KINDS)}"
        )
    return KINDS[name]


def create_transport(
    name: str = DEFAULT_KIND, options: TransportOptions | None = None
) -> Transport:
    """A new transport of kind `name`.

    Raises:
        ValueError: an unknown name or a bad option.
        TransferError: the transport could not start (Mooncake's own errors, named).
    """
    return transport_kind(name).create(options or TransportOptions())


def check_transport_available(name: str, options: TransportOptions) -> None:
    """Fail at start when a transport of kind `name` with `options` cannot run here, for a
    connector that creates its transports later (`TransportKind.check_available`).

    Raises:
        ValueError: an unknown name.
        ImportError: the transport's library is not installed.
        TransferError: a device it needs is missing.
    """
    transport_kind(name).check_available(options)


def check_peer_endpoint(own_kind: str, peer_kind: str, endpoint: object) -> str:
    """Check that a peer's transport is of this side's kind and its endpoint one of it.

    Returns:
        The endpoint, unchanged.

    Raises:
        ValueError: another kind (naming both and the fix), or a malformed endpoint.
    """
    if peer_kind != own_kind:
        raise ValueError(
            f"its transport is {peer_kind!r} and this side's is {own_kind!r}; set the same "
            "`transport` on both sides"
        )
    return transport_kind(own_kind).check_endpoint(endpoint)
