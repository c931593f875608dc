"""Transports: move byte segments between registered memory regions."""

from kvxfer.transport.base import Region, TransferError, Transport, check_segments_in_regions
from kvxfer.transport.local import LocalTransport

__all__ = ["LocalTransport", "Region", "TransferError", "Transport", "check_segments_in_regions"]
