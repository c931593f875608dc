"""The worker side of `KvxferConnector`: one `KVProducer` per prefill worker, `KVConsumer`s per
remote engine on decode workers, fetches off the engine's step."""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvxfer.connector import FetchHandle, KVConsumer, KVProducer, TransferResult
from kvxfer.integrations.kv_tensors import EngineGeometry, spec_from_layers
from kvxfer.integrations.settings import ConnectorSettings
from kvxfer.integrations.vllm.metadata import AbortSpec, KvxferConnectorMetadata, LoadSpec
from kvxfer.integrations.vllm.stats import KvxferConnectorStats
from kvxfer.plan.layout import blocks_of_tokens
from kvxfer.spec import KVCacheSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger(__name__)


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
    `KVConsumer` is created and connected on a thread of its own (see `WorkerSide`)."""

    engine_id: str
    consumer: KVConsumer | None = None
    connected: tuple[str, ...] | None = None  # the addresses `consumer` is connected to
    seen_at: tuple[str, ...] = ()  # where the engine was last connected (to retire it)
    connecting: tuple[str, ...] | None = None  # a connect in flight, to these addresses
    waiting: list[_Load] = field(default_factory=list)  # loads waiting for a connect
    aborts: list[tuple[tuple[str, ...], str]] = field(default_factory=list)  # same, aborts


_Connected = tuple[_Remote, tuple[str, ...], KVConsumer | None, Exception | None]


class WorkerSide:
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
