"""Transports: move byte segments between registered memory regions.

Connectors create them by name (`create_transport`, `KINDS`: kvxfer.transport.factory).
`MooncakeTransport` (kvxfer.transport.mooncake) imports Mooncake lazily, on construction.
"""

from kvxfer.transport.base import (
    Peer,
    Region,
    TransferError,
    Transport,
    check_segments_in_regions,
)
from kvxfer.transport.factory import KINDS, TransportOptions, create_transport
from kvxfer.transport.local import LocalTransport
from kvxfer.transport.mooncake import MooncakeTransport

__all__ = [
    "KINDS",
    "LocalTransport",
    "MooncakeTransport",
    "Peer",
    "Region",
    "TransferError",
    "Transport",
    "TransportOptions",
    "check_segments_in_regions",
    "create_transport",
]
