"""The worker side of `KvxferConnector`: one `GroupedProducer` per prefill worker, registered
with the engine's bootstrap service; `GroupedConsumer`s per remote engine (one DP rank of a
prefill engine) on decode workers, found through that service; fetches off the engine's step.

Each of vLLM's KV cache groups (hybrid memory allocator: full-attention and sliding-window
layers, each group with its own block table) is moved by a producer and consumer of its own
(`kvxfer.connector.groups`); a sliding-window group moves only the tokens inside its window.
A worker registers one side channel per group, in vLLM's group order."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from kvxfer.connector import (
    CacheGroup,
    GroupedConsumer,
    GroupedFetch,
    GroupedProducer,
    TransferResult,
)
from kvxfer.connector.groups import fetched_blocks
from kvxfer.integrations.bootstrap import BootstrapClient, Registration, new_worker_info
from kvxfer.integrations.kv_tensors import EngineGeometry, spec_from_layers
from kvxfer.integrations.settings import ConnectorSettings
from kvxfer.integrations.vllm.backends import engine_reading
from kvxfer.integrations.vllm.metadata import (
    AbortSpec,
    KvxferConnectorMetadata,
    LoadSpec,
    RemoteEngine,
)
from kvxfer.integrations.vllm.scheduler import data_parallel_rank
from kvxfer.integrations.vllm.stats import KvxferConnectorStats
from kvxfer.state import StateComponent, StateLayout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger(__name__)

_BACKGROUND_THREADS = 32  # connects in flight at once (one per remote engine), and registering
_Fingerprint = tuple[tuple[str, str], ...]  # (address, generation) per rank, from the service


@dataclass(frozen=True)
class _Route:
    """How a remote engine's ranks are found: through a bootstrap service (the prefill engine's
    parameters name one), or at fixed addresses (parameters that name none)."""

    bootstrap: str | None
    addresses: tuple[str, ...] = ()

    @classmethod
    def of(cls, remote: RemoteEngine) -> _Route:
        if remote.bootstrap_addr is not None:
            return cls(remote.bootstrap_addr)
        return cls(None, remote.fixed_addresses())

    def __str__(self) -> str:
        return self.bootstrap or ", ".join(self.addresses)


@dataclass
class _Load:
    """A load on this decode rank: waiting for its prefill engine's connect, then a fetch."""

    spec: LoadSpec
    route: _Route
    deadline: float  # `fetch_timeout_s` after vLLM ordered it, connect included
    handle: GroupedFetch | None = None
    result: TransferResult | None = None  # set when it ended without a fetch
    aborted: bool = False  # vLLM finished the request: nothing to report but the end


@dataclass
class _Remote:
    """One DP rank of a prefill engine this rank loads from. Only the engine's thread touches
    it; its `GroupedConsumer` is created, its ranks looked up and connected on the worker's thread
    pool (see `WorkerSide`)."""

    engine_id: str
    dp_rank: int
    consumer: GroupedConsumer | None = None
    # The ranks `consumer` is connected to: each rank's side channels (`_rank_channels`).
    connected: tuple[str, ...] | None = None
    route: _Route | None = None  # how `connected` was found
    fingerprint: _Fingerprint | None = None  # the registrations `connected` came from
    stale: bool = False  # a load failed since: look the engine up again before the next
    seen_at: tuple[str, ...] = ()  # where the engine was last connected (to retire it)
    connecting: _Route | None = None  # a connect in flight, along this route
    waiting: list[_Load] = field(default_factory=list)  # loads waiting for a connect
    # Aborts waiting for a connect: the connect's task sends them itself, the moment it is
    # connected (the engine may not step again: nothing else would); guarded by the worker's
    # `_aborts_lock`, the one field the pool's threads touch.
    aborts: list[tuple[_Route, str]] = field(default_factory=list)

    @property
    def key(self) -> tuple[str, int]:
        return self.engine_id, self.dp_rank

    def __str__(self) -> str:
        return f"{self.engine_id} (DP rank {self.dp_rank})"


@dataclass
class _Connected:
    """A connect's outcome, handed from the pool to the engine's thread."""

    remote: _Remote
    route: _Route
    addresses: tuple[str, ...]
    fingerprint: _Fingerprint | None
    consumer: GroupedConsumer | None
    error: Exception | None


class WorkerSide:
    """One worker (a TP rank of a pipeline stage): a `GroupedProducer` (prefill) and a
    `GroupedConsumer` per remote engine (decode), over the layers of its stage, one producer
    or consumer per KV cache group.

    A prefill worker binds its side channel (a free port by default) and registers it with
    the engine's bootstrap service under (engine id, DP rank, TP rank, PP rank); the
    registration is renewed in the background and removed at `close`.

    Nothing here blocks the engine's step: a fetch is started and its `FetchHandle` kept, and
    `get_finished` collects the finished ones (no thread per load, so loads that wait for a
    request never published cost nothing to the others). The blocking calls, looking a remote
    engine's ranks up in its bootstrap service and creating and connecting its consumer (a
    handshake, up to `handshake_timeout_s`), run on the worker's thread pool, one task per
    remote engine while it connects; that engine's loads wait for it, others go on. A failed
    connect fails its loads with all their blocks; the next load connects again. The engine is
    looked up again before a load when its consumer lost a producer rank (a restart: new
    ports, found under a new generation) or when its last load failed; the consumer connects
    again only if the registrations changed. A load naming other fixed addresses than its
    engine's consumer is connected to connects again first; an engine that restarts at the
    same addresses is found again by the consumer itself. No lock is held anywhere: pool tasks
    hand their outcome over a queue.
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
        self._settings = settings
        self._engine_id = engine_id
        self._geometry = _engine_geometry(vllm_config, kv_cache_config)
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self._produces, self._consumes = produces, consumes
        self._groups: list[CacheGroup] = []
        # Per group: the vLLM KV cache group whose table it uses, and for a state group that
        # group's block size (its table is positional: the state is in the last token's block).
        self._tables_of: list[tuple[int, int | None]] = []
        self._producer: GroupedProducer | None = None
        parallel = vllm_config.parallel_config
        self._dp_rank = data_parallel_rank(vllm_config)
        self._pp_rank, self._pp_size = self._geometry.pp_rank, self._geometry.pp_size
        self._bootstrap_url = settings.bootstrap_url(parallel.data_parallel_master_ip)
        self._registration: Registration | None = None
        self._remotes: dict[tuple[str, int], _Remote] = {}
        self._connected: queue.SimpleQueue[_Connected] = queue.SimpleQueue()
        # Background work: connects (with their look-ups) and retirements. Registering runs on
        # a daemon thread of its own (`Registration.start`: it lasts as long as the worker).
        self._pool = ThreadPoolExecutor(
            _BACKGROUND_THREADS,
            thread_name_prefix=f"kvxfer-dp{self._dp_rank}-pp{self._pp_rank}-tp{self.tp_rank}",
        )
        self._tasks: list[concurrent.futures.Future[Any]] = []  # in flight
        self._aborts_lock = threading.Lock()  # `_Remote.aborts`, shared with connect tasks
        self._spare: GroupedConsumer | None = None  # created, never connected (see `_keep_spare`)
        self._loading: dict[str, _Load] = {}
        self._released: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._unreported_releases: set[str] = set()
        self._published: set[str] = set()
        self._finished_seen: set[str] = set()  # published requests vLLM said are finished
        self._load_errors: set[int] = set()
        self._stats = KvxferConnectorStats()
        self._expired_reported = 0  # the producer's expired requests already in stats
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
        )
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
                release=self._released.put,
                secret=s.secret,
                protocol=self.protocol,
                staging_bytes=s.staging_bytes,
                staging_slots=s.staging_slots,
                request_timeout_s=s.request_timeout_s,
                backend=s.backend,
            )
            self._register(self._producer.addresses)

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

    def _register(self, addresses: list[str]) -> None:
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

    def start_step(self, metadata: KvxferConnectorMetadata) -> None:
        self._take_connects()
        for send in metadata.sends:
            if self._producer is None:
                raise RuntimeError(
                    "KvxferConnector: asked to send KV but this engine's kv_role is not "
                    "kv_producer or kv_both"
                )
            tables = self._group_tables(send.block_ids, send.num_tokens)
            self._producer.publish(send.request_id, tables, send.num_tokens)
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
        route = _Route.of(spec.remote)
        deadline = time.monotonic() + self._settings.fetch_timeout_s
        load = _Load(spec, route, deadline)
        self._loading[spec.request_id] = load
        remote = self._remote(spec.remote)
        if self._ready(remote, route):
            self._fetch(remote, load)
        else:
            remote.waiting.append(load)
            self._connect(remote, route)

    def _ready(self, remote: _Remote, route: _Route) -> bool:
        """Whether `remote`'s consumer serves `route` as it is, with no connect in flight: for
        fixed addresses, connected to them; for a bootstrap route, connected to what it found
        there, no load failed since and no producer rank lost (a restarted worker registers
        new ports: look it up again first)."""
        if remote.connecting is not None or remote.connected is None:
            return False
        if route.bootstrap is None:
            return remote.connected == route.addresses
        return remote.route == route and not remote.stale and _every_session_alive(remote.consumer)

    def _fetch(self, remote: _Remote, load: _Load) -> None:
        spec = load.spec
        assert remote.consumer is not None
        try:
            load.handle = remote.consumer.fetch(
                spec.remote_request_id,
                self._group_tables(spec.block_ids, spec.num_tokens),
                spec.num_tokens,
                spec.start_token,
                timeout=max(0.0, load.deadline - time.monotonic()),
            )
        except Exception as exc:  # refused before any transfer: every block fails
            load.result = self._failed(spec, exc)

    def _group_tables(self, vllm_tables: list[list[int]], num_tokens: int) -> list[list[int]]:
        """Each of this worker's groups' block table, from vLLM's per-group tables: a Mamba
        group's table serves each of its state groups, as the one block holding the state
        after `num_tokens` tokens (vLLM's mamba_cache_mode "none" keeps it in the block of
        the last token; the entries before it are the null block)."""
        tables = []
        for index, state_block_size in self._tables_of:
            table = vllm_tables[index]
            if state_block_size is not None:
                table = [table[(num_tokens - 1) // state_block_size]]
            tables.append(table)
        return tables

    def _abort(self, abort: AbortSpec) -> None:
        """Give up the load of a request vLLM finished (if one runs here) and tell its prefill
        engine, which frees the request's blocks at once."""
        load = self._loading.get(abort.request_id)
        if load is not None and load.spec.remote_request_id == abort.remote_request_id:
            load.aborted = True
            if load.handle is not None:
                load.handle.cancel()  # ends soon; nothing of it lands afterwards
            elif load.result is None:  # still waiting for a connect: nothing can land
                self._remote(load.spec.remote).waiting.remove(load)
                load.result = TransferResult(False, [], 0, 0, "", 0.0, ["aborted"])
        route = _Route.of(abort.remote)
        remote = self._remote(abort.remote)
        if self._ready(remote, route):
            self._send_abort(remote, remote.consumer, abort.remote_request_id)
        else:
            with self._aborts_lock:
                remote.aborts.append((route, abort.remote_request_id))
            self._connect(remote, route)

    def _send_abort(
        self, remote: _Remote, consumer: GroupedConsumer | None, remote_request_id: str
    ) -> None:
        assert consumer is not None
        try:
            consumer.abort(remote_request_id)
        except Exception as exc:  # the engine frees the request at its request_timeout_s
            log.warning(
                "kvxfer: could not tell engine %s that %s is aborted: %s",
                remote,
                remote_request_id,
                exc,
            )

    def _failed(self, spec: LoadSpec, error: BaseException | str) -> TransferResult:
        """A load that ended before any transfer: every block it was to fill failed."""
        why = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        log.warning(
            "kvxfer: load of %s from engine %s failed before any transfer: %s",
            spec.request_id,
            spec.remote,
            why,
        )
        tables = self._group_tables(spec.block_ids, spec.num_tokens)
        failed = fetched_blocks(self._groups, tables, spec.num_tokens, spec.start_token)
        return TransferResult(False, failed, 0, 0, "", 0.0, [why])

    # ---- remote engines: look-ups and connects off the engine's thread ----

    def _remote(self, where: RemoteEngine) -> _Remote:
        key = (where.engine_id, where.dp_rank)
        remote = self._remotes.get(key)
        if remote is None:
            remote = self._remotes[key] = _Remote(where.engine_id, where.dp_rank)
        return remote

    def _connect(self, remote: _Remote, route: _Route) -> None:
        """Look `remote` up along `route` and connect it, on the pool, unless a connect runs
        already (what still waits when it ends starts the next one)."""
        if remote.connecting is not None:
            return
        remote.connecting = route
        consumer = remote.consumer
        if consumer is None:
            consumer, self._spare = self._spare, None
        current = (remote.connected, remote.fingerprint)
        self._in_background(self._connect_task, remote, consumer, route, current)

    def _connect_task(
        self,
        remote: _Remote,
        consumer: GroupedConsumer | None,
        route: _Route,
        current: tuple[tuple[str, ...] | None, _Fingerprint | None],
    ) -> None:
        """Find `remote`'s ranks along `route` (its bootstrap service), then connect
        `consumer` (created first if None) to them, unless it is connected to them already
        (`current`: its addresses, and the registrations they came from, if known: a new
        generation at the same addresses is a restart, connected again); hand the outcome to
        the engine's thread, which owns `remote`."""
        addresses, fingerprint, error = route.addresses, None, None
        connected, known = current
        try:
            if route.bootstrap is not None:
                addresses, fingerprint = self._look_up(route.bootstrap, remote)
            if consumer is None:
                consumer = self._new_consumer()
            same = fingerprint is None or known is None or fingerprint == known
            if connected != addresses or not same:
                consumer.connect(
                    [_split_channels(a) for a in addresses],
                    timeout=self._settings.handshake_timeout_s,
                )
            self._send_aborts_along(remote, route, consumer)
        except Exception as exc:
            error = exc
        self._connected.put(_Connected(remote, route, addresses, fingerprint, consumer, error))

    def _send_aborts_along(self, remote: _Remote, route: _Route, consumer: GroupedConsumer) -> None:
        """Send the aborts that waited for this connect, from the connect's own task: a
        decode engine whose only request was aborted steps no more, and the prefill engine
        would hold the request's blocks until its `request_timeout_s`."""
        for remote_request_id in self._take_aborts(remote, route):
            self._send_abort(remote, consumer, remote_request_id)

    def _take_aborts(self, remote: _Remote, route: _Route) -> list[str]:
        """Remove and return the aborts waiting for a connect along `route`."""
        with self._aborts_lock:
            mine = [rid for where, rid in remote.aborts if where == route]
            remote.aborts = [(where, rid) for where, rid in remote.aborts if where != route]
        return mine

    def _look_up(self, bootstrap: str, remote: _Remote) -> tuple[tuple[str, ...], _Fingerprint]:
        """The side channels of every worker of `remote` (every TP rank of every pipeline
        stage, in (PP, TP) rank order) from its bootstrap service, waiting up to
        `handshake_timeout_s` for workers not registered yet, and the registrations they come
        from. The consumer connects to all of them: the handshake tells which layers and heads
        each holds, and this rank fetches from those holding some of its own.

        Raises:
            LookupError: workers missing at the deadline, or the service unreachable.
        """
        s = self._settings
        client = BootstrapClient(bootstrap, secret=s.secret, timeout_s=s.handshake_timeout_s)
        workers = client.lookup(remote.engine_id, remote.dp_rank, s.handshake_timeout_s)
        return (
            tuple(_rank_channels(w.group_addresses or [w.address]) for w in workers),
            tuple((w.address, w.generation) for w in workers),
        )

    def _new_consumer(self) -> GroupedConsumer:
        assert self._groups, "register_kv_caches() comes first"
        s = self._settings
        return GroupedConsumer(
            self._groups,
            self._engine_id,
            s.side_channel_host,
            secret=s.secret,
            protocol=self.protocol,
            staging_bytes=s.staging_bytes,
            staging_slots=s.staging_slots,
            cost_model=s.cost_model,
            strategy=s.strategy,
            backend=s.backend,
            timeout_s=s.fetch_timeout_s,
            heartbeat_s=s.heartbeat_s,
            peer_timeout_s=s.peer_timeout_s,
        )

    def _take_connects(self) -> None:
        """Apply the connects that ended: start their loads' fetches and send their aborts,
        or fail them."""
        self._tasks = [t for t in self._tasks if not t.done()]
        while True:
            try:
                outcome = self._connected.get_nowait()
            except queue.Empty:
                return
            remote, route, addresses = outcome.remote, outcome.route, outcome.addresses
            consumer, error = outcome.consumer, outcome.error
            remote.connecting = None
            remote.connected = addresses if error is None else None
            if error is None:
                if remote.seen_at and remote.seen_at != addresses:
                    log.info(
                        "kvxfer: engine %s is now at %s (was %s): connected again",
                        remote,
                        ", ".join(addresses),
                        ", ".join(remote.seen_at),
                    )
                remote.consumer, remote.seen_at = consumer, addresses
                remote.route, remote.stale = route, False
                if outcome.fingerprint is not None:
                    remote.fingerprint = outcome.fingerprint
                elif remote.fingerprint and tuple(a for a, _ in remote.fingerprint) != addresses:
                    remote.fingerprint = None  # connected elsewhere: its registrations unknown
                self._retire_others(remote)
            else:
                if remote.consumer is None and consumer is not None:
                    self._keep_spare(consumer)
                log.warning("kvxfer: cannot connect to engine %s at %s: %s", remote, route, error)
            waiting, remote.waiting = remote.waiting, []
            for load in waiting:
                if load.route != route:
                    remote.waiting.append(load)  # its engine moved again meanwhile
                elif error is None:
                    self._fetch(remote, load)
                else:
                    load.result = self._failed(load.spec, error)
            # The connect's task sent the aborts it found; these came after it looked (or
            # its connect failed: dropped, the prefill engine frees at its request_timeout_s).
            late = self._take_aborts(remote, route)
            for remote_request_id in late if error is None else []:
                self._send_abort(remote, consumer, remote_request_id)
            with self._aborts_lock:
                pending_abort = remote.aborts[-1][0] if remote.aborts else None
            if remote.waiting or pending_abort is not None:
                again = remote.waiting[-1].route if remote.waiting else pending_abort
                assert again is not None
                self._connect(remote, again)
            elif remote.consumer is None:
                del self._remotes[remote.key]  # never connected: keep nothing

    def _keep_spare(self, consumer: GroupedConsumer) -> None:
        """Keep a consumer whose first connect failed for the next remote engine: destroying
        a Mooncake engine stalls the whole process for about a second (it holds the GIL), so
        a decode engine pointed at a dead prefill engine must not create and destroy one per
        load. At most one is kept."""
        if self._spare is None:
            self._spare = consumer
        else:
            self._in_background(consumer.close)

    def _retire_others(self, remote: _Remote) -> None:
        """Close the consumers of engines that were where `remote` now is: they restarted
        under a new engine id (vLLM's default), so nothing of theirs comes back."""
        for other in list(self._remotes.values()):
            if other is remote or other.connecting is not None or other.waiting:
                continue
            if set(other.seen_at) & set(remote.seen_at):
                del self._remotes[other.key]
                log.info(
                    "kvxfer: engine %s replaced engine %s at %s",
                    remote,
                    other,
                    ", ".join(remote.seen_at),
                )
                if other.consumer is not None:  # fails its fetches still running, if any
                    self._in_background(other.consumer.close)

    def _in_background(self, target: Any, *args: Any) -> None:
        self._tasks.append(self._pool.submit(target, *args))

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
                self._remote(load.spec.remote).waiting.remove(load)
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
                remote = self._remotes.get((load.spec.remote.engine_id, load.spec.remote.dp_rank))
                if remote is not None:
                    remote.stale = True  # look it up again before its next load
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
        if self._producer is not None:
            expired = self._producer.expired_requests
            self._stats.record_expired(expired - self._expired_reported)
            self._expired_reported = expired
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, KvxferConnectorStats()
        return stats

    def close(self) -> None:
        """Unregister from the bootstrap service (so no decode worker is sent here any more),
        then close the consumers and the producer."""
        if self._registration is not None:
            self._registration.stop(timeout=5.0)  # it unregisters within about 3 s
        # Connects end within twice handshake_timeout_s (a look-up, then a handshake).
        concurrent.futures.wait(self._tasks, timeout=2 * self._settings.handshake_timeout_s + 5)
        self._pool.shutdown(wait=False)
        self._registration = None
        consumers = [self._spare, *(r.consumer for r in self._remotes.values())]
        self._spare = None
        while True:
            try:
                consumers.append(self._connected.get_nowait().consumer)
            except queue.Empty:
                break
        for consumer in consumers:
            if consumer is not None:
                consumer.close()
        self._remotes.clear()
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


def _every_session_alive(consumer: GroupedConsumer | None) -> bool:
    """Whether `consumer` has lost no producer rank in any group (a dead session: the rank
    went silent or restarted). Its monitoring snapshots take no lock and make no call."""
    if consumer is None:
        return False
    try:
        return consumer.dead_sessions() == 0
    except Exception:  # a snapshot taken while the consumer changes: look up again
        return False


def _rank_channels(addresses: list[str]) -> str:
    """A producer rank's side channels, one per KV cache group, as one string (comma
    separated: addresses hold none), so that ranks compare and log as plain strings."""
    return ",".join(addresses)


def _split_channels(channels: str) -> list[str]:
    """The per-group side channels of `_rank_channels`."""
    return channels.split(",")


def attention_backends(
    vllm_config: VllmConfig, names: list[str]
) -> dict[str, tuple[str, str | None]]:
    """Each named layer's attention backend (`get_name()`) and, on CPU attention, the
    instruction set its cache write uses (`layer.isa`, set by the backend's metadata builder
    before the caches are registered), from vLLM's forward context. Layers it does not hold
    (or that have no attention backend) are left out."""
    context = vllm_config.compilation_config.static_forward_context
    found: dict[str, tuple[str, str | None]] = {}
    for name in names:
        get_backend = getattr(context.get(name), "get_attn_backend", None)
        if get_backend is not None:
            found[name] = (str(get_backend().get_name()), getattr(context[name], "isa", None))
    return found


def _attention_geometry(
    geometry: EngineGeometry, names: list[str], backends: dict[str, tuple[str, str | None]]
) -> EngineGeometry:
    """`geometry` with what the layers' attention backend says of their layout (the table of
    `kvxfer.integrations.vllm.backends`): never read from the strides alone.

    Raises:
        ValueError: a layer without a known backend, a backend or setting the table refuses,
            or a reading that contradicts the model (a latent cache without MLA, or back).
    """
    unknown = [name for name in names if name not in backends]
    if unknown:
        raise ValueError(
            f"kvxfer: cannot tell the attention backend of layers {unknown[:4]} (not in vLLM's "
            "forward context); kvxfer reads each backend's KV layout from its table and "
            "refuses to guess it from the strides"
        )
    reading = engine_reading(
        ((name, *backends[name]) for name in names), geometry.kv_cache_dtype or "auto"
    )
    if (reading == "latent") != geometry.mla:
        raise ValueError(
            f"kvxfer: attention backend {backends[names[0]][0]} keeps a {reading} cache, but "
            f"the model {'uses' if geometry.mla else 'does not use'} MLA"
        )
    return dataclasses.replace(geometry, k_transposed=reading == "k_transposed")


def cache_groups(
    kv_caches: dict[str, torch.Tensor],
    kv_cache_config: KVCacheConfig | None,
    geometry: EngineGeometry,
    backends: dict[str, tuple[str, str | None]],
) -> tuple[list[CacheGroup], list[tuple[int, int | None]]]:
    """This worker's KV cache groups, in vLLM's group order, and the vLLM group whose block
    table each uses (with a state group's block size: see `WorkerSide._group_tables`): each
    attention group's
    registered layers with its own spec (block size included) and its sliding window, if any;
    a Mamba group becomes one state group per (state, sub-projection) (`mamba_state_layout`).
    Without a `kv_cache_config` (or with one group), every registered layer is one group.
    `backends` are the layers' attention backends (`attention_backends`): an attention
    group's layout comes from their table, the strides are checked against it.

    Raises:
        ValueError: a group kvxfer cannot move, or several groups with pipeline parallelism,
            naming the group and the fix.
    """
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    groups = list(kv_cache_config.kv_cache_groups) if kv_cache_config is not None else []
    if len(groups) <= 1:
        layers = list(kv_caches)
        window = _window_of(groups[0].kv_cache_spec) if groups else None
        spec, caches = spec_from_layers(
            list(kv_caches.values()),
            _attention_geometry(geometry, layers, backends),
            _layer_indices(layers, geometry.pp_size),
        )
        return [CacheGroup(spec, caches, window)], [(0, None)]
    if geometry.pp_size > 1:
        raise ValueError(
            f"kvxfer: {len(groups)} KV cache groups with pipeline parallelism are not "
            "supported; run the model with pipeline_parallel_size 1, or disable the hybrid "
            "KV cache manager (--disable-hybrid-kv-cache-manager)"
        )
    result: list[CacheGroup] = []
    tables: list[tuple[int, int | None]] = []
    for index, group in enumerate(groups):
        kind = group.kv_cache_spec
        names = [name for name in group.layer_names if name in kv_caches]
        if not names:
            raise ValueError(
                f"kvxfer: none of KV cache group {index}'s layers ({group.layer_names[:4]}) "
                "was registered; register every layer's cache"
            )
        if isinstance(kind, MambaSpec):
            state = mamba_state_layout(kind, geometry.tp_size, geometry.tp_rank, index)
            added = state.groups([kv_caches[n] for n in names])
            result.extend(added)
            tables.extend([(index, int(kind.block_size))] * len(added))
            continue
        if not isinstance(kind, (FullAttentionSpec, SlidingWindowSpec)):
            raise ValueError(
                f"kvxfer: KV cache group {index} is a {type(kind).__name__}; kvxfer moves "
                "full-attention, sliding-window and Mamba groups"
            )
        own = _attention_geometry(
            dataclasses.replace(geometry, block_size=int(kind.block_size)), names, backends
        )
        spec, caches = spec_from_layers(
            [kv_caches[n] for n in names], own, _layer_indices(names, geometry.pp_size)
        )
        result.append(CacheGroup(spec, caches, _window_of(kind)))
        tables.append((index, None))
    return result, tables


def mamba_state_layout(kind: Any, tp_size: int, tp_rank: int, index: int = 0) -> StateLayout:
    """How a vLLM `MambaSpec` group keeps its states in its pages, with the conv state's
    sub-projections: Mamba1 `[x]`, Mamba2 `[x, B, C]` (x from the SSM state: heads x
    head_dim; B and C share the rest), gated delta net `[Q, K, V]` (V from the SSM state: value
    heads x value head dim; Q and K share the rest).

    Raises:
        ValueError: a layout kvxfer cannot move, naming the fix: the conv state stored
            state-len-major (`VLLM_SSM_CONV_STATE_LAYOUT=DS` stores it channel-major, as vLLM's
            own heterogeneous-TP transfers require), a `mamba_cache_mode` other than "none",
            speculative state blocks, a state replicated over the ranks, another Mamba type.
    """
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    where = f"kvxfer: KV cache group {index} (Mamba)"
    if not is_conv_state_dim_first():
        raise ValueError(
            f"{where}: the conv state is stored (state_len, channels); set "
            "VLLM_SSM_CONV_STATE_LAYOUT=DS on both engines (channels first: each rank's slice "
            "of a sub-projection is then one run of bytes)"
        )
    if kind.mamba_cache_mode != "none" or kind.num_speculative_blocks:
        raise ValueError(
            f"{where}: mamba_cache_mode {kind.mamba_cache_mode!r} with "
            f"{kind.num_speculative_blocks} speculative blocks; kvxfer moves the one state "
            "block of mamba_cache_mode 'none' without speculative decoding"
        )
    if getattr(kind, "tp_replicated", False):
        raise ValueError(f"{where}: a state replicated over TP ranks is not supported")
    if len(kind.shapes) != 2:
        raise ValueError(f"{where}: {len(kind.shapes)} states per layer; kvxfer moves conv + SSM")
    (conv_local, state_len), ssm_shape = kind.shapes
    conv_rows, ssm_rows = conv_local * tp_size, ssm_shape[0] * tp_size
    mamba = MambaAttentionBackendEnum
    if kind.mamba_type == mamba.MAMBA1:
        segments: tuple[int, ...] = (conv_rows,)
    elif kind.mamba_type == mamba.MAMBA2:
        x = ssm_rows * ssm_shape[1]
        segments = (x, (conv_rows - x) // 2, (conv_rows - x) // 2)
    elif kind.mamba_type == mamba.GDN_ATTN:
        v = ssm_rows * ssm_shape[1]
        segments = ((conv_rows - v) // 2, (conv_rows - v) // 2, v)
    else:
        raise ValueError(f"{where}: mamba_type {kind.mamba_type} is not supported")
    if sum(segments) != conv_rows or min(segments) <= 0:
        raise ValueError(
            f"{where}: conv channels {conv_rows} do not split into sub-projections "
            f"{segments} for {kind.mamba_type}"
        )
    conv_dtype, ssm_dtype = kind.dtypes
    return StateLayout(
        (
            StateComponent(conv_rows, (state_len,), conv_dtype, segments),
            StateComponent(ssm_rows, tuple(ssm_shape[1:]), ssm_dtype),
        ),
        int(kind.page_size_bytes),
        tp_size,
        tp_rank,
    )


def _window_of(kind: Any) -> int | None:
    """A vLLM group spec's sliding window in tokens (None: full attention)."""
    window = getattr(kind, "sliding_window", None)
    return int(window) if window else None


def _engine_geometry(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None
) -> EngineGeometry:
    """This rank's geometry from vLLM's configuration (model, cache, parallel)."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    block_size = vllm_config.cache_config.block_size
    if kv_cache_config is not None and kv_cache_config.kv_cache_groups:
        block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
    pp_size = parallel.pipeline_parallel_size
    return EngineGeometry(
        total_kv_heads=1 if model.use_mla else model.get_total_num_kv_heads(),
        head_dim=model.get_head_size(),
        block_size=block_size,
        tp_size=parallel.tensor_parallel_size,
        tp_rank=_tp_rank(vllm_config),
        mla=bool(model.use_mla),
        kv_cache_dtype=str(vllm_config.cache_config.cache_dtype),
        pp_size=pp_size,
        pp_rank=_pp_rank(vllm_config),
        kv_layers=_model_kv_layers(vllm_config) if pp_size > 1 else (),
    )


def _model_kv_layers(vllm_config: VllmConfig) -> tuple[int, ...]:
    """The model-layer index of every layer of the model (every pipeline stage) that holds a
    KV cache: every decoder layer except no-op attention layers (models whose
    `block_configs` mark them, as vLLM's `get_num_layers_by_block_type` reads them). Checked
    against vLLM's count of attention layers."""
    model = vllm_config.model_config
    total = int(model.get_total_num_hidden_layers())
    layers: tuple[int, ...] = tuple(range(total))
    if getattr(model, "has_noops", False):
        configs = model.hf_config.block_configs
        layers = tuple(i for i, c in enumerate(configs) if not c.attention.no_op)
    counted = _attention_layers(vllm_config)
    if counted is not None and counted != len(layers):
        raise ValueError(
            f"kvxfer: the model has {len(layers)} layers with a KV cache by its configuration "
            f"but vLLM counts {counted} attention layers; pipeline parallelism over this model "
            "is not supported by the vLLM integration"
        )
    return layers


def _attention_layers(vllm_config: VllmConfig) -> int | None:
    """vLLM's count of the model's attention layers over every stage (None when vLLM cannot
    count them)."""
    from types import SimpleNamespace

    # The whole model as one stage: all vLLM reads of a parallel config to count layers.
    whole: Any = SimpleNamespace(rank=0, tensor_parallel_size=1, pipeline_parallel_size=1)
    try:
        return int(vllm_config.model_config.get_num_layers_by_block_type(whole, "attention"))
    except Exception:  # a model vLLM cannot count (or an uneven VLLM_PP_LAYER_PARTITION)
        return None


def _layer_indices(names: list[str], pp_size: int) -> list[int] | None:
    """The model-layer index of each registered cache, from its name (vLLM's
    `extract_layer_index`: `model.layers.7.self_attn.attn` is layer 7). Without pipeline
    parallelism, None when the names do not give one index each (the caches are then taken
    in vLLM's order, as they always were).

    Raises:
        ValueError: with pipeline parallelism, a name without its layer's index.
    """
    from vllm.model_executor.models.utils import extract_layer_index

    try:
        indices = [int(extract_layer_index(name)) for name in names]
    except (AssertionError, ValueError, IndexError) as exc:
        if pp_size == 1:
            return None
        raise ValueError(
            f"kvxfer: pipeline parallelism needs each KV cache's layer index in its name; "
            f"cannot read one from {names[:4]}: {exc}"
        ) from None
    if pp_size == 1 and len(set(indices)) != len(indices):
        return None  # several caches per layer: not placed by name (one group checks them)
    return indices


def _pp_rank(vllm_config: VllmConfig) -> int:
    """vLLM's PP group rank when it is initialized, else from the worker's rank in its config
    (vLLM orders ranks TP-fastest)."""
    from vllm.distributed import parallel_state

    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size == 1:
        return 0
    if parallel_state.model_parallel_is_initialized():
        return int(parallel_state.get_pp_group().rank_in_group)
    return int(parallel.rank) // parallel.tensor_parallel_size % parallel.pipeline_parallel_size


def _tp_rank(vllm_config: VllmConfig) -> int:
    """vLLM's TP group rank when it is initialized, else the worker's rank in its config."""
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return int(parallel_state.get_tensor_model_parallel_rank())
    parallel = vllm_config.parallel_config
    return int(parallel.rank) % parallel.tensor_parallel_size
