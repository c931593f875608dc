"""kvxfer's SGLang transfer manager (`KvxferKVManager`, on SGLang's `CommonKVManager`): each
rank's producer or consumers (a `KVProducer` or `KVConsumer` per cache group: the target model's
pool, and the draft model's under speculative decoding), the control messages over SGLang's
ZeroMQ sockets, and what it keeps per request (`kvxfer.integrations.sglang.conn` has the flow,
and the sender and receiver that drive it); with the settings and the model facts it reads
from SGLang."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
from sglang.srt.disaggregation.common.conn import (
    ABORT_TAG,
    AbortNotification,
    CommonKVManager,
    PrefillServerInfo,
)
from sglang.srt.disaggregation.utils import DisaggregationMode

from kvxfer.connector import ReleaseReason
from kvxfer.connector.groups import CacheGroup, GroupedConsumer, GroupedFetch, GroupedProducer
from kvxfer.integrations.settings import ConnectorSettings
from kvxfer.integrations.sglang.control import (
    ControlError,
    Published,
    Reading,
    Refused,
    Register,
    Registered,
    frames_of,
    is_control,
    message_of,
    refused_registration,
)
from kvxfer.integrations.sglang.pools import SGLangModel, kv_dtype_name, sglang_cache
from kvxfer.integrations.sglang.scales import scales_of
from kvxfer.session.auth import new_nonce
from kvxfer.spec import DTYPE_ITEMSIZE, FP8_DTYPES

log = logging.getLogger(__name__)

_MAX_ABORTED_ROOMS = 100_000  # recent decode aborts a prefill rank remembers
CONFIG_ENV = "KVXFER_CONFIG"  # JSON of kvxfer's connector settings (docs/sglang.md)


def load_settings() -> ConnectorSettings:
    """kvxfer's settings for SGLang, from `KVXFER_CONFIG` (JSON, the keys of vLLM's
    `kv_connector_extra_config`; SGLang has no per-backend configuration)."""
    raw = os.environ.get(CONFIG_ENV, "")
    try:
        extra = json.loads(raw) if raw else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"{CONFIG_ENV}: not JSON ({exc}); pass an object of settings") from None
    return ConnectorSettings.from_extra_config(extra)


def pool_entries(kv_args: KVArgs) -> tuple[slice, slice]:
    """Which of `KVArgs`' KV buffers are the target model's pool and which the draft model's:
    SGLang appends the draft pool's (speculative decoding, `num_draft_entries`)."""
    target = len(kv_args.kv_data_ptrs) - (getattr(kv_args, "num_draft_entries", 0) or 0)
    return slice(0, target), slice(target, len(kv_args.kv_data_ptrs))


def model_of(server_args: Any, kv_args: KVArgs, is_mla: bool, draft: bool = False) -> SGLangModel:
    """What a pool's pointers do not say, from SGLang's `ModelConfig`: the target model's pool,
    or with `draft` the draft model's (its layers those of its pool, in order).

    Raises:
        ValueError: hybrid state (Mamba, sliding window...), naming the model kind: kvxfer's
            SGLang backend moves full-attention KV only; or an fp8 pool whose model's scales
            were not recorded (`scales_of`).
    """
    from sglang.srt.configs.model_config import ModelConfig

    state_types = list(getattr(kv_args, "state_types", None) or [])
    if state_types:
        kinds = ", ".join(str(getattr(t, "value", t)) for t in state_types)
        raise ValueError(
            f"this model keeps hybrid state ({kinds}) beside its KV cache; kvxfer's SGLang "
            "backend moves full-attention KV only: serve it with another transfer backend"
        )
    entries = pool_entries(kv_args)[1 if draft else 0]
    if draft:  # an MTP model's draft is its own checkpoint's next-token layers
        path = server_args.speculative_draft_model_path or server_args.model_path
        config = ModelConfig.from_server_args(server_args, model_path=path, is_draft_model=True)
    else:
        config = ModelConfig.from_server_args(server_args)
    dtype = kv_dtype_name(kv_args.kv_cache_dtype_str, config.dtype)
    pool_layers = (entries.stop - entries.start) // (1 if is_mla else 2)
    # An fp8 pool's spec carries its layers' scales (what a converting transfer divides or
    # multiplies by): a pipeline stage's layers (MHA: a K and a V buffer each), or the draft's.
    start = getattr(kv_args, "prefill_start_layer", 0) or 0
    layers: range | int = pool_layers if draft else range(start, start + pool_layers)
    k_scales, v_scales = scales_of(layers, draft) if dtype in FP8_DTYPES else ((), ())
    total_layers = pool_layers if draft else config.num_hidden_layers
    if is_mla:
        # The latent width (kv_lora_rank + qk_rope_head_dim) is the pool's row.
        row = kv_args.kv_item_lens[entries.start] // kv_args.page_size
        head_dim = row // DTYPE_ITEMSIZE[dtype]
        return SGLangModel(1, head_dim, total_layers, dtype, mla=True, k_scales=k_scales)
    heads = config.get_total_num_kv_heads()
    return SGLangModel(heads, config.head_dim, total_layers, dtype, False, k_scales, v_scales)


@dataclass
class _Sent:
    """What a prefill rank was given of a request so far (its chunks' pages and tokens)."""

    pages: list[np.ndarray] = field(default_factory=list)
    tokens: int = 0


@dataclass
class DecodeLoad:
    """A decode rank's request: where it goes, and how its fetch stands."""

    key: str
    pages: np.ndarray
    aux_index: int
    prefix: int
    num_tokens: int | None = None
    aux: bytes | None = None
    handle: GroupedFetch | None = None
    aborted: bool = False  # never start its fetch: SGLang may give its pages away


class KvxferKVManager(CommonKVManager):
    """One rank's kvxfer endpoint inside SGLang: a `GroupedProducer` (prefill) or
    `GroupedConsumer`s, one per prefill DP group it reads (decode), over SGLang's pools, plus
    the listener of SGLang's control socket (the module docstring)."""

    # The pages of a failed or aborted load are held until its fetch ended (no late byte lands
    # in a page SGLang gave to another request): `is_abort_release_safe`.
    supports_deferred_decode_kv_release = True
    # SGLang's status messages (a prefill's failure, to its decode ranks) carry their reason,
    # under a tag of their own beside kvxfer's frames.
    kv_status_msg_tag = b"KVXFER_STATUS"
    kv_status_msg_carries_reason = True

    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: DisaggregationMode,
        server_args: Any,
        is_mla_backend: bool | None = False,
    ) -> None:
        super().__init__(args, disaggregation_mode, server_args, bool(is_mla_backend))
        self.settings = load_settings()
        self.host = os.environ.get("KVXFER_HOST") or self.local_ip
        prefill = disaggregation_mode == DisaggregationMode.PREFILL
        if not prefill and self.pp_size > 1:
            raise ValueError(
                "kvxfer's SGLang backend: decode pipeline parallelism is not supported; "
                "serve the decode engine with --pp-size 1 (the prefill may use any)"
            )
        self.groups = self._cache_groups(server_args, args, bool(is_mla_backend))
        self.spec = self.groups[0].spec
        self._lock = threading.Lock()
        self.producer: GroupedProducer | None = None
        self._sent: dict[int, _Sent] = {}
        self._published: set[int] = set()  # rooms on the producer, not released yet
        self._aborted_rooms: OrderedDict[int, None] = OrderedDict()  # SGLang ABORT notices
        self._consumers: dict[str, GroupedConsumer | Exception] = {}
        self._hellos: dict[str, dict[int, list[str]]] = {}
        self._nonces: dict[str, str] = {}  # the registration each group's answers must name
        self._expected: dict[str, int] = {}
        self._loads: dict[int, DecodeLoad] = {}
        self._early_aborts: dict[str, set[int]] = {}  # rooms aborted before their group connected
        if prefill:
            self.engine_id = f"sglang-prefill-{uuid.uuid4().hex[:12]}"
            self.producer = self._new_producer()
            handle = self._on_prefill_message
        else:
            host = getattr(server_args, "host", "127.0.0.1")
            port = getattr(server_args, "port", 0)
            self.engine_id = f"sglang-decode-{host}:{port}-dp{self.attn_dp_rank}"
            self._start_heartbeat_checker_thread()
            handle = self._on_decode_message
        listener = threading.Thread(target=self._listen, args=(handle,), name="kvxfer-sglang")
        listener.daemon = True
        listener.start()

    def _cache_groups(self, server_args: Any, args: KVArgs, mla: bool) -> list[CacheGroup]:
        """The rank's pools as kvxfer's cache groups: the target model's, then the draft
        model's where speculative decoding keeps one (its pages are the target's: SGLang
        sends one page list for both)."""
        target, draft = pool_entries(args)
        groups = []
        for entries, is_draft in ((target, False), (draft, True)):
            if is_draft and entries.start == entries.stop:
                break
            if is_draft and self.pp_size > 1:
                raise ValueError(
                    "kvxfer's SGLang backend: speculative decoding's draft KV with prefill "
                    "pipeline parallelism is not supported; serve the prefill with --pp-size 1"
                )
            spec, caches = sglang_cache(
                args.kv_data_ptrs[entries],
                args.kv_data_lens[entries],
                args.kv_item_lens[entries],
                args.page_size,
                model_of(server_args, args, mla, draft=is_draft),
                tp_size=self.attn_tp_size,
                tp_rank=self.attn_tp_rank,
                pp_size=1 if is_draft else self.pp_size,
                pp_rank=0 if is_draft else self.pp_rank,
                layer_start=0 if is_draft else getattr(args, "prefill_start_layer", 0) or 0,
                device=_pool_device(server_args, args),
            )
            groups.append(CacheGroup(spec, caches))
        return groups

    def _listen(self, handle: Callable[[list[bytes]], None]) -> None:
        """Serve the control messages on the PULL socket Common bound: `handle` each; a bad
        one is logged, and the next served."""
        recv = self._make_worker_recv(self.server_socket)
        while True:
            msg = recv()
            if msg is None:
                continue
            try:
                handle(msg)
            except Exception:
                log.exception("kvxfer: bad control message %r", msg[:1])

    # ---- prefill ------------------------------------------------------------------------

    def _new_producer(self) -> GroupedProducer:
        s = self.settings
        return GroupedProducer(
            self.groups,
            self.engine_id,
            host=self.host,
            release=self._released,
            **s.producer_options(s.transport_protocol().protocol),
        )

    def _on_prefill_message(self, msg: list[bytes]) -> None:
        """A decode rank's control message (`kvxfer.integrations.sglang.control`: its
        registration, answered with this rank's side channels, or its `Reading`), or SGLang's
        ABORT notice."""
        if is_control(msg):
            self._on_prefill_control(msg)
        elif msg[0] == ABORT_TAG:
            notice = AbortNotification.from_zmq(msg)
            if notice is not None:
                reason = "the decode engine aborted the request"
                self.give_up(notice.room, reason)
                self.record_failure(notice.room, reason)
                self.update_status(notice.room, KVPoll.Failed)

    def _on_prefill_control(self, frames: list[bytes]) -> None:
        secret = self.settings.secret
        try:
            message = message_of(frames, secret)
        except ControlError as exc:
            log.warning("kvxfer: refused a decode rank's control message: %s", exc)
            refusal = refused_registration(frames, str(exc))
            if refusal is not None:
                self._send_multipart_locked(*refusal)
            return
        if isinstance(message, Register):
            assert self.producer is not None
            answer = Registered(
                group=message.group,
                rank=self.pp_rank * self.attn_tp_size + self.attn_tp_rank,
                addresses=self.producer.addresses,  # one a cache group
                nonce=message.nonce,
            )
            self._send_multipart_locked(
                f"tcp://{message.ip}:{message.port}", frames_of(answer, secret)
            )
        elif isinstance(message, Reading):
            self._note_reader(message)

    def _note_reader(self, reading: Reading) -> None:
        """A decode rank will read the request: once every one of the decode engine's ranks
        did, the sender is `WaitingForInput`."""
        reader = SimpleNamespace(
            endpoint=reading.ip, dst_port=reading.port, is_dummy=False,
            required_dst_info_num=reading.readers,
        )  # fmt: skip
        readers = self.transfer_infos.setdefault(reading.room, {})
        readers[(reading.ip, reading.port)] = reader
        self.req_to_decode_prefix_len[reading.room] = reading.prefix
        if len(readers) == reading.readers:
            self.update_status(reading.room, KVPoll.WaitingForInput)

    def add_transfer_request(
        self,
        bootstrap_room: int,
        kv_indices: Any,
        index_slice: slice,
        is_last_chunk: bool,
        aux_index: int | None = None,
        state_indices: Any = None,
        num_kv_tokens: int | None = None,
        **kwargs: Any,
    ) -> None:
        """A chunk of the request's pages is computed (`CommonKVSender.send`); the last one
        publishes the request and tells its decode ranks."""
        wait_event = kwargs.get("wait_event")
        if wait_event is not None:
            wait_event.synchronize()  # an early send's pages are written on another stream
        pages = np.asarray(kv_indices, dtype=np.int64).reshape(-1)
        with self._lock:
            sent = self._sent.setdefault(bootstrap_room, _Sent())
            sent.pages.append(pages)
            tokens = len(pages) * self.spec.block_size if num_kv_tokens is None else num_kv_tokens
            sent.tokens += tokens
        if not is_last_chunk:
            return
        with self._lock:
            if bootstrap_room in self._aborted_rooms:
                return  # its decode gave it up: never published (the status says Failed)
            self._published.add(bootstrap_room)
        prefix = self.req_to_decode_prefix_len.get(bootstrap_room, 0)
        num_tokens = prefix + sent.tokens
        table = np.concatenate(
            [np.zeros(prefix // self.spec.block_size, dtype=np.int64), *sent.pages]
        )
        assert self.producer is not None
        try:
            self.producer.publish(
                str(bootstrap_room), [table] * len(self.groups), num_tokens, first_token=prefix,
                deadline_s=self.settings.request_timeout_s,
            )  # fmt: skip
        except ValueError as exc:
            self.record_failure(bootstrap_room, f"kvxfer: {exc}")
            self.update_status(bootstrap_room, KVPoll.Failed)
            return
        self.update_status(bootstrap_room, KVPoll.Transferring)
        aux = self._aux_row(aux_index) if self._serves_aux() and aux_index is not None else b""
        published = Published(room=bootstrap_room, tokens=num_tokens, aux=aux)
        frames = frames_of(published, self.settings.secret)
        for ip, port in self.transfer_infos.get(bootstrap_room, {}):
            self._send_multipart_locked(f"tcp://{ip}:{port}", frames)

    def give_up(self, room: int, reason: str) -> None:
        """Nobody may read the request any more (SGLang's decode gave it up: its abort, a
        failure or its waiting timeout; or the prefill aborted it). Published: its producer
        fails it, and once `fail` returns no read of the pages is confirmed and no pack of them
        offered, so SGLang may free the pages at once; not yet: it is never published."""
        with self._lock:
            self._aborted_rooms[room] = None
            while len(self._aborted_rooms) > _MAX_ABORTED_ROOMS:
                self._aborted_rooms.popitem(last=False)
            published = room in self._published
            self._sent.pop(room, None)
        if published:
            assert self.producer is not None
            self.producer.fail(str(room), reason)

    def _serves_aux(self) -> bool:
        """The last stage's ranks send the aux row (each sampled the same first token, as SGLang's
        TP ranks do): a decode rank takes the first, so no single prefill rank is needed."""
        return self.pp_rank == self.pp_size - 1

    def _aux_row(self, index: int) -> bytes:
        """Row `index` of every metadata buffer, back to back."""
        a = self.kv_args
        return b"".join(
            ctypes.string_at(ptr + index * n, n)
            for ptr, n in zip(a.aux_data_ptrs, a.aux_item_lens, strict=True)
        )

    def _released(self, request_id: str, reason: ReleaseReason) -> None:
        """(the producer's side-channel thread) Every decode rank confirmed its reads, its
        engine aborted it, its prefill failed or its deadline passed: SGLang may free the
        pages. Only a deadline is a failure SGLang has not heard of from elsewhere."""
        room = int(request_id)
        with self._lock:
            self._sent.pop(room, None)
            self._published.discard(room)
        if reason is ReleaseReason.EXPIRED:
            self.record_failure(
                room,
                f"kvxfer: no decode rank finished reading the request within "
                f"{self.settings.request_timeout_s:.0f} s (request_timeout_s)",
            )
            self.update_status(room, KVPoll.Failed)
        else:
            self.update_status(room, KVPoll.Success)

    # ---- decode -------------------------------------------------------------------------

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """SGLang's look-up of the prefill engine, without its refusals of a different page
        size, TP ratio or KV dtype: kvxfer bridges all three (a dtype with each fp8 side's
        scales, as SGLang's own fp8 write quantizes: docs/sglang.md)."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        import requests

        url = (
            f"http://{bootstrap_addr}/route?prefill_dp_rank=-1&prefill_cp_rank=-1"
            "&target_tp_rank=-1&target_pp_rank=-1"
        )
        try:
            response = requests.get(url, timeout=5)
        except Exception as exc:
            log.error("kvxfer: bootstrap server %s: %s", bootstrap_addr, exc)
            return False
        if response.status_code != 200:
            return False
        info = PrefillServerInfo(**response.json())
        if info.attn_cp_size != 1:
            raise RuntimeError(
                f"prefill context parallelism ({info.attn_cp_size}) is not supported by "
                "kvxfer's SGLang backend: serve the prefill with CP 1"
            )
        self._resolve_rank_mapping(info)
        self.prefill_info_table[bootstrap_addr] = info
        return True

    def _resolve_rank_mapping(self, info: PrefillServerInfo) -> None:
        """Every decode rank talks to every rank of the prefill DP group: kvxfer plans which
        heads and layers each pair moves (SGLang's mapping divides TP sizes)."""
        info.target_tp_rank = 0
        info.target_tp_ranks = list(range(info.attn_tp_size))
        info.target_cp_ranks = [0]
        info.target_pp_ranks = list(range(info.pp_size))
        info.required_dst_info_num = self.attn_tp_size * self.pp_size
        info.required_prefill_response_num = 1

    def build_receiver_registration_message(self) -> list[bytes]:
        """Unused: `KvxferKVReceiver` sends its own registration (it names its DP group)."""
        return []

    def build_receiver_metadata_message(self, **kwargs: Any) -> list[bytes]:
        """`Reading`: which decode rank reads the request, and how many of them will."""
        reading = Reading(
            room=int(kwargs["bootstrap_room"]),
            ip=self.local_ip,
            port=int(self.rank_port),
            readers=int(kwargs["required_dst_info_num"]),
            prefix=int(kwargs.get("decode_prefix_len") or 0),
        )
        return frames_of(reading, self.settings.secret)

    def registration(self, key: str) -> list[bytes]:
        """The `Register` this rank sends every rank of the prefill DP group `key`, with a
        fresh nonce that their answers must name."""
        nonce = new_nonce()
        with self._lock:
            self._nonces[key] = nonce
        register = Register(group=key, ip=self.local_ip, port=int(self.rank_port), nonce=nonce)
        return frames_of(register, self.settings.secret)

    def start_group(self, key: str, count: int) -> bool:
        """Whether to register with the prefill DP group `key` (`count` ranks to hear from):
        not yet done, or its last connection failed (a restarted engine is met again
        by the next request; the failed one reported the error)."""
        with self._lock:
            if isinstance(self._consumers.get(key), Exception):
                del self._consumers[key]
                self._hellos.pop(key, None)
                self._expected.pop(key, None)
            if key in self._consumers or key in self._expected:
                return False
            self._expected[key] = count
            return True

    def _on_decode_message(self, msg: list[bytes]) -> None:
        """A prefill rank's control message (its side channels, its refusal, or a request
        published), or SGLang's status message (a prefill's failure, with its reason)."""
        if not is_control(msg):
            parsed = self.parse_kv_status_message(msg)
            if parsed is not None:
                room, status, rank, reason = parsed
                self.apply_prefill_status(
                    bootstrap_room=room, status=status, prefill_rank=rank, failure_reason=reason
                )
            return
        try:
            message = message_of(msg, self.settings.secret)
        except ControlError as exc:
            log.warning("kvxfer: dropped a prefill rank's control message: %s", exc)
            return
        if isinstance(message, Registered):
            self._hello(message)
        elif isinstance(message, Refused):
            self._refused(message)
        elif isinstance(message, Published):
            self._ready(message.room, message.tokens, message.aux)

    def _hello(self, registered: Registered) -> None:
        key = registered.group
        with self._lock:
            if self._nonces.get(key) != registered.nonce:
                log.warning("kvxfer: dropped side channels of %s not asked for", key)
                return
            hellos = self._hellos.setdefault(key, {})
            hellos[registered.rank] = registered.addresses
            complete = len(hellos) == self._expected.get(key, -1) and key not in self._consumers
        if complete:
            per_rank = [hellos[r] for r in sorted(hellos)]
            threading.Thread(target=self._connect_group, args=(key, per_rank), daemon=True).start()

    def _refused(self, refused: Refused) -> None:
        """A prefill rank refused this rank's registration: the group's requests fail with the
        reason (a refusal is unsigned: it counts only while the group is still being joined)."""
        error = ConnectionRefusedError(
            f"the prefill engine refused this decode engine's registration: {refused.reason}"
        )
        with self._lock:
            joining = refused.group in self._expected and refused.group not in self._consumers
            if joining:
                self._consumers[refused.group] = error
        if joining:
            log.error("kvxfer: %s", error)

    def _connect_group(self, key: str, addresses: list[list[str]]) -> None:
        """Connect a consumer to every rank of a prefill DP group (`addresses[r]`: rank `r`'s
        side channels, one a cache group; the handshake plans every pair), off the
        scheduler's thread."""
        s = self.settings
        result: GroupedConsumer | Exception
        try:
            consumer = GroupedConsumer(
                self.groups, self.engine_id, host=self.host,
                **s.consumer_options(s.transport_protocol().protocol),
            )  # fmt: skip
            consumer.connect(addresses, timeout=s.handshake_timeout_s)
            result = consumer
        except Exception as exc:
            log.error("kvxfer: connecting to prefill ranks %s failed: %s", addresses, exc)
            result = exc
        with self._lock:
            self._consumers[key] = result
            aborted = self._early_aborts.pop(key, set())
        if isinstance(result, GroupedConsumer):
            for room in aborted:
                result.abort(str(room))
        for room in [r for r, load in list(self._loads.items()) if load.key == key]:
            self._start_fetch(room)

    def abort_load(self, key: str, room: int) -> None:
        """This engine will never read the request: tell the prefill DP group's producers
        (at once, or once connected: they free its pages) and stop its fetch here."""
        with self._lock:
            load = self._loads.get(room)
            if load is not None:
                load.aborted = True
            consumer = self._consumers.get(key)
            if consumer is None:
                self._early_aborts.setdefault(key, set()).add(room)
        if isinstance(consumer, GroupedConsumer):
            consumer.abort(str(room))

    def consumer_of(self, key: str) -> GroupedConsumer | Exception | None:
        """The prefill DP group's consumer, its connection error, or None while connecting."""
        with self._lock:
            return self._consumers.get(key)

    def add_load(self, room: int, load: DecodeLoad) -> None:
        """The decode rank's pages for a request, recorded before its metadata goes out (so
        the prefill's `Published` always finds it)."""
        with self._lock:
            self._loads[room] = load

    def load_of(self, room: int) -> DecodeLoad | None:
        """The request's load on this rank, if any."""
        with self._lock:
            return self._loads.get(room)

    def drop_load(self, room: int) -> None:
        """Forget the request's load (the receiver is cleared)."""
        with self._lock:
            self._loads.pop(room, None)

    def _ready(self, room: int, num_tokens: int, aux: bytes) -> None:
        with self._lock:
            load = self._loads.get(room)
            if load is None:
                return  # cleared meanwhile (an abort): nothing to fetch
            load.num_tokens = num_tokens
            if aux and load.aux is None:
                load.aux = aux
        self._start_fetch(room)

    def _start_fetch(self, room: int) -> None:
        """Fetch the request once its pages, its token count and a connected consumer are
        all here (they arrive in any order)."""
        with self._lock:
            load = self._loads.get(room)
            if load is None or not load.key or load.num_tokens is None or load.handle:
                return
            if load.aborted:
                return
            consumer = self._consumers.get(load.key)
            if not isinstance(consumer, GroupedConsumer):
                return
            table = np.concatenate(
                [np.zeros(load.prefix // self.spec.block_size, dtype=np.int64), load.pages]
            )
            load.handle = consumer.fetch(
                str(room), [table] * len(self.groups), load.num_tokens,
                start_token=load.prefix, timeout=self.settings.fetch_timeout_s,
            )  # fmt: skip

    def write_aux(self, load: DecodeLoad) -> None:
        """The prefill's aux row into this rank's row `load.aux_index`.

        Raises:
            ValueError: the rows differ in size (engines with different metadata buffers).
        """
        a = self.kv_args
        assert load.aux is not None
        if len(load.aux) != sum(a.aux_item_lens):
            raise ValueError(
                f"the prefill's aux row has {len(load.aux)} bytes, this engine's "
                f"{sum(a.aux_item_lens)}: serve both engines with the same model and options"
            )
        offset = 0
        for ptr, n in zip(a.aux_data_ptrs, a.aux_item_lens, strict=True):
            ctypes.memmove(ptr + load.aux_index * n, load.aux[offset : offset + n], n)
            offset += n

    def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
        """SGLang released an aborted or failed load's pages: forget the load too."""
        super().clear_deferred_abort_state(bootstrap_room)
        self.drop_load(bootstrap_room)

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int) -> bool:
        """Whether an aborted or failed load's pages may go to another request: its fetch
        ended (kvxfer reports a fetch only after its last read), or it never started."""
        load = self.load_of(bootstrap_room)
        return load is None or load.handle is None or load.handle.done()


def _pool_device(server_args: Any, kv_args: KVArgs) -> str:
    device = getattr(server_args, "device", None) or "cuda"
    return f"cuda:{kv_args.gpu_id}" if device == "cuda" else str(device)
