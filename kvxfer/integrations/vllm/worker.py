"""The worker side of `KvxferConnector`: one `GroupedProducer` per prefill worker, registered
with the engine's bootstrap service; `GroupedConsumer`s per remote engine (one DP rank of a
prefill engine) on decode workers, found through that service; fetches off the engine's step.

`WorkerSide` is the facade vLLM's connector calls; the work lies beside it:

- `geometry`: what a worker reads of itself from vLLM (geometry, ranks, attention backends);
- `cache_groups`: vLLM's KV cache configuration as kvxfer's groups (pure functions). Each of
  vLLM's KV cache groups (hybrid memory allocator: full-attention and sliding-window layers,
  each group with its own block table) is moved by a producer and consumer of its own
  (`kvxfer.connector.groups`); a sliding-window group moves only the tokens inside its window.
  A worker registers one side channel per group, in vLLM's group order;
- `loads` and `sends`: the requests in flight, each way;
- `remotes`: the prefill engines a decode worker loads from, each connection's lifecycle a
  state machine, connected off the engine's thread.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

import msgspec
import torch

from kvxfer.connector import (
    CacheGroup,
    GroupedConsumer,
    GroupedProducer,
    ReleaseReason,
    TransferResult,
)
from kvxfer.connector.groups import fetched_blocks
from kvxfer.integrations.bootstrap import BootstrapClient, Registration, new_worker_info
from kvxfer.integrations.settings import ConnectorSettings
from kvxfer.integrations.vllm.cache_groups import (
    TableSource,
    cache_groups,
    group_tables,
    layer_positions,
)
from kvxfer.integrations.vllm.connections import Fingerprint, Remote
from kvxfer.integrations.vllm.engine_config import (
    attention_backends,
    attention_scales,
    engine_geometry,
)
from kvxfer.integrations.vllm.loads import Load, Loads
from kvxfer.integrations.vllm.metadata import (
    AbortSpec,
    KvxferConnectorMetadata,
    LoadSpec,
    SendSpec,
    StreamStep,
)
from kvxfer.integrations.vllm.remotes import RemoteEngines, look_up_ranks
from kvxfer.integrations.vllm.scheduler import data_parallel_rank
from kvxfer.integrations.vllm.sends import Sends
from kvxfer.integrations.vllm.stats import KvxferConnectorStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from kvxfer.integrations.base import EngineAdapter

log = logging.getLogger(__name__)
# The block id vLLM's tables give the blocks a sliding window dropped: its BlockPool's null
# block, the first block it makes (vllm/v1/core/block_pool.py).
VLLM_NULL_BLOCK = 0


class WorkerSide:
    """One worker (a TP rank of a pipeline stage): a `GroupedProducer` (prefill) and a
    `GroupedConsumer` per remote engine (decode), over the layers of its stage, one producer
    or consumer per KV cache group.

    A prefill worker binds its side channel (a free port by default) and registers it with
    the engine's bootstrap service under (engine id, DP rank, TP rank, PP rank); the
    registration is renewed in the background and removed at `close`.

    Nothing here blocks the engine's step: a fetch is started and its handle kept (`Loads`),
    and `transfer_results` collects the finished ones. The blocking calls, looking a remote
    engine's ranks up in its bootstrap service and creating and connecting its consumer, run
    on a thread pool, one task per remote engine while it connects; that engine's loads wait
    for it, others go on (`RemoteEngines`, whose module says when an engine is looked up and
    connected again). No lock is held anywhere but around the aborts that wait for a connect:
    pool tasks hand their outcome over a queue.
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
        check_threads_can_run(vllm_config.device_config.device_type, os.sched_getaffinity(0))
        allow_amx_tiles(vllm_config.device_config.device_type)
        self._settings = settings
        self._engine_id = engine_id
        self._geometry = engine_geometry(vllm_config, kv_cache_config)
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self._produces, self._consumes = produces, consumes
        self._groups: list[CacheGroup] = []
        self._tables_of: list[TableSource] = []  # per group: where its block table comes from
        self._layers: dict[str, tuple[int, int]] = {}  # attention layer -> (group, local index)
        self._computing: dict[str, int] = {}  # offered while this step computes: id -> tokens
        self._streams: dict[str, str] = {}  # vLLM id -> offered id, published while computing
        self._producer: GroupedProducer | None = None
        parallel = vllm_config.parallel_config
        self._dp_rank = data_parallel_rank(vllm_config)
        self._pp_rank, self._pp_size = self._geometry.pp_rank, self._geometry.pp_size
        self._bootstrap_url = settings.bootstrap_url(parallel.data_parallel_master_ip)
        self._registration: Registration | None = None
        # Connects (with their look-ups) and retirements run on the remotes' pool; registering
        # runs on a daemon thread of its own (`Registration.start`: it lasts as long as the
        # worker).
        self._remotes = RemoteEngines(
            self._new_consumer,
            self.look_up,
            settings.handshake_timeout_s,
            thread_name_prefix=f"kvxfer-dp{self._dp_rank}-pp{self._pp_rank}-tp{self.tp_rank}",
        )
        self._loads = Loads()
        self._sends = Sends()
        self._stats = KvxferConnectorStats()
        # "auto" (the default) is RDMA when this machine has an RDMA device, else TCP.
        transport = settings.transport_protocol()
        self.protocol = transport.protocol
        log.info("kvxfer rank %d: transport %s", self.tp_rank, transport.describe())

    @property
    def tp_rank(self) -> int:
        """This worker's tensor-parallel rank."""
        return self._geometry.tp_rank

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Read this worker's KV cache groups from its layer tensors (with pipeline
        parallelism: its stage's layers, placed by their names); start serving (prefill)."""
        self._groups, self._tables_of = cache_groups(
            kv_caches,
            self._kv_cache_config,
            self._geometry,
            attention_backends(self._vllm_config, list(kv_caches)),
            scales=attention_scales(self._vllm_config, list(kv_caches)),
        )
        self._layers = layer_positions(kv_caches, self._kv_cache_config, self._pp_size)
        for index, group in enumerate(self._groups):
            window = "" if group.sliding_window is None else f", window {group.sliding_window}"
            log.info("kvxfer %s group %d%s: %s", group.spec.rank_name, index, window, group.spec)
        if self._produces:
            s = self._settings
            self._producer = GroupedProducer(
                self._groups,
                self._engine_id,
                s.side_channel_host,
                self._side_channel_port(),
                release=self.released,
                **s.producer_options(self.protocol),
            )
            self.register(self._producer.addresses)

    def _side_channel_port(self) -> int:
        """0 (a free port, registered), or this worker's fixed port: distinct for every
        worker of the engine, so DP ranks on one node never collide."""
        base = self._settings.side_channel_port
        if base == 0:
            return 0
        g = self._geometry
        port = base + (self._dp_rank * self._pp_size + self._pp_rank) * g.tp_size + g.tp_rank
        if port > 65535:
            raise ValueError(
                f"kv_connector_extra_config['side_channel_port'] = {base}: DP rank "
                f"{self._dp_rank} PP rank {self._pp_rank} TP rank {g.tp_rank} would listen on "
                f"port {port} > 65535; choose a lower base, or 0 for free ports"
            )
        return port

    def look_up(
        self, bootstrap: str, engine_id: str, dp_rank: int | None, held_s: float
    ) -> tuple[tuple[str, ...], Fingerprint]:
        """A remote engine's DP rank's side channels, from its bootstrap service
        (`look_up_ranks` with this worker's secret and handshake timeout; the remotes' pool)."""
        timeout_s = self._settings.handshake_timeout_s
        secret = self._settings.secret
        return look_up_ranks(
            bootstrap, engine_id, dp_rank, held_s, secret=secret, timeout_s=timeout_s
        )

    def released(self, request_id: str, reason: ReleaseReason) -> None:
        """The producer released `request_id` (its side-channel thread): vLLM hears of it as
        finished sending at its next `get_finished`, and frees its blocks."""
        self._sends.release(request_id, reason)

    def register(self, addresses: list[str]) -> None:
        """Register this worker's side channel with the bootstrap service, and keep it
        registered, in the background (the service may start after the workers: vLLM creates
        the scheduler, which runs it, once every worker registered its caches)."""
        info = new_worker_info(
            self._engine_id,
            self._dp_rank,
            self.tp_rank,
            self._pp_rank,
            addresses[0],
            self._geometry.tp_size,
            self._pp_size,
            geometry=msgspec.to_builtins(self._groups[0].spec),
            group_addresses=addresses if len(addresses) > 1 else None,
        )
        client = BootstrapClient(self._bootstrap_url, secret=self._settings.secret, timeout_s=3.0)
        self._registration = Registration(client, info).start()

    def _new_consumer(self) -> GroupedConsumer:
        """A consumer over this worker's groups, not connected yet (the remotes' pool)."""
        assert self._groups, "register_kv_caches() comes first"
        s = self._settings
        return GroupedConsumer(
            self._groups,
            self._engine_id,
            s.side_channel_host,
            **s.consumer_options(self.protocol),
        )

    def start_step(self, metadata: KvxferConnectorMetadata) -> None:
        """Apply one step's orders: publish its sends, fail the streamed sends vLLM finished
        otherwise, start its loads, then its aborts."""
        self._take_connects()
        self._computing = {}
        for send in metadata.sends:
            self.publish(send)
        for failure in metadata.send_failures:
            if self._streams.pop(failure.request_id, None) == failure.offered_as:
                assert self._producer is not None  # it published the request
                self._producer.fail(failure.offered_as, failure.reason)
        for step in metadata.stream_steps:
            self._stream_step(step)
        for load in metadata.loads:
            if not self._consumes:
                raise RuntimeError(
                    "KvxferConnector: asked to load KV but this engine's kv_role is not "
                    "kv_consumer or kv_both"
                )
            self.fetch(load)
        for abort in metadata.aborts:  # after the loads: a step may start and abort one
            if self._consumes:
                self.abort(abort)

    def layer_saved(self, layer_name: str) -> None:
        """vLLM's forward pass wrote `layer_name`'s KV for this step (`save_kv_layer`): that
        layer of the requests it computes streamed is ready (on CUDA, from the event each mark
        records on the forward's stream)."""
        place = self._layers.get(layer_name)
        if self._computing and place is not None:
            group, local = place
            for offered, tokens in list(self._computing.items()):
                self._mark_ready(offered, tokens, group, local + 1)

    def step_saved(self) -> None:
        """The step's forward pass is done (`wait_for_save`): its streamed requests are
        computed in every layer."""
        computing, self._computing = self._computing, {}
        for offered, tokens in computing.items():
            self._mark_ready(offered, tokens)

    def _mark_ready(
        self, offered: str, tokens: int, group: int | None = None, layers: int | None = None
    ) -> None:
        assert self._producer is not None  # it published what it computes
        try:
            self._producer.mark_ready(offered, tokens, group, layers)
        except ValueError:  # released meanwhile (its decode engine aborted it): nobody reads
            self._computing.pop(offered, None)

    def publish(self, send: SendSpec) -> None:
        """Offer a request (whole, or, streamed, before this step computes it)."""
        if self._producer is None:
            raise RuntimeError(
                "KvxferConnector: asked to send KV but this engine's kv_role is not "
                "kv_producer or kv_both"
            )
        tables = group_tables(self._tables_of, send.block_ids, send.num_tokens)
        try:
            self._producer.publish(
                send.offered_as,
                tables,
                send.num_tokens,
                ready_tokens=send.ready_tokens,
                timeline=send.timeline,
            )
        except ValueError as exc:  # a router's transfer_id used twice: never the engine's end
            log.warning(
                "kvxfer: request %s cannot be offered as %r (%s); its blocks are freed and "
                "a decode engine loading it recomputes it",
                send.request_id,
                send.offered_as,
                exc,
            )
            self._sends.published(send.request_id)
            self.released(send.request_id, ReleaseReason.FAILED)  # never offered
            return
        self._sends.published(send.request_id, send.offered_as)
        if send.ready_tokens is not None:
            self._streams[send.request_id] = send.offered_as
            self._stats.record_streamed()

    def _stream_step(self, step: StreamStep) -> None:
        """This step computes a streamed request up to `step.tokens` (with the blocks it
        allocated for them): its layers are marked as the forward pass writes them. Not when
        its publication failed (its `transfer_id` was another request's): never that one's."""
        if self._streams.get(step.request_id) != step.offered_as:
            return
        assert self._producer is not None  # it published the request
        try:
            if step.block_ids is not None:
                self._producer.extend(
                    step.offered_as, group_tables(self._tables_of, step.block_ids, step.tokens)
                )
        except ValueError:  # released meanwhile (its decode engine aborted it): nobody reads
            return
        self._computing[step.offered_as] = step.tokens

    # ---- loads (the engine's thread) ----

    def fetch(self, load: LoadSpec) -> None:
        """Start a load: at once when its remote engine is connected, else once it is (the
        connect runs on the remotes' pool)."""
        started = self._loads.start(load, time.monotonic() + self._settings.fetch_timeout_s)
        remote = self._remotes.get(load.remote)
        if remote.ready(started.route):
            self._fetch_from(remote, started)
        else:
            remote.waiting.append(started)
            self._remotes.connect(remote, started.route)

    def _fetch_from(self, remote: Remote, load: Load) -> None:
        spec = load.spec
        assert remote.consumer is not None
        try:
            load.handle = remote.consumer.fetch(
                spec.remote_request_id,
                group_tables(self._tables_of, spec.block_ids, spec.num_tokens),
                spec.num_tokens,
                spec.start_token,
                timeout=max(0.0, load.deadline - time.monotonic()),
                streamed=spec.streamed,
                first_computed=spec.num_tokens - 1 if spec.recomputes_last else None,
                null_block=VLLM_NULL_BLOCK,
            )
        except Exception as exc:  # refused before any transfer: every block fails
            load.result = self._failed(spec, exc)

    def _fail_waiting(self, load: Load, error: Exception) -> None:
        """Its engine's connect failed: the load ends with every block it was to fill."""
        load.result = self._failed(load.spec, error)

    def abort(self, abort: AbortSpec) -> None:
        """Give up the load of a request vLLM finished (if one runs here) and tell its prefill
        engine, which frees the request's blocks at once."""
        load = self._loads.of_abort(abort)
        if load is not None and load.abort():  # it waited for a connect
            self._remotes.get(load.spec.remote).waiting.remove(load)
        self._remotes.abort(abort.remote, abort.remote_request_id)

    def _failed(self, spec: LoadSpec, error: BaseException | str) -> TransferResult:
        """A load that ended before any transfer: every block it was to fill failed."""
        why = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        log.warning(
            "kvxfer: load of %s from engine %s failed before any transfer: %s",
            spec.request_id,
            spec.remote,
            why,
        )
        tables = group_tables(self._tables_of, spec.block_ids, spec.num_tokens)
        failed = fetched_blocks(self._groups, tables, spec.num_tokens, spec.start_token)
        return TransferResult(False, failed, 0, 0, "", 0.0, [why])

    def _take_connects(self) -> None:
        """Apply the connects that ended: start their loads' fetches and send their aborts,
        or fail them."""
        self._remotes.take_connects(self._fetch_from, self._fail_waiting)

    # ---- reports ----

    def transfer_results(
        self, finished_req_ids: set[str], failed_requests: bool
    ) -> tuple[set[str], set[str], set[str]]:
        """The requests finished sending (prefill) and finished loading (decode, failed loads
        included) since the last call, and the loads that failed whole.

        A failed load's blocks are kept for `take_load_errors`, for vLLM to recompute exactly
        them; but with `failed_requests` (vLLM's `get_transfer_results` asks) a model with
        several KV cache groups fails the request whole, in the third set: vLLM's scheduler
        cannot map block ids back to requests then (they repeat across groups) and refuses
        them."""
        self._take_connects()
        sending = self._sends.take_finished(finished_req_ids)
        for request_id in sending:
            self._streams.pop(request_id, None)
        for load in self._loads.overdue(time.monotonic()):
            self._remotes.get(load.spec.remote).waiting.remove(load)
            load.result = self._failed(load.spec, "its prefill engine did not connect in time")
        kv_groups = self._kv_cache_config.kv_cache_groups if self._kv_cache_config else []
        whole = failed_requests and len(kv_groups) > 1
        recving, failed = set(), set()
        for load, result in self._loads.take_finished():
            recving.add(load.spec.request_id)
            if load.aborted:
                continue  # vLLM finished the request: its blocks are freed, not recomputed
            self._stats.record(result, load.spec.request_id)
            if not result.ok:
                self._remotes.load_failed(load.spec.remote)  # look it up before the next
                log.warning(
                    "kvxfer: load of %s failed (%d blocks, %s): %s",
                    load.spec.request_id,
                    len(result.failed_block_ids),
                    "the request fails whole" if whole else "vLLM recomputes them",
                    "; ".join(result.errors),
                )
                if whole:
                    failed.add(load.spec.request_id)
                else:
                    self._loads.add_errors(result.failed_block_ids)
        return sending, recving, failed

    def take_load_errors(self) -> set[int]:
        """The blocks of failed loads since the last call, for vLLM to recompute."""
        return self._loads.take_errors()

    def take_stats(self) -> KvxferConnectorStats | None:
        """The transfer statistics since the last call (None: nothing happened)."""
        self._stats.record_expired(self._sends.take_expired())
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, KvxferConnectorStats()
        return stats

    def close(self) -> None:
        """Unregister from the bootstrap service (so no decode worker is sent here any more),
        then close the consumers and the producer."""
        if self._registration is not None:
            self._registration.stop(timeout=5.0)  # it unregisters within about 3 s
        self._remotes.close()
        self._registration = None
        if self._producer is not None:
            self._producer.close()
            self._producer = None


def check_threads_can_run(device_type: str, affinity: set[int]) -> None:
    """Refuse a worker whose thread vLLM's CPU build pinned to one core.

    vLLM's CPU worker binds its OpenMP threads to cores (`VLLM_CPU_OMP_THREADS_BIND`, "auto"
    by default), the Python thread that creates kvxfer's connector among them; every thread
    kvxfer starts inherits that one core, and shares it with an OpenMP thread that spins
    through each step. Measured on vLLM 0.32's CPU build: kvxfer's handshakes and heartbeats
    starved ("producer ... silent for 2.0 s: presumed dead", then for 30 s). `affinity` is the
    calling thread's CPUs (`os.sched_getaffinity(0)`).

    Raises:
        ValueError: a CPU engine whose connector thread may run on one core only, with the fix.
    """
    if device_type != "cpu" or len(affinity) > 1 or (os.cpu_count() or 1) == 1:
        return
    raise ValueError(
        f"kvxfer: vLLM's CPU worker pinned this thread to core {sorted(affinity)} "
        f"(VLLM_CPU_OMP_THREADS_BIND={os.environ.get('VLLM_CPU_OMP_THREADS_BIND', 'auto')!r}),"
        " so kvxfer's transfer threads would all share it with a spinning OpenMP thread and "
        "starve; start the engine with VLLM_CPU_OMP_THREADS_BIND=nobind"
    )


def allow_amx_tiles(device_type: str) -> None:
    """Ask Linux for this CPU worker's AMX tile state, on CPUs that have AMX tiles.

    Linux kills a process that runs an AMX tile instruction without having asked for the tile
    state (`arch_prctl(ARCH_REQ_XCOMP_PERM)`) with SIGILL. vLLM 0.32's CPU build never asks:
    its engines live because oneDNN asks on its first AMX matrix multiply, in the first prefill.
    A decode engine whose first step decodes KV that kvxfer loaded runs CPU attention's AMX
    kernel first (ISA `amx`: bf16 or fp8 caches in blocks of 32s), and its worker died with
    SIGILL on its first request (measured: an fp8 e4m3 decode engine on an Intel Xeon with AMX;
    `docs/engine-layouts.md`). Asking is idempotent and process-wide.
    """
    if device_type == "cpu" and torch.cpu._is_amx_tile_supported() and not torch.cpu._init_amx():
        log.warning("kvxfer: Linux refused this process AMX tile state; CPU attention's amx "
                    "ISA may die with SIGILL")  # fmt: skip


def _keeps_the_adapter_contract(
    worker: WorkerSide,
) -> EngineAdapter[dict[str, torch.Tensor], SendSpec, LoadSpec, AbortSpec]:
    """Never called: mypy checks here that the vLLM worker keeps the engine-adapter
    contract (`kvxfer.integrations.base`)."""
    return worker
