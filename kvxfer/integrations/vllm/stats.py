"""The KV connector's transfer statistics, as vLLM aggregates and logs them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvxfer.connector import TransferResult

if TYPE_CHECKING:
    pass


@dataclass
class KvxferConnectorStats(KVConnectorStats):
    """Counts of one interval on one or more decode workers: transfers, failures, bytes and
    seconds of the ok ones."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        """Start a new interval."""
        self.data = {"transfers": 0, "failures": 0, "bytes": 0, "seconds": 0.0}

    def record(self, result: TransferResult) -> None:
        """Count one finished load."""
        self.data["transfers"] += 1
        if result.ok:
            self.data["bytes"] += result.bytes
            self.data["seconds"] += result.seconds
        else:
            self.data["failures"] += 1

    def aggregate(self, other: KVConnectorStats) -> KvxferConnectorStats:
        """Add another worker's (or interval's) counts."""
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval's summary for vLLM's logger."""
        ok = self.data["transfers"] - self.data["failures"]
        seconds = self.data["seconds"]
        return {
            "Transfers": self.data["transfers"],
            "Failed transfers": self.data["failures"],
            "MB moved": round(self.data["bytes"] / 1e6, 3),
            "Avg transfer ms": round(seconds / ok * 1e3, 3) if ok else 0.0,
            "Throughput MB/s": round(self.data["bytes"] / seconds / 1e6, 3) if seconds else 0.0,
        }

    def is_empty(self) -> bool:
        """Whether nothing was recorded."""
        return self.data["transfers"] == 0
