"""Connectors: `KVProducer` on prefill ranks, `KVConsumer` on decode ranks."""

from kvxfer.connector.consumer import FetchHandle, KVConsumer, TransferResult
from kvxfer.connector.groups import (
    CacheGroup,
    GroupedConsumer,
    GroupedFetch,
    GroupedProducer,
    window_start,
)
from kvxfer.connector.producer import KVProducer
from kvxfer.connector.requests import ReleaseReason
from kvxfer.connector.stats import TransferRecord, TransferStats

__all__ = [
    "CacheGroup",
    "FetchHandle",
    "GroupedConsumer",
    "GroupedFetch",
    "GroupedProducer",
    "KVConsumer",
    "KVProducer",
    "ReleaseReason",
    "TransferRecord",
    "TransferResult",
    "TransferStats",
    "window_start",
]
