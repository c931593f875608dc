"""Connectors: `KVProducer` on prefill ranks, `KVConsumer` on decode ranks."""

from kvxfer.connector.consumer import FetchHandle, KVConsumer, TransferResult
from kvxfer.connector.producer import KVProducer
from kvxfer.connector.stats import TransferRecord, TransferStats

__all__ = [
    "FetchHandle",
    "KVConsumer",
    "KVProducer",
    "TransferRecord",
    "TransferResult",
    "TransferStats",
]
