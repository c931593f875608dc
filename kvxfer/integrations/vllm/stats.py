"""The KV connector's transfer statistics, as vLLM aggregates and logs them, and as Prometheus
metrics on vLLM's `/metrics` endpoint (`KvxferPromMetrics`, built by vLLM through
`KvxferConnector.build_prom_metrics`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from kvxfer.connector import TransferResult
from kvxfer.connector.timeline import PHASES

# Per load on one decode rank. 1 ms (a few blocks on RDMA) to 60 s, then `fetch_timeout_s`'s
# default (300 s); vLLM's NIXL and Mooncake connectors use 5 ms to 5 s.
TRANSFER_SECONDS_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
)
# Transport operations (Mooncake descriptors) per load. kvxfer's pack strategies move a chunk
# in one operation per rank pair, so the low end is resolved finely; the top matches vLLM's
# NIXL and Mooncake buckets (up to 50k), which direct block-by-block copies reach.
DESCRIPTOR_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 10000, 50000)
# A request's phases (`kvxfer.connector.timeline.PHASES`): from 0.5 ms (a handoff between two
# scheduler steps) on, as the loads' own.
PHASE_SECONDS_BUCKETS = (0.0005, *TRANSFER_SECONDS_BUCKETS)


@dataclass
class KvxferConnectorStats(KVConnectorStats):
    """One interval's counts on one or more workers (a payload vLLM sends from its workers to
    its logging and metrics).

    `data` keys: `transfers` (finished loads on decode ranks, ok or not), `failures`, `bytes`
    (of the ok loads), `expired` (prefill ranks: requests released at `request_timeout_s`
    because not every decode rank reported done), `streamed` (prefill ranks: requests offered
    while their prefill computed, docs/vllm.md "Streaming the prefill"), and per ok load, in order,
    `transfer_seconds` and `descriptors` (transport operations). `timelines` (decode ranks):
    per finished load, `[vLLM's request id, its timeline]` (`kvxfer.connector.timeline`), for
    the decode scheduler, which adds its own events; `phases` (the decode scheduler): per
    request whose first token came, `[phase, seconds]` for each phase its timeline spans.
    """

    def __post_init__(self) -> None:
        # Own lists: vLLM aggregates payloads into the first one it builds from a dict.
        received = self.data
        self.reset()
        for key, value in received.items():
            self.data[key] = list(value) if isinstance(value, list) else value

    def reset(self) -> None:
        """Start a new interval."""
        self.data: dict[str, Any] = {
            "transfers": 0,
            "failures": 0,
            "bytes": 0,
            "expired": 0,
            "streamed": 0,
            "transfer_seconds": [],
            "descriptors": [],
            "timelines": [],
            "phases": [],
        }

    def record(self, result: TransferResult, request_id: str | None = None) -> None:
        """Count one finished load (of vLLM's `request_id`: its timeline is kept too)."""
        if request_id is not None and result.timeline:
            self.data["timelines"].append([request_id, dict(result.timeline)])
        self.data["transfers"] += 1
        if result.ok:
            self.data["bytes"] += result.bytes
            self.data["transfer_seconds"].append(result.seconds)
            self.data["descriptors"].append(result.num_ops)
        else:
            self.data["failures"] += 1

    def record_expired(self, count: int) -> None:
        """Count requests a prefill rank released at their deadline."""
        self.data["expired"] += count

    def record_phases(self, phases: dict[str, float]) -> None:
        """Add one request's phases (the decode scheduler, at its first token)."""
        self.data["phases"].extend([phase, seconds] for phase, seconds in phases.items())

    def record_streamed(self) -> None:
        """Count a request a prefill rank offered while computing it."""
        self.data["streamed"] += 1

    def aggregate(self, other: KVConnectorStats) -> KvxferConnectorStats:
        """Add another worker's (or interval's) counts."""
        for key, value in other.data.items():
            if isinstance(value, list):
                self.data.setdefault(key, []).extend(value)
            else:
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval's summary for vLLM's logger."""
        seconds = np.asarray(self.data["transfer_seconds"], dtype=np.float64)
        descriptors = np.asarray(self.data["descriptors"], dtype=np.float64)
        ok = len(seconds)
        total_seconds = float(seconds.sum())
        shares = [s for phase, s in self.data.get("phases", ()) if phase == "kvxfer"]
        return {
            "Transfers": self.data["transfers"],
            "Failed transfers": self.data["failures"],
            "Expired requests": self.data["expired"],
            "Streamed requests": self.data.get("streamed", 0),
            "MB moved": round(self.data["bytes"] / 1e6, 3),
            "Avg transfer ms": round(total_seconds / ok * 1e3, 3) if ok else 0.0,
            "P90 transfer ms": round(float(np.percentile(seconds, 90)) * 1e3, 3) if ok else 0.0,
            "Avg descriptors": round(float(descriptors.mean()), 1) if ok else 0.0,
            "Throughput MB/s": (
                round(self.data["bytes"] / total_seconds / 1e6, 3) if total_seconds else 0.0
            ),
            # What the transfer added once the KV was computed and asked for (phase `kvxfer`).
            "Avg kvxfer share ms": round(float(np.mean(shares)) * 1e3, 3) if shares else 0.0,
        }

    def is_empty(self) -> bool:
        """Whether nothing was recorded."""
        data = self.data
        return not (
            data["transfers"] or data["expired"] or data.get("streamed") or data.get("phases")
        )


class KvxferPromMetrics(KVConnectorPromMetrics):
    """kvxfer's Prometheus metrics, labelled per engine as vLLM labels its own (`model_name`,
    `engine`). Counters (exposed with `_total`):

    - `vllm:kvxfer_transfers`: finished loads, one per decode rank and request, ok or not;
    - `vllm:kvxfer_failed_transfers`: loads with blocks to recompute;
    - `vllm:kvxfer_transferred_bytes`: bytes of the ok loads;
    - `vllm:kvxfer_expired_requests`: prefill side: requests released at `request_timeout_s`
      before every decode rank reported done;
    - `vllm:kvxfer_streamed_requests`: prefill side: requests offered while their prefill
      computed (one per prefill rank and request).

    Histograms, per ok load: `vllm:kvxfer_transfer_time_seconds` and
    `vllm:kvxfer_num_descriptors` (transport operations); per request whose KV was loaded, at
    its first token, `vllm:kvxfer_request_phase_seconds{phase=...}`, one series per phase of
    its timeline (`kvxfer.connector.timeline.PHASES`: `kvxfer` is the transfer's share, from
    the later of the prefill's last layer and the decode's ask to the KV in its cache). A
    decode engine reports loads and phases, a prefill engine expired requests.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def counter(name: str, documentation: str) -> dict[int, Any]:
            metric = self._counter_cls(
                name=name, documentation=documentation, labelnames=labelnames
            )
            return create_metric_per_engine(metric, per_engine_labelvalues)

        # vLLM types the three classes alike (any of Gauge, Counter, Histogram); this one is
        # the Histogram (or vLLM's Ray wrapper of it), which takes buckets.
        histogram_cls: Any = self._histogram_cls

        def histogram(name: str, documentation: str, buckets: tuple[float, ...]) -> dict[int, Any]:
            metric = histogram_cls(
                name=name, documentation=documentation, buckets=buckets, labelnames=labelnames
            )
            return create_metric_per_engine(metric, per_engine_labelvalues)

        self.counters = {
            "transfers": counter(
                "vllm:kvxfer_transfers",
                "Finished kvxfer KV loads (one per decode rank and request), ok or failed.",
            ),
            "failures": counter(
                "vllm:kvxfer_failed_transfers",
                "kvxfer KV loads that left blocks to recompute.",
            ),
            "bytes": counter(
                "vllm:kvxfer_transferred_bytes",
                "Bytes moved by ok kvxfer KV loads.",
            ),
            "expired": counter(
                "vllm:kvxfer_expired_requests",
                "Requests whose KV a prefill rank released at request_timeout_s before every "
                "decode rank was done. NOTE: tracked on the prefill instance.",
            ),
            "streamed": counter(
                "vllm:kvxfer_streamed_requests",
                "Requests a prefill rank offered while computing them, layer by layer (one per "
                "prefill rank and request). NOTE: tracked on the prefill instance.",
            ),
        }
        self.histograms = {
            "transfer_seconds": histogram(
                "vllm:kvxfer_transfer_time_seconds",
                "Duration of ok kvxfer KV loads, per decode rank.",
                TRANSFER_SECONDS_BUCKETS,
            ),
            "descriptors": histogram(
                "vllm:kvxfer_num_descriptors",
                "Transport operations (Mooncake descriptors) per ok kvxfer KV load.",
                DESCRIPTOR_BUCKETS,
            ),
        }
        phase_metric = histogram_cls(
            name="vllm:kvxfer_request_phase_seconds",
            documentation=(
                "Where a P/D request's time went, per phase of its timeline (phase=kvxfer: "
                "the transfer's share). NOTE: tracked on the decode instance."
            ),
            buckets=PHASE_SECONDS_BUCKETS,
            labelnames=[*labelnames, "phase"],
        )
        self.phases = {
            engine: {phase: phase_metric.labels(*values, phase) for phase in PHASES}
            for engine, values in per_engine_labelvalues.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add one payload (`KvxferConnectorStats.data`) to engine `engine_idx`'s series."""
        phases = self.phases[engine_idx]
        for phase, seconds in transfer_stats_data.get("phases", ()):
            if phase in phases:
                phases[phase].observe(seconds)
        for key, per_engine in self.counters.items():
            count = transfer_stats_data.get(key, 0)
            if count:
                per_engine[engine_idx].inc(count)
        for key, per_engine in self.histograms.items():
            for value in transfer_stats_data.get(key, ()):
                per_engine[engine_idx].observe(value)
