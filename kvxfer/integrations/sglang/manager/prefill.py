"""The prefill side of kvxfer's SGLang manager: a rank's `GroupedProducer` over its pools, the
decode ranks' control messages (their registration, answered with the rank's side channels;
which of them read a request), each request's chunks until its last publishes it, and the
producer's releases turned into SGLang's statuses."""

from __future__ import annotations

import ctypes
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import (
    ABORT_TAG,
    AbortNotification,
)

from kvxfer.connector import ReleaseReason
from kvxfer.connector.groups import GroupedProducer
from kvxfer.integrations.sglang.control import (
    Abandoned,
    ControlError,
    Published,
    Reading,
    Register,
    Registered,
    frames_of,
    is_control,
    message_of,
    refused_registration,
    unproven_abandon,
)
from kvxfer.integrations.sglang.manager.model import group_tables
from kvxfer.integrations.sglang.manager.rank import Rank

log = logging.getLogger(__name__)

_MAX_ABORTED_ROOMS = 100_000  # recent decode aborts a prefill rank remembers


@dataclass
class _Sent:
    """What a prefill rank was given of a request so far (its chunks' pages and tokens)."""

    pages: list[np.ndarray] = field(default_factory=list)
    tokens: int = 0


@dataclass(frozen=True)
class Send:
    """A request a prefill rank publishes (its last chunk was sent): its block table (the
    decode's prefix as padding, then the pages of every chunk), SGLang's state indices of it
    if the model keeps hybrid state (one list, its one state's: sliding-window pages, or a
    Mamba slot), its tokens, the decode's prefix, its aux row."""

    room: int
    table: np.ndarray
    state_indices: Any
    num_tokens: int
    prefix: int
    aux_index: int | None


class PrefillSide(Rank):
    """What a prefill rank's manager does (`KvxferKVManager` is both sides; the engine's mode
    picks which one runs). Its state is guarded by `_lock`: the scheduler's thread, the
    control listener and the producer's side-channel thread all touch it."""

    producer: GroupedProducer | None = None  # a prefill rank's

    def _start_prefill(self) -> None:
        """The prefill side's state, and its producer serving and registered."""
        self._sent: dict[int, _Sent] = {}
        self._published: set[int] = set()  # rooms on the producer, not released yet
        self._aborted_rooms: OrderedDict[int, None] = OrderedDict()  # SGLang ABORT notices
        s = self.settings
        self.producer = GroupedProducer(
            self.groups,
            self.engine_id,
            host=self.host,
            release=self.released,
            **s.producer_options(s.transport_protocol().protocol),
        )
        self.register(self.producer.addresses)

    def register(self, addresses: list[str]) -> None:
        """Discovery (the engine-adapter contract): keep this rank's side channels, one a
        cache group, for the decode ranks' registrations (SGLang's bootstrap server makes the
        rank's control socket findable; `Registered` answers with these)."""
        self._side_channels = list(addresses)

    def _on_prefill_message(self, msg: list[bytes]) -> None:
        """A decode rank's control message (`kvxfer.integrations.sglang.control`: its
        registration, answered with this rank's side channels, its `Reading` or its
        `Abandoned`), or SGLang's own ABORT notice (unproven)."""
        if is_control(msg):
            self._on_prefill_control(msg)
        elif msg[0] == ABORT_TAG:
            notice = AbortNotification.from_zmq(msg)
            if notice is not None:
                self._abandon(notice.room, proven=False)

    def _on_prefill_control(self, frames: list[bytes]) -> None:
        secret = self.settings.secret
        try:
            message = message_of(frames, secret)
        except ControlError as exc:
            log.warning("kvxfer: refused a decode rank's control message: %s", exc)
            refusal = refused_registration(frames, str(exc))
            if refusal is not None:
                self._send_multipart_locked(*refusal)
            room = unproven_abandon(frames)
            if room is not None:
                self._abandon(room, proven=False)
            return
        if isinstance(message, Register):
            answer = Registered(
                group=message.group,
                rank=self.pp_rank * self.attn_tp_size + self.attn_tp_rank,
                addresses=self._side_channels,
                nonce=message.nonce,
            )
            self._send_multipart_locked(
                f"tcp://{message.ip}:{message.port}", frames_of(answer, secret)
            )
        elif isinstance(message, Reading):
            self._note_reader(message)
        elif isinstance(message, Abandoned):
            self._abandon(message.room, proven=True)

    def _abandon(self, room: int, proven: bool) -> None:
        """A decode engine gave the request up: fail it here. An unproven notice only for a
        request this rank has and that no decode rank proved it reads (control's docstring):
        it is never kept for a request to come."""
        if not proven and (self.transfer_infos.get(room) or room not in self.request_status):
            log.warning(
                "kvxfer: dropped an abort of request %s without a proof that holds: a decode "
                "rank with the secret reads it, or this rank has no such request (give both "
                "engines the same secret)",
                room,
            )
            return
        reason = "the decode engine aborted the request"
        self.give_up(room, reason)
        self.record_failure(room, reason)
        self.update_status(room, KVPoll.Failed)

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
        publishes the request (with a hybrid model, its state indices: window pages, Mamba slot)
        and tells its decode ranks."""
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
        table = np.concatenate(
            [np.zeros(prefix // self.spec.block_size, dtype=np.int64), *sent.pages]
        )
        self.publish(Send(bootstrap_room, table, state_indices or (), prefix + sent.tokens,
                          prefix, aux_index))  # fmt: skip

    def publish(self, send: Send) -> None:
        """Offer a request's pages (the engine-adapter contract), and tell its decode ranks
        (`Published`: its token count and, from the last stage, its aux row)."""
        room = send.room
        assert self.producer is not None
        try:
            tables = group_tables(self.groups, send.table, send.state_indices, send.num_tokens)
            self.producer.publish(
                str(room), tables, send.num_tokens, first_token=send.prefix,
                deadline_s=self.settings.request_timeout_s,
            )  # fmt: skip
        except ValueError as exc:
            self.record_failure(room, f"kvxfer: {exc}")
            self.update_status(room, KVPoll.Failed)
            return
        self.update_status(room, KVPoll.Transferring)
        index = send.aux_index
        aux = self._aux_row(index) if self._serves_aux() and index is not None else b""
        published = Published(room=room, tokens=send.num_tokens, aux=aux)
        frames = frames_of(published, self.settings.secret)
        for ip, port in self.transfer_infos.get(room, {}):
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

    def released(self, request_id: str, reason: ReleaseReason) -> None:
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
