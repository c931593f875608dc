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
   rank at `remote_port + rank` on first use, off the engine's step, strategies planned per
   rank pair then; connected again when a load names other addresses: a restarted engine).
4. A finished fetch is reported through `get_finished`; blocks that failed come back through
   `get_block_ids_with_load_errors`, so vLLM recomputes exactly them. Once every decode rank
   reported done (or `request_timeout_s` passed), each prefill worker reports the request as
   finished sending and vLLM frees its blocks.
5. A decode request that vLLM finishes before its KV was loaded (aborted while waiting or
   loading, or a full local prefix hit) is aborted on the prefill engine through the next
   step's metadata (`KVConsumer.abort`), which frees its blocks at once, as vLLM's NIXL
   connector does.

Any KV cache layout on either side works: the geometry is read from the registered tensors
(`kvxfer.integrations.kv_tensors`), so `get_required_kvcache_layout` asks for none.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import tempfile
import threading
import time
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

from kvxfer.connector import FetchHandle, KVConsumer, KVProducer, TransferResult
from kvxfer.ec import ECLoadError, item_key
from kvxfer.integrations.kv_tensors import EngineGeometry, spec_from_layers
from kvxfer.integrations.settings import ConnectorSettings
from kvxfer.plan.layout import blocks_of_tokens
from kvxfer.spec import KVCacheSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
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
class AbortSpec:
    """A decode worker's order: vLLM finished a request before its KV was loaded (aborted,
    or finished while waiting). The worker gives up its load, if one runs, and tells the
    prefill engine, which frees the request's blocks at once."""

    request_id: str
    remote_request_id: str
    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_tp_size: int


@dataclass
class KvxferConnectorMetadata(KVConnectorMetadata):
    """What one step asks of every worker."""

    loads: list[LoadSpec] = field(default_factory=list)
    sends: list[SendSpec] = field(default_factory=list)
    aborts: list[AbortSpec] = field(default_factory=list)


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
        self._aborts: list[AbortSpec] = []
        self._loading: dict[str, AbortSpec] = {}  # loads not finished on every worker yet

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
        remote = _abort_spec(request.request_id, params)
        if num_external_tokens <= 0:
            # A full local prefix hit: nothing to move; the prefill engine frees its blocks.
            self._aborts.append(remote)
            return
        self._loading[request.request_id] = remote
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
        metadata = KvxferConnectorMetadata(
            loads=self._loads, sends=self._sends, aborts=self._aborts
        )
        self._loads, self._sends, self._aborts = [], [], []
        return metadata

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for request_id in output.finished_recving or ():
            self._loading.pop(request_id, None)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if not params:
            return False, None
        if not params.get("do_remote_decode"):
            self._abort_if_not_loaded(request, params)
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

    def _abort_if_not_loaded(self, request: Request, params: dict[str, Any]) -> None:
        """Decode side: a request finished before its KV was loaded (as vLLM's NIXL connector
        does, tell the prefill engine to free its blocks now, not at its request_timeout_s).
        While its load runs, vLLM keeps the blocks until the workers report it finished."""
        remote = self._loading.pop(request.request_id, None)
        if remote is None and params.get("do_remote_prefill"):
            # Finished before its blocks were allocated (aborted while waiting).
            params["do_remote_prefill"] = False
            if all(params.get(key) is not None for key in _REMOTE_KEYS):
                remote = _abort_spec(request.request_id, params)
        if remote is not None:
            self._aborts.append(remote)


def _abort_spec(request_id: str, params: dict[str, Any]) -> AbortSpec:
    """Where a decode request's KV comes from, as an abort order."""
    return AbortSpec(
        request_id=request_id,
        remote_request_id=str(params["remote_request_id"]),
        remote_engine_id=str(params["remote_engine_id"]),
        remote_host=str(params["remote_host"]),
        remote_port=int(params["remote_port"]),
        remote_tp_size=int(params["tp_size"]),
    )


def _remote_tokens(request: Request) -> int:
    """Prompt tokens the prefill engine holds KV for."""
    params = request.kv_transfer_params or {}
    prompt = len(request.prompt_token_ids or [])
    remote = params.get("remote_num_tokens")
    return min(prompt, int(remote)) if remote is not None else prompt


@dataclass
class _Load:
    """A load on this decode rank: waiting for its prefill engine's connect, then a fetch."""

    spec: LoadSpec
    addresses: tuple[str, ...]
    deadline: float  # `fetch_timeout_s` after vLLM ordered it, connect included
    handle: FetchHandle | None = None
    result: TransferResult | None = None  # set when it ended without a fetch
    aborted: bool = False  # vLLM finished the request: nothing to report but the end


@dataclass
class _Remote:
    """A prefill engine this rank loads from. Only the engine's thread touches it; its
    `KVConsumer` is created and connected on a thread of its own (see `_WorkerSide`)."""

    engine_id: str
    consumer: KVConsumer | None = None
    connected: tuple[str, ...] | None = None  # the addresses `consumer` is connected to
    seen_at: tuple[str, ...] = ()  # where the engine was last connected (to retire it)
    connecting: tuple[str, ...] | None = None  # a connect in flight, to these addresses
    waiting: list[_Load] = field(default_factory=list)  # loads waiting for a connect
    aborts: list[tuple[tuple[str, ...], str]] = field(default_factory=list)  # same, aborts


_Connected = tuple[_Remote, tuple[str, ...], KVConsumer | None, Exception | None]


class _WorkerSide:
    """One TP rank: a `KVProducer` (prefill) and a `KVConsumer` per remote engine (decode).

    Nothing here blocks the engine's step: a fetch is started and its `FetchHandle` kept, and
    `get_finished` collects the finished ones (no thread per load, so loads that wait for a
    request never published cost nothing to the others). The one blocking call, creating and
    connecting a remote engine's consumer (a handshake, up to `handshake_timeout_s`), runs on a
    thread per remote engine while it connects; that engine's loads wait for it, others go on.
    A failed connect fails its loads with all their blocks; the next load connects again. A
    load naming other addresses than its engine's consumer is connected to (the engine
    restarted on new ports) connects that consumer again first; an engine that restarts at
    the same addresses is found again by the consumer itself. No lock is held anywhere:
    connect threads hand their outcome over a queue.
    """

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
        self._remotes: dict[str, _Remote] = {}
        self._connected: queue.SimpleQueue[_Connected] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []  # connects and retirements in flight
        self._spare: KVConsumer | None = None  # created, never connected (see `_keep_spare`)
        self._loading: dict[str, _Load] = {}
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
                backend=s.backend,
            )

    def start_step(self, metadata: KvxferConnectorMetadata) -> None:
        self._take_connects()
        for send in metadata.sends:
            if self._producer is None:
                raise RuntimeError(
                    "KvxferConnector: asked to send KV but this engine's kv_role is not "
                    "kv_producer or kv_both"
                )
            self._producer.publish(send.request_id, send.block_ids, send.num_tokens)
            self._published.add(send.request_id)
        for load in metadata.loads:
            if not self._consumes:
                raise RuntimeError(
                    "KvxferConnector: asked to load KV but this engine's kv_role is not "
                    "kv_consumer or kv_both"
                )
            self._start_load(load)
        for abort in metadata.aborts:  # after the loads: a step may start and abort one
            if self._consumes:
                self._abort(abort)

    # ---- loads (the engine's thread) ----

    def _start_load(self, spec: LoadSpec) -> None:
        addresses = _addresses(spec.remote_host, spec.remote_port, spec.remote_tp_size)
        deadline = time.monotonic() + self._settings.fetch_timeout_s
        load = _Load(spec, addresses, deadline)
        self._loading[spec.request_id] = load
        remote = self._remote(spec.remote_engine_id)
        if remote.connecting is None and remote.connected == addresses:
            self._fetch(remote, load)
        else:
            remote.waiting.append(load)
            self._connect(remote, addresses)

    def _fetch(self, remote: _Remote, load: _Load) -> None:
        spec = load.spec
        assert remote.consumer is not None
        try:
            load.handle = remote.consumer.fetch(
                spec.remote_request_id,
                spec.block_ids,
                spec.num_tokens,
                spec.start_token,
                timeout=max(0.0, load.deadline - time.monotonic()),
            )
        except Exception as exc:  # refused before any transfer: every block fails
            load.result = self._failed(spec, exc)

    def _abort(self, abort: AbortSpec) -> None:
        """Give up the load of a request vLLM finished (if one runs here) and tell its prefill
        engine, which frees the request's blocks at once."""
        load = self._loading.get(abort.request_id)
        if load is not None and load.spec.remote_request_id == abort.remote_request_id:
            load.aborted = True
            if load.handle is not None:
                load.handle.cancel()  # ends soon; nothing of it lands afterwards
            elif load.result is None:  # still waiting for a connect: nothing can land
                self._remote(load.spec.remote_engine_id).waiting.remove(load)
                load.result = TransferResult(False, [], 0, 0, "", 0.0, ["aborted"])
        addresses = _addresses(abort.remote_host, abort.remote_port, abort.remote_tp_size)
        remote = self._remote(abort.remote_engine_id)
        if remote.connecting is None and remote.connected == addresses:
            self._send_abort(remote, abort.remote_request_id)
        else:
            remote.aborts.append((addresses, abort.remote_request_id))
            self._connect(remote, addresses)

    def _send_abort(self, remote: _Remote, remote_request_id: str) -> None:
        assert remote.consumer is not None
        try:
            remote.consumer.abort(remote_request_id)
        except Exception as exc:  # the engine frees the request at its request_timeout_s
            log.warning(
                "kvxfer: could not tell engine %s that %s is aborted: %s",
                remote.engine_id,
                remote_request_id,
                exc,
            )

    def _failed(self, spec: LoadSpec, error: BaseException | str) -> TransferResult:
        """A load that ended before any transfer: every block it was to fill failed."""
        why = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        log.warning(
            "kvxfer: load of %s from engine %s failed before any transfer: %s",
            spec.request_id,
            spec.remote_engine_id,
            why,
        )
        failed = blocks_of_tokens(
            spec.block_ids, self._geometry.block_size, spec.start_token, spec.num_tokens
        )
        return TransferResult(False, failed, 0, 0, "", 0.0, [why])

    # ---- remote engines: connects off the engine's thread ----

    def _remote(self, engine_id: str) -> _Remote:
        remote = self._remotes.get(engine_id)
        if remote is None:
            remote = self._remotes[engine_id] = _Remote(engine_id)
        return remote

    def _connect(self, remote: _Remote, addresses: tuple[str, ...]) -> None:
        """Connect `remote` to `addresses` on a thread, unless a connect runs already (what
        still waits when it ends starts the next one)."""
        if remote.connecting is not None:
            return
        if remote.seen_at and remote.seen_at != addresses:
            log.info(
                "kvxfer: engine %s is now at %s (was %s): connecting again",
                remote.engine_id,
                ", ".join(addresses),
                ", ".join(remote.seen_at),
            )
        remote.connecting = addresses
        consumer = remote.consumer
        if consumer is None:
            consumer, self._spare = self._spare, None
        self._in_background(
            self._connect_thread,
            f"kvxfer-connect-{remote.engine_id}",
            remote,
            consumer,
            addresses,
        )

    def _connect_thread(
        self, remote: _Remote, consumer: KVConsumer | None, addresses: tuple[str, ...]
    ) -> None:
        """Connect `consumer` (created first if None) to `addresses`; hand the outcome to
        the engine's thread, which owns `remote`."""
        error = None
        try:
            if consumer is None:
                consumer = self._new_consumer()
            consumer.connect(list(addresses), timeout=self._settings.handshake_timeout_s)
        except Exception as exc:
            error = exc
        self._connected.put((remote, addresses, consumer, error))

    def _new_consumer(self) -> KVConsumer:
        assert self._spec is not None, "register_kv_caches() comes first"
        s = self._settings
        return KVConsumer(
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

    def _take_connects(self) -> None:
        """Apply the connects that ended: start their loads' fetches and send their aborts,
        or fail them."""
        self._threads = [t for t in self._threads if t.is_alive()]
        while True:
            try:
                remote, addresses, consumer, error = self._connected.get_nowait()
            except queue.Empty:
                return
            remote.connecting = None
            remote.connected = addresses if error is None else None
            if error is None:
                remote.consumer, remote.seen_at = consumer, addresses
                self._retire_others(remote)
            else:
                if remote.consumer is None and consumer is not None:
                    self._keep_spare(consumer)
                log.warning(
                    "kvxfer: cannot connect to engine %s at %s: %s",
                    remote.engine_id,
                    ", ".join(addresses),
                    error,
                )
            waiting, remote.waiting = remote.waiting, []
            for load in waiting:
                if load.addresses != addresses:
                    remote.waiting.append(load)  # its engine moved again meanwhile
                elif error is None:
                    self._fetch(remote, load)
                else:
                    load.result = self._failed(load.spec, error)
            aborts, remote.aborts = remote.aborts, []
            for where, remote_request_id in aborts:
                if where != addresses:
                    remote.aborts.append((where, remote_request_id))
                elif error is None:
                    self._send_abort(remote, remote_request_id)
            if remote.waiting or remote.aborts:
                again = remote.waiting[-1].addresses if remote.waiting else remote.aborts[-1][0]
                self._connect(remote, again)
            elif remote.consumer is None:
                del self._remotes[remote.engine_id]  # never connected: keep nothing

    def _keep_spare(self, consumer: KVConsumer) -> None:
        """Keep a consumer whose first connect failed for the next remote engine: destroying
        a Mooncake engine stalls the whole process for about a second (it holds the GIL), so
        a decode engine pointed at a dead prefill engine must not create and destroy one per
        load. At most one is kept."""
        if self._spare is None:
            self._spare = consumer
        else:
            self._in_background(consumer.close, "kvxfer-close")

    def _retire_others(self, remote: _Remote) -> None:
        """Close the consumers of engines that were where `remote` now is: they restarted
        under a new engine id (vLLM's default), so nothing of theirs comes back."""
        for other in list(self._remotes.values()):
            if other is remote or other.connecting is not None or other.waiting:
                continue
            if set(other.seen_at) & set(remote.seen_at):
                del self._remotes[other.engine_id]
                log.info(
                    "kvxfer: engine %s replaced engine %s at %s",
                    remote.engine_id,
                    other.engine_id,
                    ", ".join(remote.seen_at),
                )
                if other.consumer is not None:  # fails its fetches still running, if any
                    self._in_background(other.consumer.close, "kvxfer-retire")

    def _in_background(self, target: Any, name: str, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    # ---- reports ----

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._take_connects()
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
        now = time.monotonic()
        for request_id, load in list(self._loading.items()):
            if load.handle is None and load.result is None and now >= load.deadline:
                self._remote(load.spec.remote_engine_id).waiting.remove(load)
                load.result = self._failed(load.spec, "its prefill engine did not connect in time")
            result = load.result
            if result is None and load.handle is not None and load.handle.done():
                result = load.handle.wait()
            if result is None:
                continue
            del self._loading[request_id]
            recving.add(request_id)
            if load.aborted:
                continue  # vLLM finished the request: its blocks are freed, not recomputed
            self._stats.record(result)
            if not result.ok:
                log.warning(
                    "kvxfer: load of %s failed, %d blocks to recompute: %s",
                    request_id,
                    len(result.failed_block_ids),
                    "; ".join(result.errors),
                )
                self._load_errors.update(result.failed_block_ids)
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
        for thread in self._threads:  # connects end within handshake_timeout_s
            thread.join(self._settings.handshake_timeout_s + 5.0)
        consumers = [self._spare, *(r.consumer for r in self._remotes.values())]
        self._spare = None
        while True:
            try:
                consumers.append(self._connected.get_nowait()[2])
            except queue.Empty:
                break
        for consumer in consumers:
            if consumer is not None:
                consumer.close()
        self._remotes.clear()
        if self._producer is not None:
            self._producer.close()
            self._producer = None


def _addresses(host: str, port: int, tp_size: int) -> tuple[str, ...]:
    """The side channels of a prefill engine's ranks: rank `r` at `port + r`."""
    return tuple(f"tcp://{host}:{port + rank}" for rank in range(tp_size))


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
        kv_cache_dtype=str(vllm_config.cache_config.cache_dtype),
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
    """Encoder outputs (by multimodal identifier) a consumer worker loads this step, and the
    scheduler's relay directory they wait in."""

    mm_hashes: list[str] = field(default_factory=list)
    relay_dir: str = ""


class _Prefetch:
    """One item the scheduler fetches before any request that needs it is scheduled."""

    LOADING, READY, ABSENT, FAILED = "loading", "ready", "absent", "failed"

    def __init__(self, future: Future[str]) -> None:
        self.future = future
        self.requests: set[str] = set()
        self.forgotten = False

    def state(self) -> str:
        if not self.future.done():
            return self.LOADING
        if self.future.cancelled() or self.future.exception() is not None:
            return self.FAILED
        return self.future.result()


class KvxferECConnector(ECConnectorBase):
    """vLLM encoder-cache connector over a `kvxfer.ec` connector (EPD disaggregation).

    Load it with `--ec-transfer-config '{"ec_connector": "KvxferECConnector",
    "ec_connector_module_path": "kvxfer.integrations.vllm", "ec_role": "ec_producer" |
    "ec_consumer", "ec_connector_extra_config": {"backend": "MooncakeECConnector", ...}}'`.

    `backend` names a `kvxfer.ec.ECConnectorFactory` connector ("MooncakeECConnector", the
    default, or "SharedStorageECConnector"; with `backend_module_path`, a class of one's own);
    `relay_dir` (default /dev/shm, else the temporary directory) and `prefetch_workers` (4) are
    this class's; every other extra-config key is the backend's config (README). The encoder
    instance (`ec_producer`) stores each item's output from TP rank 0 (outputs are replicated
    across ranks); a save that fails is logged, never raised (the prefill instance then
    encodes the item itself).

    A prefill instance (`ec_consumer`) never lets a missing or vanishing item reach a forward
    pass. vLLM 0.33 reports a per-request failure only from the scheduler
    (`take_unavailable_requests`), and a worker that lacks an encoder output its step needs
    can neither encode it (the scheduler did not schedule its encoder input) nor drop the
    request (the model runner raises "Encoder cache miss", which ends the engine). So the
    item is fetched before its request is scheduled:

    1. `ensure_cache_available` (scheduler) starts, for each item a request still needs, a
       background fetch from the backend into a relay directory local to the instance
       (checksummed files, `relay_dir`); the request is deferred until every fetch settled.
    2. An item no producer holds (or whose producers are all unreachable: each is given
       about half a second, then skipped for a few seconds) is encoded locally, as without
       a connector. An item a producer announced but that could not be loaded (evicted or
       gone between the check and the load, corrupt, producer died) fails that request only:
       it is returned by `take_unavailable_requests`, vLLM finishes it with a retryable error
       (re-issuing it re-runs the encode); other requests are untouched.
    3. `has_cache_item` is True exactly for fetched items (no network call, never raises);
       the worker loads them from the relay (from the backend if the relay is not reachable,
       as with workers on another host).

    A fetched item stays in the relay until every request that needed it finished. The one
    failure left to a worker is a relay file lost between the fetch and the load *and* the
    backend losing the item too; the worker then raises `ECLoadError` naming the item,
    since vLLM 0.33 gives a worker no way to fail one request.
    """

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config, role)
        config = vllm_config.ec_transfer_config
        assert config is not None  # the base class refuses to start without it
        extra = dict(config.ec_connector_extra_config or {})
        self._backend = str(extra.pop("backend", "MooncakeECConnector"))
        self._backend_module = extra.pop("backend_module_path", None)
        relay_parent = extra.pop("relay_dir", None)
        self._relay_parent = str(relay_parent) if relay_parent else _default_relay_parent()
        self._prefetch_workers = int(extra.pop("prefetch_workers", 4))
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
        # scheduler side (consumer)
        self._items: dict[str, _Prefetch] = {}
        self._unavailable: set[str] = set()
        self._prefetcher: ThreadPoolExecutor | None = None
        self._relay: Any = None
        self._relay_dir = ""
        # worker side (consumer)
        self._relay_readers: dict[str, Any] = {}
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

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        """Consumer: start fetching the items the request still needs; True once all settled.

        A request whose announced item could not be loaded is reported by
        `take_unavailable_requests`. Never raises: on an internal error the items are left to
        be encoded locally.
        """
        if not self.is_consumer:
            return True
        try:
            ready = True
            for feature in request.mm_features or []:
                position = feature.mm_position
                if position.offset + position.length <= num_computed_tokens:
                    continue  # covered by cached KV
                item = self._items.get(feature.identifier)
                if item is None:
                    item = self._start_prefetch(feature.identifier)
                item.requests.add(request.request_id)
                state = item.state()
                if state == _Prefetch.LOADING:
                    ready = False
                elif state == _Prefetch.FAILED:
                    self._unavailable.add(request.request_id)
                    ready = False
            return ready
        except Exception:
            log.exception("KvxferECConnector: encoder-cache check failed; encoding locally")
            return True

    def _start_prefetch(self, identifier: str) -> _Prefetch:
        if self._prefetcher is None:
            self._prefetcher = ThreadPoolExecutor(
                self._prefetch_workers, thread_name_prefix="kvxfer-ec-prefetch"
            )
        future: Future[str] = Future()
        item = _Prefetch(future)
        self._items[identifier] = item
        self._prefetcher.submit(self._prefetch, identifier, item)
        return item

    def _prefetch(self, identifier: str, item: _Prefetch) -> None:
        """Background: backend -> relay file. Settles `item.future` with its state."""
        key = item_key(identifier)
        try:
            backend = self._consumer()
            if not backend.has(key):
                item.future.set_result(_Prefetch.ABSENT)
                return
            tensor = backend.load(key)
            try:
                relay = self._relay_store()
                relay.save(key, tensor)
            except OSError as exc:  # relay full (a small /dev/shm): encode it here instead
                log.warning(
                    "KvxferECConnector: no room for %s in the relay %s (%s); it is encoded "
                    "locally. Set relay_dir to a larger local directory.",
                    identifier,
                    self._relay_dir,
                    exc,
                )
                item.future.set_result(_Prefetch.ABSENT)
                return
            with self._ec_lock:
                if item.forgotten:  # every request that needed it finished meanwhile
                    relay.file_of(key).unlink(missing_ok=True)
            item.future.set_result(_Prefetch.READY)
        except Exception as exc:
            log.warning(
                "KvxferECConnector: encoder output %s was announced but could not be loaded; "
                "requests needing it fail (retryable): %s",
                identifier,
                exc,
            )
            item.future.set_exception(exc)

    def _relay_store(self) -> Any:
        from kvxfer.ec.shared_storage import SharedStorageECConnector

        with self._ec_lock:
            if self._relay is None:
                os.makedirs(self._relay_parent, exist_ok=True)
                self._relay_dir = tempfile.mkdtemp(
                    prefix="kvxfer-ec-relay-", dir=self._relay_parent
                )
                self._relay = SharedStorageECConnector(
                    "producer", {"path": self._relay_dir, "fsync": False}
                )
            return self._relay

    def has_cache_item(self, identifier: str) -> bool:
        """Consumer: whether the item was fetched for this instance (no network call; never
        raises). Producer: False (it encodes)."""
        if not self.is_consumer:
            return False
        item = self._items.get(identifier)
        return item is not None and item.state() == _Prefetch.READY

    def take_unavailable_requests(self) -> set[str]:
        """Requests whose announced encoder output could not be loaded: vLLM fails them."""
        unavailable, self._unavailable = self._unavailable, set()
        return unavailable

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        """Consumer: load the item into the slot just allocated if it was fetched."""
        identifier = request.mm_features[index].identifier
        if self.has_cache_item(identifier):
            self._loads.append(identifier)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        """This step's loads."""
        metadata = KvxferECConnectorMetadata(mm_hashes=self._loads, relay_dir=self._relay_dir)
        self._loads = []
        return metadata

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Consumer: forget the items no unfinished request needs (relay file, producer)."""
        if self.is_consumer:
            self._unavailable.discard(request.request_id)
            for feature in request.mm_features or []:
                item = self._items.get(feature.identifier)
                if item is None:
                    continue
                item.requests.discard(request.request_id)
                if not item.requests:
                    self._forget(feature.identifier, item)
        return False, None

    def _forget(self, identifier: str, item: _Prefetch) -> None:
        del self._items[identifier]
        key = item_key(identifier)
        with self._ec_lock:
            item.forgotten = True
            relay, backend = self._relay, self._ec
        try:
            if relay is not None and item.state() == _Prefetch.READY:
                relay.file_of(key).unlink(missing_ok=True)
            if backend is not None and item.state() != _Prefetch.ABSENT:
                backend.release(key)
        except Exception:
            log.warning("KvxferECConnector: could not release %s", identifier, exc_info=True)

    # ---- worker side ----

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        """Load this step's items that the worker's encoder cache lacks, from the relay (or
        from the backend when the relay is not reachable from this worker).

        Raises:
            kvxfer.ec.ECLoadError: an item is in neither (see the class docstring).
        """
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KvxferECConnectorMetadata)
        missing = {item_key(h): h for h in metadata.mm_hashes if h not in encoder_cache}
        if not missing:
            return
        loaded: dict[str, torch.Tensor] = {}
        failed: dict[str, str] = {}
        reader = self._relay_reader(metadata.relay_dir)
        if reader is not None:
            loaded, failed = reader.start_load(list(missing), self._device).results()
        else:
            failed = dict.fromkeys(missing, "no relay directory here")
        if failed:
            direct, still = self._consumer().start_load(list(failed), self._device).results()
            loaded.update(direct)
            if still:
                raise ECLoadError(
                    "KvxferECConnector: encoder outputs lost after the scheduler fetched them: "
                    + "; ".join(
                        f"{missing[k]}: relay: {failed[k]}; backend: {still[k]}" for k in still
                    )
                )
        encoder_cache.update({missing[k]: tensor for k, tensor in loaded.items()})

    def _relay_reader(self, relay_dir: str) -> Any:
        from kvxfer.ec.shared_storage import SharedStorageECConnector

        if not relay_dir or not os.path.isdir(relay_dir):
            return None
        reader = self._relay_readers.get(relay_dir)
        if reader is None:
            reader = SharedStorageECConnector("consumer", {"path": relay_dir})
            self._relay_readers[relay_dir] = reader
        return reader

    def save_caches(
        self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any
    ) -> None:
        """Producer, TP rank 0: store one item's encoder output (a failure is logged: the
        prefill instance then encodes the item itself)."""
        if self._ec is not None and self.is_producer:
            try:
                self._ec.save(item_key(mm_hash), encoder_cache[mm_hash])
            except Exception:
                log.warning("KvxferECConnector: could not store %s", mm_hash, exc_info=True)

    def shutdown(self) -> None:
        """Close the kvxfer connectors and remove the relay directory."""
        if self._prefetcher is not None:
            self._prefetcher.shutdown(wait=True, cancel_futures=True)
            self._prefetcher = None
        for reader in self._relay_readers.values():
            reader.close()
        self._relay_readers.clear()
        if self._relay is not None:
            self._relay.close()
            self._relay = None
            shutil.rmtree(self._relay_dir, ignore_errors=True)
        if self._ec is not None:
            self._ec.close()
            self._ec = None


def _default_relay_parent() -> str:
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK):
        return shm
    return tempfile.gettempdir()
