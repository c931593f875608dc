"""Transports: move byte segments between registered memory regions.

`MooncakeTransport` (kvxfer.transport.mooncake) imports Mooncake lazily, on construction.
"""

from kvxfer.transport.base import (
    Peer,
    Region,
    TransferError,
    Transport,
    check_segments_in_regions,
)
from kvxfer.transport.local import LocalTransport
from kvxfer.transport.mooncake import MooncakeTransport

__all__ = [
    "LocalTransport",
    "MooncakeTransport",
    "Peer",
    "Region",
    "TransferError",
    "Transport",
    "check_segments_in_regions",
]
