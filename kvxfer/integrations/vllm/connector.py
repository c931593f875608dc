"""`KvxferConnector`: the facade vLLM instantiates once per role; it hands every call to the
scheduler side or the worker side."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvxfer.integrations.settings import ConnectorSettings
from kvxfer.integrations.vllm.logs import log_through_vllm
from kvxfer.integrations.vllm.metadata import KvxferConnectorMetadata
from kvxfer.integrations.vllm.scheduler import SchedulerSide
from kvxfer.integrations.vllm.stats import KvxferConnectorStats, KvxferPromMetrics
from kvxfer.integrations.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class KvxferConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector over kvxfer, for both roles (`kv_producer`, `kv_consumer`, `kv_both`).

    It supports vLLM's hybrid memory allocator (`SupportsHMA`): full-attention and
    sliding-window KV cache groups, each moved with its own block table, a window group only
    inside its window.

    The scheduler-side instance decides what moves (`SchedulerSide`); each worker-side
    instance moves its rank's heads (`WorkerSide`). Settings come from
    `kv_connector_extra_config` (`ConnectorSettings`).
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        log_through_vllm()
        transfer = self._kv_transfer_config
        settings = ConnectorSettings.from_extra_config(transfer.kv_connector_extra_config)
        engine_id = str(transfer.engine_id)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(
                vllm_config,
                settings,
                engine_id,
                produces=bool(transfer.is_kv_producer),
                kv_cache_config=kv_cache_config,
            )
        else:
            self._worker = WorkerSide(
                vllm_config,
                kv_cache_config,
                settings,
                engine_id,
                produces=bool(transfer.is_kv_producer),
                consumes=bool(transfer.is_kv_consumer),
            )

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """None: kvxfer reads any layout from the registered tensors."""
        return None

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KvxferConnectorStats | None:
        """Rebuild worker stats on the logging side."""
        return KvxferConnectorStats(data=dict(data)) if data is not None else None

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KvxferPromMetrics:
        """kvxfer's counters and histograms on vLLM's Prometheus endpoint (`KvxferPromMetrics`)."""
        return KvxferPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---- scheduler side ----

    def on_new_request(self, request: Request) -> None:
        """A hybrid model's prefill computes all but the last prompt token (its recurrent
        state is handed over as it is after `N - 1` tokens)."""
        if self._scheduler is not None:
            self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Remote prefill: the whole prompt beyond the local prefix hit, loaded async."""
        return self._scheduler_side().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Record the load of a remote prefill into the blocks just allocated."""
        self._scheduler_side().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's loads and sends (a streamed prefill's among them, as it is scheduled)."""
        return self._scheduler_side().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Note the loads every worker finished (they need no abort any more)."""
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Prefill side: keep the blocks until decoders are done; hand back the params.
        Decode side: a request finished before its KV was loaded is aborted on the prefill
        engine, which frees its blocks at once."""
        return self._scheduler_side().request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """`request_finished` with the hybrid allocator: one block table per KV cache group."""
        return self._scheduler_side().request_finished(request, block_ids)

    # ---- worker side ----

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Read this rank's geometry from its layer tensors; start serving (prefill)."""
        self._worker_side().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Start this step's fetches and publish this step's finished prefills."""
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KvxferConnectorMetadata)
        self._worker_side().start_step(metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing: loads are whole-request and asynchronous."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """An attention layer wrote this step's KV: the requests offered while computing
        (streamed) have that layer ready, and decode ranks read it while the next layers
        compute. No copy is saved: decode ranks read the cache itself."""
        self._worker_side().layer_saved(layer_name)

    def wait_for_save(self) -> None:
        """The step's forward pass is done: its streamed requests are ready in every layer."""
        self._worker_side().step_saved()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(requests decoders are done with, requests whose load finished, ok or not); a
        failed load's blocks come back through `get_block_ids_with_load_errors`."""
        sending, recving, _ = self._worker_side().transfer_results(finished_req_ids, False)
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """What vLLM asks after each forward pass: `get_finished`'s sets, and the loads that
        failed whole (also among the finished). A model with several KV cache groups reports a
        failed load per request, not per block: vLLM refuses block ids then (they repeat
        across groups), and recomputes or fails the request by its `kv_load_failure_policy`."""
        sending, recving, failed = self._worker_side().transfer_results(finished_req_ids, True)
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving, failed_recving=failed
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of finished loads that did not arrive; vLLM recomputes them."""
        return self._worker_side().take_load_errors()

    def get_kv_connector_stats(self) -> KvxferConnectorStats | None:
        """A worker's load counts since the last call; the scheduler's: the phases of the
        requests whose first token came (None if nothing happened)."""
        if self._worker is not None:
            return self._worker.take_stats()
        if self._scheduler is None:
            return None
        finished = self._scheduler.take_phases()
        if not finished:
            return None
        stats = KvxferConnectorStats()
        for phases in finished:
            stats.record_phases(phases)
        return stats

    def shutdown(self) -> None:
        """Close the worker's producer and consumers (unregistering from the bootstrap
        service first); stop the scheduler's bootstrap service, if it runs one."""
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()

    def _scheduler_side(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("KvxferConnector: a scheduler-side call on a worker connector")
        return self._scheduler

    def _worker_side(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("KvxferConnector: a worker-side call on a scheduler connector")
        return self._worker
