"""Transfer statistics: a record per fetch and the aggregate serving engines report for their
connectors (count, p50/p90 latency, throughput, failures), optionally as Prometheus metrics."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class TransferRecord:
    """One fetch on one decode rank."""

    request_id: str
    seconds: float
    nbytes: int
    num_ops: int
    strategy: str
    ok: bool


class TransferStats:
    """The last `max_records` transfers and their aggregate."""

    def __init__(self, max_records: int = 10_000) -> None:
        self._records: deque[TransferRecord] = deque(maxlen=max_records)
        self._lock = threading.Lock()
        self._prometheus: dict[str, Any] | None = None

    def record(self, record: TransferRecord) -> None:
        """Add one transfer."""
        with self._lock:
            self._records.append(record)
            metrics = self._prometheus
        if metrics is not None:
            outcome = "ok" if record.ok else "failed"
            metrics["transfers"].labels(outcome=outcome).inc()
            metrics["bytes"].inc(record.nbytes)
            metrics["ops"].inc(record.num_ops)
            metrics["seconds"].observe(record.seconds)

    @property
    def records(self) -> list[TransferRecord]:
        """The kept records, oldest first."""
        with self._lock:
            return list(self._records)

    def summary(self) -> dict[str, float | int]:
        """count, failures, p50_ms, p90_ms, bytes and MB/s (bytes over time of ok transfers)."""
        records = self.records
        ok = [r for r in records if r.ok]
        ms = np.array([r.seconds * 1e3 for r in records]) if records else np.zeros(1)
        seconds = sum(r.seconds for r in ok)
        nbytes = sum(r.nbytes for r in ok)
        return {
            "count": len(records),
            "failures": len(records) - len(ok),
            "p50_ms": float(np.percentile(ms, 50)),
            "p90_ms": float(np.percentile(ms, 90)),
            "bytes": nbytes,
            "mb_per_s": nbytes / seconds / 1e6 if seconds > 0 else 0.0,
        }

    def enable_prometheus(self, registry: Any = None, prefix: str = "kvxfer") -> None:
        """Export every later record as Prometheus metrics (needs `prometheus_client`).

        Metrics: `{prefix}_transfers_total{outcome}`, `{prefix}_transfer_bytes_total`,
        `{prefix}_transfer_ops_total`, `{prefix}_transfer_seconds` (histogram).
        """
        try:
            import prometheus_client as prom
        except ImportError as exc:
            raise ImportError("Prometheus export needs: pip install 'kvxfer[prometheus]'") from exc
        kwargs = {} if registry is None else {"registry": registry}
        metrics = {
            "transfers": prom.Counter(
                f"{prefix}_transfers", "KV transfers by outcome", ["outcome"], **kwargs
            ),
            "bytes": prom.Counter(f"{prefix}_transfer_bytes", "KV bytes received", **kwargs),
            "ops": prom.Counter(f"{prefix}_transfer_ops", "transport operations", **kwargs),
            "seconds": prom.Histogram(
                f"{prefix}_transfer_seconds", "KV transfer duration", **kwargs
            ),
        }
        with self._lock:
            self._prometheus = metrics
