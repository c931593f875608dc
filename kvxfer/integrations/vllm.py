"""kvxfer inside vLLM: `KvxferConnector` (KV cache, P/D disaggregation) and
`KvxferECConnector` (encoder cache). Needs `pip install 'kvxfer[vllm]'`; the rest of kvxfer never
imports vLLM.

Load it with::

    --kv-transfer-config '{"kv_connector": "KvxferConnector",
                           "kv_connector_module_path": "kvxfer.integrations.vllm",
                           "kv_role": "kv_producer", "kv_connector_extra_config": {...}}'

P/D flow (the conventions of vLLM's own P/D connectors):
1. The proxy sends a request to the prefill engine with `kv_transfer_params =
   {"do_remote_decode": true}` and `max_tokens = 1`.
2. When it finishes, `request_finished` keeps its blocks (delayed free) and returns the
   parameters the decode engine needs: `do_remote_prefill`, `remote_engine_id`,
   `remote_request_id`, `remote_host`, `remote_port`, `remote_block_ids`, `remote_num_tokens`,
   `tp_size`. The next step's metadata tells every prefill worker to publish the request on
   its `KVProducer`.
3. The proxy sends the request to the decode engine with those parameters. Its scheduler
   reports the prompt as externally computed and loaded asynchronously; every decode worker
   fetches its heads with a `KVConsumer` (one per remote engine, connected to every prefill
   rank at `remote_port + rank` on first use, strategies planned per rank pair then).
4. A finished fetch is reported through `get_finished`; blocks that failed come back through
   `get_block_ids_with_load_errors`, so vLLM recomputes exactly them. Once every decode rank
   reported done (or `request_timeout_s` passed), each prefill worker reports the request as
   finished sending and vLLM frees its blocks.

Any KV cache layout on either side works: the geometry is read from the registered tensors
(`kvxfer.integrations.kv_tensors`), so `get_required_kvcache_layout` asks for none.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvxfer.connector import KVConsumer, KVProducer, TransferResult
from kvxfer.integrations.kv_tensors import EngineGeometry, spec_from_layers
from kvxfer.integrations.settings import ConnectorSettings
from kvxfer.plan.layout import blocks_of_tokens
from kvxfer.spec import KVCacheSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

_REMOTE_KEYS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "tp_size")


# ---- scheduler -> worker metadata -------------------------------------------------------------


@dataclass
class LoadSpec:
    """A decode worker's order: fetch tokens `[start_token, num_tokens)` of a remote request."""

    request_id: str
    remote_request_id: str
    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_tp_size: int
    block_ids: list[int]
    num_tokens: int
    start_token: int


@dataclass
class SendSpec:
    """A prefill worker's order: offer tokens `[0, num_tokens)` in `block_ids` to decoders."""

    request_id: str
    block_ids: list[int]
    num_tokens: int


@dataclass
class KvxferConnectorMetadata(KVConnectorMetadata):
    """What one step asks of every worker."""

    loads: list[LoadSpec] = field(default_factory=list)
    sends: list[SendSpec] = field(default_factory=list)


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


# ---- the connector ----------------------------------------------------------------------------


class KvxferConnector(KVConnectorBase_V1):
    """vLLM KV connector over kvxfer, for both roles (`kv_producer`, `kv_consumer`, `kv_both`).

    The scheduler-side instance decides what moves (`_SchedulerSide`); each worker-side
    instance moves its rank's heads (`_WorkerSide`). Settings come from
    `kv_connector_extra_config` (`ConnectorSettings`).
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        transfer = self._kv_transfer_config
        settings = ConnectorSettings.from_extra_config(transfer.kv_connector_extra_config)
        engine_id = str(transfer.engine_id)
        self._scheduler: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = _SchedulerSide(vllm_config, settings, engine_id)
        else:
            self._worker = _WorkerSide(
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

    # ---- scheduler side ----

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
        """This step's loads and sends."""
        return self._scheduler_side().build_connector_meta()

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Prefill side: keep the blocks until decoders are done; hand back the params."""
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
        """Nothing: no copy is saved; a prefill rank writes from its cache when decode ranks
        ask for the request (after `request_finished`)."""

    def wait_for_save(self) -> None:
        """Nothing: see `save_kv_layer`."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(requests decoders are done with, requests whose load finished, ok or not)."""
        return self._worker_side().get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of finished loads that did not arrive; vLLM recomputes them."""
        return self._worker_side().take_load_errors()

    def get_kv_connector_stats(self) -> KvxferConnectorStats | None:
        """A worker's load counts since the last call (None if none, and on the scheduler,
        which vLLM also asks)."""
        return None if self._worker is None else self._worker.take_stats()

    def shutdown(self) -> None:
        """Close the worker's producer and consumers; nothing to do on the scheduler."""
        if self._worker is not None:
            self._worker.close()

    def _scheduler_side(self) -> _SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("KvxferConnector: a scheduler-side call on a worker connector")
        return self._scheduler

    def _worker_side(self) -> _WorkerSide:
        if self._worker is None:
            raise RuntimeError("KvxferConnector: a worker-side call on a scheduler connector")
        return self._worker


class _SchedulerSide:
    """Turns requests' `kv_transfer_params` into loads (decode) and sends (prefill)."""

    def __init__(self, vllm_config: VllmConfig, settings: ConnectorSettings, engine_id: str):
        self._settings = settings
        self._engine_id = engine_id
        self._tp_size = vllm_config.parallel_config.tensor_parallel_size
        self._loads: list[LoadSpec] = []
        self._sends: list[SendSpec] = []

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        missing = [key for key in _REMOTE_KEYS if params.get(key) is None]
        if missing:
            # A malformed request must not take the engine down: it is prefilled here instead.
            log.warning(
                "request %s: kv_transfer_params lack %s; computing its prompt locally",
                request.request_id,
                missing,
            )
            params["do_remote_prefill"] = False
            return 0, False
        count = _remote_tokens(request) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # one transfer per request
        if num_external_tokens <= 0:
            # A full local prefix hit: nothing to move; the prefill engine frees the request's
            # blocks at its request_timeout_s.
            return
        num_tokens = _remote_tokens(request)
        self._loads.append(
            LoadSpec(
                request_id=request.request_id,
                remote_request_id=str(params["remote_request_id"]),
                remote_engine_id=str(params["remote_engine_id"]),
                remote_host=str(params["remote_host"]),
                remote_port=int(params["remote_port"]),
                remote_tp_size=int(params["tp_size"]),
                block_ids=[int(b) for b in blocks.get_block_ids()[0]],
                num_tokens=num_tokens,
                start_token=num_tokens - num_external_tokens,
            )
        )

    def build_connector_meta(self) -> KvxferConnectorMetadata:
        metadata = KvxferConnectorMetadata(loads=self._loads, sends=self._sends)
        self._loads, self._sends = [], []
        return metadata

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if not params or not params.get("do_remote_decode"):
            return False, None
        finished_normally = request.status in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        )
        if not finished_normally or not block_ids or request.num_computed_tokens <= 0:
            return False, None  # aborted or empty: nothing to hand over, free now
        num_tokens = request.num_computed_tokens
        self._sends.append(SendSpec(request.request_id, [int(b) for b in block_ids], num_tokens))
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self._engine_id,
            "remote_request_id": request.request_id,
            "remote_host": self._settings.side_channel_host,
            "remote_port": self._settings.side_channel_port,
            "remote_block_ids": [int(b) for b in block_ids],
            "remote_num_tokens": num_tokens,
            "tp_size": self._tp_size,
        }


def _remote_tokens(request: Request) -> int:
    """Prompt tokens the prefill engine holds KV for."""
    params = request.kv_transfer_params or {}
    prompt = len(request.prompt_token_ids or [])
    remote = params.get("remote_num_tokens")
    return min(prompt, int(remote)) if remote is not None else prompt


class _WorkerSide:
    """One TP rank: a `KVProducer` (prefill) and `KVConsumer`s per remote engine (decode)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig | None,
        settings: ConnectorSettings,
        engine_id: str,
        *,
        produces: bool,
        consumes: bool,
    ) -> None:
        self._settings = settings
        self._engine_id = engine_id
        self._geometry = _engine_geometry(vllm_config, kv_cache_config)
        self._produces, self._consumes = produces, consumes
        self._spec: KVCacheSpec | None = None
        self._caches: list[torch.Tensor] = []
        self._producer: KVProducer | None = None
        self._consumers: dict[str, KVConsumer] = {}
        self._consumers_lock = threading.Lock()
        self._loads: ThreadPoolExecutor | None = None
        self._loading: dict[str, Future[TransferResult]] = {}
        self._released: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._unreported_releases: set[str] = set()
        self._published: set[str] = set()
        self._finished_seen: set[str] = set()  # published requests vLLM said are finished
        self._load_errors: set[int] = set()
        self._stats = KvxferConnectorStats()

    @property
    def tp_rank(self) -> int:
        """This worker's tensor-parallel rank."""
        return self._geometry.tp_rank

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        spec, self._caches = spec_from_layers(list(kv_caches.values()), self._geometry)
        self._spec = spec
        log.info("kvxfer rank %d: %s", self.tp_rank, spec)
        if self._produces:
            s = self._settings
            self._producer = KVProducer(
                spec,
                self._caches,
                self._engine_id,
                s.side_channel_host,
                s.side_channel_port + self.tp_rank,
                release=self._released.put,
                secret=s.secret,
                protocol=s.protocol,
                staging_bytes=s.staging_bytes,
                staging_slots=s.staging_slots,
                request_timeout_s=s.request_timeout_s,
                write_timeout_s=s.write_timeout_s,
                backend=s.backend,
            )
        if self._consumes:
            self._loads = ThreadPoolExecutor(8, thread_name_prefix="kvxfer-vllm-load")

    def start_step(self, metadata: KvxferConnectorMetadata) -> None:
        for send in metadata.sends:
            if self._producer is None:
                raise RuntimeError(
                    "KvxferConnector: asked to send KV but this engine's kv_role is not "
                    "kv_producer or kv_both"
                )
            self._producer.publish(send.request_id, send.block_ids, send.num_tokens)
            self._published.add(send.request_id)
        for load in metadata.loads:
            if self._loads is None:
                raise RuntimeError(
                    "KvxferConnector: asked to load KV but this engine's kv_role is not "
                    "kv_consumer or kv_both"
                )
            self._loading[load.request_id] = self._loads.submit(self._load, load)

    def _load(self, load: LoadSpec) -> TransferResult:
        try:
            consumer = self._consumer_for(load)
            return consumer.fetch(
                load.remote_request_id,
                load.block_ids,
                load.num_tokens,
                load.start_token,
                timeout=self._settings.fetch_timeout_s,
            ).wait()
        except Exception as exc:  # unreachable or incompatible prefill: every block fails
            log.warning(
                "kvxfer: load of %s from engine %s failed before any transfer: %s",
                load.request_id,
                load.remote_engine_id,
                exc,
            )
            failed = blocks_of_tokens(
                load.block_ids, self._geometry.block_size, load.start_token, load.num_tokens
            )
            return TransferResult(False, failed, 0, 0, "", 0.0, [f"{type(exc).__name__}: {exc}"])

    def _consumer_for(self, load: LoadSpec) -> KVConsumer:
        with self._consumers_lock:
            consumer = self._consumers.get(load.remote_engine_id)
            if consumer is not None:
                return consumer
            assert self._spec is not None, "register_kv_caches() comes first"
            s = self._settings
            consumer = KVConsumer(
                self._spec,
                self._caches,
                self._engine_id,
                s.side_channel_host,
                secret=s.secret,
                protocol=s.protocol,
                staging_bytes=s.staging_bytes,
                staging_slots=s.staging_slots,
                cost_model=s.cost_model,
                strategy=s.strategy,
                backend=s.backend,
                timeout_s=s.fetch_timeout_s,
            )
            addresses = [
                f"tcp://{load.remote_host}:{load.remote_port + rank}"
                for rank in range(load.remote_tp_size)
            ]
            try:
                consumer.connect(addresses, timeout=s.handshake_timeout_s)
            except Exception:
                consumer.close()
                raise
            self._consumers[load.remote_engine_id] = consumer
            return consumer

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # vLLM accepts a finished send only for a request it has told this worker is finished
        # (it always has, in the step that publishes; kept as a guard). Only published ids are
        # remembered, so the sets stay as small as the requests in flight.
        self._finished_seen.update(finished_req_ids & self._published)
        while True:
            try:
                self._unreported_releases.add(self._released.get_nowait())
            except queue.Empty:
                break
        sending = self._unreported_releases & self._finished_seen
        self._unreported_releases -= sending
        self._finished_seen -= sending
        self._published -= sending
        recving = set()
        for request_id, future in list(self._loading.items()):
            if not future.done():
                continue
            del self._loading[request_id]
            result = future.result()
            self._stats.record(result)
            if not result.ok:
                log.warning(
                    "kvxfer: load of %s failed, %d blocks to recompute: %s",
                    request_id,
                    len(result.failed_block_ids),
                    "; ".join(result.errors),
                )
                self._load_errors.update(result.failed_block_ids)
            recving.add(request_id)
        return sending or None, recving or None

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_stats(self) -> KvxferConnectorStats | None:
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, KvxferConnectorStats()
        return stats

    def close(self) -> None:
        if self._loads is not None:
            self._loads.shutdown(wait=True, cancel_futures=True)
        for consumer in self._consumers.values():
            consumer.close()
        self._consumers.clear()
        if self._producer is not None:
            self._producer.close()
            self._producer = None


def _engine_geometry(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None
) -> EngineGeometry:
    """This rank's geometry from vLLM's configuration (model, cache, parallel)."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    block_size = vllm_config.cache_config.block_size
    if kv_cache_config is not None and kv_cache_config.kv_cache_groups:
        block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
    return EngineGeometry(
        total_kv_heads=1 if model.use_mla else model.get_total_num_kv_heads(),
        head_dim=model.get_head_size(),
        block_size=block_size,
        tp_size=parallel.tensor_parallel_size,
        tp_rank=_tp_rank(vllm_config),
        mla=bool(model.use_mla),
    )


def _tp_rank(vllm_config: VllmConfig) -> int:
    """vLLM's TP group rank when it is initialized, else the worker's rank in its config."""
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return int(parallel_state.get_tensor_model_parallel_rank())
    parallel = vllm_config.parallel_config
    return int(parallel.rank) % parallel.tensor_parallel_size


# ---- encoder cache ----------------------------------------------------------------------------


@dataclass
class KvxferECConnectorMetadata(ECConnectorMetadata):
    """Encoder outputs (by multimodal hash) a consumer worker loads this step."""

    mm_hashes: list[str] = field(default_factory=list)


class KvxferECConnector(ECConnectorBase):
    """vLLM encoder-cache connector over a `kvxfer.ec` connector (EPD disaggregation).

    Load it with `--ec-transfer-config '{"ec_connector": "KvxferECConnector",
    "ec_connector_module_path": "kvxfer.integrations.vllm", "ec_role": "ec_producer" |
    "ec_consumer", "ec_connector_extra_config": {"backend": "MooncakeECConnector", ...}}'`.

    `backend` names a `kvxfer.ec.ECConnectorFactory` connector ("MooncakeECConnector", the
    default, or "SharedStorageECConnector"; with `backend_module_path`, a class of one's own);
    every other extra-config key is that connector's config (README). The
    encoder instance (`ec_producer`) stores each item's output from TP rank 0 (outputs are
    replicated across ranks); a prefill instance (`ec_consumer`) asks for items in its
    scheduler (`has_cache_item`) and loads them on every rank before the forward pass.
    """

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config, role)
        config = vllm_config.ec_transfer_config
        assert config is not None  # the base class refuses to start without it
        extra = dict(config.ec_connector_extra_config or {})
        self._backend = str(extra.pop("backend", "MooncakeECConnector"))
        self._backend_module = extra.pop("backend_module_path", None)
        self._backend_config = extra
        if self.is_producer and self.is_consumer:
            raise ValueError(
                "KvxferECConnector: ec_role 'ec_both' is not supported; run the encoder "
                "instance with 'ec_producer' and the prefill instance with 'ec_consumer'"
            )
        self._device = vllm_config.device_config.device
        self._loads: list[str] = []
        self._ec: Any = None
        self._ec_lock = threading.Lock()
        saves_here = role == ECConnectorRole.WORKER and _tp_rank(vllm_config) == 0
        if self.is_producer and saves_here:
            self._ec = self._connector("producer")

    def _connector(self, kvxfer_role: str) -> Any:
        from kvxfer.ec import ECConnectorFactory

        return ECConnectorFactory.create(
            self._backend, kvxfer_role, self._backend_config, module_path=self._backend_module
        )

    def _consumer(self) -> Any:
        with self._ec_lock:  # created on first use, in the scheduler and in each worker
            if self._ec is None:
                self._ec = self._connector("consumer")
            return self._ec

    # ---- scheduler side ----

    def has_cache_item(self, identifier: str) -> bool:
        """Consumer: whether a producer holds the item. Producer: False (it encodes)."""
        return self.is_consumer and bool(self._consumer().has(identifier))

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        """Consumer: load the item into the slot just allocated if a producer holds it."""
        identifier = request.mm_features[index].identifier
        if self.has_cache_item(identifier):
            self._loads.append(identifier)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        """This step's loads."""
        metadata = KvxferECConnectorMetadata(mm_hashes=self._loads)
        self._loads = []
        return metadata

    # ---- worker side ----

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        """Load this step's items that the worker's encoder cache lacks.

        Raises:
            kvxfer.ec.ECLoadError: an item the scheduler saw is gone (evicted, producer down).
        """
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KvxferECConnectorMetadata)
        missing = [h for h in metadata.mm_hashes if h not in encoder_cache]
        if not missing:
            return
        encoder_cache.update(self._consumer().start_load(missing, self._device).wait())

    def save_caches(
        self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any
    ) -> None:
        """Producer, TP rank 0: store one item's encoder output."""
        if self._ec is not None and self.is_producer:
            self._ec.save(mm_hash, encoder_cache[mm_hash])

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Consumer: the request's items are no longer needed from the producer."""
        if self.is_consumer and self._ec is not None:
            for feature in request.mm_features or []:
                self._ec.release(feature.identifier)
        return False, None

    def shutdown(self) -> None:
        """Close the kvxfer connector."""
        if self._ec is not None:
            self._ec.close()
            self._ec = None
