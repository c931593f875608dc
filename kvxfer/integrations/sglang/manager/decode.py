"""The decode side of kvxfer's SGLang manager: the look-up of a prefill engine (without
SGLang's refusals of what kvxfer bridges), a link to each prefill DP group it reads
(`kvxfer.integrations.sglang.links`: registration, handshake, one `GroupedConsumer`), and each
request's load, fetched once its pages, its token count and a connected consumer are all
here."""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import PrefillServerInfo

from kvxfer.connector.groups import GroupedConsumer, GroupedFetch
from kvxfer.integrations.base import RankChannels, rank_channels, split_channels
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
)
from kvxfer.integrations.sglang.links import GroupLink, LinkState
from kvxfer.integrations.sglang.manager.model import group_tables
from kvxfer.integrations.sglang.manager.rank import Rank
from kvxfer.session.auth import new_nonce

log = logging.getLogger(__name__)


@dataclass
class DecodeLoad:
    """A decode rank's request: where it goes, and how its fetch stands."""

    key: str
    room: int
    pages: np.ndarray
    aux_index: int
    prefix: int
    num_tokens: int | None = None
    aux: bytes | None = None
    handle: GroupedFetch | None = None
    aborted: bool = False  # never start its fetch: SGLang may give its pages away
    state_indices: Any = ()  # a hybrid model's: SGLang's (window pages, or Mamba slot)


class DecodeSide(Rank):
    """What a decode rank's manager does (`KvxferKVManager` is both sides; the engine's mode
    picks which one runs). Its links and loads are guarded by `_lock`: the scheduler's
    thread, the control listener and the connecting threads all touch them."""

    def _start_decode(self) -> None:
        """The decode side's state (links connect as requests meet their groups)."""
        self._links: dict[str, GroupLink] = {}
        self._loads: dict[int, DecodeLoad] = {}
        self._start_heartbeat_checker_thread()

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

    def join_group(self, key: str, ranks: int) -> list[bytes] | None:
        """The `Register` to send every rank of the prefill DP group `key` (`ranks` of them),
        under a fresh nonce their answers must name; None where the group's link is joining or
        connected already. A failed link registers again (a restarted engine is met again by
        the next request; the failed ones reported the error)."""
        nonce = new_nonce()
        with self._lock:
            link = self._links.get(key)
            if link is None:
                self._links[key] = GroupLink(ranks, nonce)
            elif link.state is LinkState.FAILED:
                link.retry(ranks, nonce)
            else:
                return None
        register = Register(group=key, ip=self.local_ip, port=int(self.rank_port), nonce=nonce)
        return frames_of(register, self.settings.secret)

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
            link = self._links.get(key)
            if link is None or not link.expects(registered.nonce):
                log.warning("kvxfer: dropped side channels of %s not asked for", key)
                return
            complete = link.answer(registered.rank, registered.addresses)
        if complete:
            threading.Thread(target=self._connect_group, args=(key,), daemon=True).start()

    def _refused(self, refused: Refused) -> None:
        """A prefill rank refused this rank's registration: the group's requests fail with the
        reason (while the group registers only: `kvxfer.integrations.sglang.links`)."""
        error = ConnectionRefusedError(
            f"the prefill engine refused this decode engine's registration: {refused.reason}"
        )
        with self._lock:
            link = self._links.get(refused.group)
            taken = link is not None and link.refuse(error)
        if taken:
            log.error("kvxfer: %s", error)

    @property
    def look_up(self) -> Callable[[str], RankChannels]:
        """Discovery, decode side (the engine-adapter contract): the side channels every rank
        of a prefill DP group answered this rank's registration with, and the registration's
        nonce as their fingerprint.

        Raises (the callable):
            LookupError: not every rank of the group answered yet.
        """
        return self._answers_of

    def _answers_of(self, key: str) -> RankChannels:
        with self._lock:
            link = self._links.get(key)
            if link is None or link.state is LinkState.REGISTERING:
                raise LookupError(f"the prefill DP group {key} has not answered every rank")
            return tuple(rank_channels(a) for a in link.side_channels()), link.nonce

    def _connect_group(self, key: str) -> None:
        """Connect a consumer to every rank of a prefill DP group (each rank's side channels,
        one a cache group, from `look_up`; the handshake plans every pair), off the
        scheduler's thread."""
        channels, _ = self.look_up(key)
        addresses = [split_channels(rank) for rank in channels]
        s = self.settings
        consumer: GroupedConsumer | None = None
        try:
            consumer = GroupedConsumer(
                self.groups, self.engine_id, host=self.host,
                **s.consumer_options(s.transport_protocol().protocol),
            )  # fmt: skip
            consumer.connect(addresses, timeout=s.handshake_timeout_s)
        except Exception as exc:
            log.error("kvxfer: connecting to prefill ranks %s failed: %s", addresses, exc)
            with self._lock:
                self._links[key].failed(exc)
            return
        with self._lock:
            aborted = self._links[key].connected(consumer)
        for room in aborted:
            consumer.abort(str(room))
        for room in [r for r, load in list(self._loads.items()) if load.key == key]:
            self._start_fetch(room)

    def abort(self, abort: tuple[str, int]) -> None:
        """This engine will never read the request `(group, room)` (the engine-adapter
        contract): tell the prefill DP group's producers (at once, or once connected: they
        free its pages) and stop its fetch here."""
        key, room = abort
        with self._lock:
            load = self._loads.get(room)
            if load is not None:
                load.aborted = True
            link = self._links.get(key)
            if link is None or link.abort_early(room):
                return
            consumer = link.outcome()
        if isinstance(consumer, GroupedConsumer):
            consumer.abort(str(room))

    def consumer_of(self, key: str) -> GroupedConsumer | Exception | None:
        """The prefill DP group's consumer, its connection error, or None while joining."""
        with self._lock:
            link = self._links.get(key)
            return None if link is None else link.outcome()

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
        """`fetch` the request once its pages, its token count and a connected consumer are
        all here (they arrive in any order)."""
        with self._lock:
            load = self._loads.get(room)
            if load is None or not load.key or load.num_tokens is None or load.handle:
                return
            link = self._links.get(load.key)
            if load.aborted or link is None or link.state is not LinkState.CONNECTED:
                return
            self.fetch(load)

    def fetch(self, load: DecodeLoad) -> None:
        """Start loading a request's KV into its pages (the engine-adapter contract; the
        caller holds the manager's lock, and the load's link is connected): kvxfer's fetch
        runs off the scheduler's thread, which polls it (`KvxferKVReceiver.poll`)."""
        room, consumer = int(load.room), self._links[load.key].consumer
        assert consumer is not None and load.num_tokens is not None
        table = np.concatenate(
            [np.zeros(load.prefix // self.spec.block_size, dtype=np.int64), load.pages]
        )
        try:
            tables = group_tables(self.groups, table, load.state_indices, load.num_tokens)
            # SGLang's page 0 is its padding page: a window table's leading 0s are no pages.
            # SGLang's attention backends differ by one in what a window of `w` attends from a
            # query at `p` (Triton: [p - w + 1, p]; FlashAttention, FlashInfer: [p - w, p]):
            # the wider is fetched, as for a first query at `num_tokens - 1` under Triton's
            # rule. That is where SGLang's own window pages start (its `_swa_payload`).
            load.handle = consumer.fetch(
                str(room), tables, load.num_tokens, start_token=load.prefix,
                timeout=self.settings.fetch_timeout_s, null_block=0,
                first_computed=load.num_tokens - 1,
            )  # fmt: skip
        except Exception as exc:
            load.aborted = True  # never fetched: its pages are SGLang's again at once
            self.record_failure(room, f"kvxfer: {exc}")
            self.update_status(room, KVPoll.Failed)

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
