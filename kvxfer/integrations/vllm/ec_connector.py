"""`KvxferECConnector`: vLLM's encoder-cache connector API over `kvxfer.ec`."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
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

from kvxfer.ec import ECLoadError, item_key
from kvxfer.integrations.vllm.engine_config import tp_rank
from kvxfer.integrations.vllm.logs import log_through_vllm

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


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
    "ec_consumer", "ec_connector_extra_config": {"backend": "PoolECConnector", ...}}'`.

    `backend` names a `kvxfer.ec.ECConnectorFactory` connector ("PoolECConnector", the
    default, or "SharedStorageECConnector"; with `backend_module_path`, a class of one's own);
    `relay_dir` (default /dev/shm, else the temporary directory) and `prefetch_workers` (4) are
    this class's; every other extra-config key is the backend's config (docs/vllm.md, "Encoder
    cache"). The encoder instance (`ec_producer`) stores each item's output from TP rank 0
    (outputs are replicated across ranks); a save that fails is logged, never raised (the
    prefill instance then encodes the item itself).

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
        log_through_vllm()
        config = vllm_config.ec_transfer_config
        assert config is not None  # the base class refuses to start without it
        extra = dict(config.ec_connector_extra_config or {})
        self._backend = str(extra.pop("backend", "PoolECConnector"))
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
        saves_here = role == ECConnectorRole.WORKER and tp_rank(vllm_config) == 0
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
