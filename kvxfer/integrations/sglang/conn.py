"""kvxfer's SGLang transfer backend: manager, sender, receiver and bootstrap server on SGLang's
`Common*` classes, moving KV with kvxfer's planner, kernels and pull connector (docs/sglang.md).

SGLang's scheduler speaks to a backend through its `Common*` classes, and so does this one; the
control messages, typed and signed (`kvxfer.integrations.sglang.control`), travel over the
ZeroMQ sockets `CommonKVManager` binds (each rank's `rank_port`, registered with SGLang's
bootstrap server), the KV over kvxfer's producers and consumers (one a cache group):

1. A decode rank's receiver registers with every rank of the prefill DP group it reads
   (`Register`), which answers with its side channels (`Registered`) or, where the proof
   fails, `Refused`; once all answered, the decode rank connects one consumer to all of them
   (the handshake plans every rank pair: any TP sizes, page sizes, MLA, prefill PP).
2. `send_metadata` tells every prefill rank the request's decode rank (`Reading`); a prefill
   sender is `WaitingForInput` once every decode rank did, as in SGLang's own backends.
3. The prefill sender's last `send` publishes the request's pages on its producer and tells
   the decode ranks (`Published`: the token count, and from the last stage's ranks the aux
   row: the first token and its metadata).
4. Each decode rank fetches its heads and layers; it is `Success` once its fetch completed and
   the aux row is in its metadata buffers; the prefill is `Success` once every decode rank
   confirmed its reads (the producer's release), and only then does SGLang free its pages.

A failed fetch is `Failed` with its block ids, only after its last read ended; an aborted
decode request tells the producers (`KVConsumer.abort`), which free the pages at once, and the
prefill ranks (`Abandoned`, signed), and its pages are held (SGLang's deferred release) until
its fetch ended.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import (
    CommonKVBootstrapServer,
    CommonKVReceiver,
    CommonKVSender,
)

from kvxfer.integrations.sglang.control import Abandoned, frames_of
from kvxfer.integrations.sglang.manager import DecodeLoad, KvxferKVManager

log = logging.getLogger(__name__)

__all__ = ["KvxferKVBootstrapServer", "KvxferKVManager", "KvxferKVReceiver", "KvxferKVSender"]


class KvxferKVSender(CommonKVSender):
    """SGLang's prefill sender; the manager publishes the request at its last chunk and
    reports `Success` once every decode rank confirmed its reads."""

    kv_mgr: KvxferKVManager

    def abort(self) -> None:
        """The prefill aborted the request: its producer stops serving it before SGLang sees
        `Failed` and frees the pages (a decode rank reading them then fails, naming them), and
        its decode ranks are told (SGLang's status message), so none waits for it."""
        reason = "the prefill engine aborted the request"
        mgr = self.kv_mgr
        mgr.give_up(self.bootstrap_room, reason)
        readers = list(mgr.transfer_infos.get(self.bootstrap_room, {}))
        mgr.send_kv_status_message(
            targets=readers,
            bootstrap_room=self.bootstrap_room,
            status=KVPoll.Failed,
            failure_reason=reason,
        )
        super().abort()


class KvxferKVReceiver(CommonKVReceiver):
    """SGLang's decode receiver over a kvxfer fetch (the module docstring)."""

    kv_mgr: KvxferKVManager
    conclude_state: KVPoll | None  # set by CommonKVReceiver

    def init(self, prefill_dp_rank: int) -> None:
        """Find the prefill DP group's ranks, register with each, and connect to them (once
        per group: later requests reuse the consumer)."""
        super().init(prefill_dp_rank)
        if self.conclude_state == KVPoll.Failed or not getattr(self, "bootstrap_infos", None):
            return
        self.group_key = f"{self.bootstrap_addr}/dp{prefill_dp_rank}"
        mgr = self.kv_mgr
        parts = mgr.join_group(self.group_key, len(self.bootstrap_infos))
        if parts is not None:
            for info in self.bootstrap_infos:
                self._send_bootstrap_message(
                    bootstrap_info=info, message=parts, operation="register"
                )

    def _register_kv_args(self) -> bool:
        return True  # `init` registers, naming the DP group

    def send_metadata(self, kv_indices: Any, aux_index: int | None = None, *args: Any,
                      **kwargs: Any) -> None:  # fmt: skip
        """Tell the prefill ranks this rank reads the request, and fetch it when ready."""
        if not hasattr(self, "group_key"):  # init failed: SGLang's own path reports it
            super().send_metadata(kv_indices, aux_index, *args, **kwargs)
            return
        # SGLang's state indices, one list a state kind: the manager took one state at most
        # (`check_state_kinds`): the request's window pages, or its Mamba slot.
        state_indices = kwargs.get("state_indices", args[0] if args else None)
        prefix = kwargs.get("decode_prefix_len") or 0
        pages = np.asarray(kv_indices, dtype=np.int64).reshape(-1)
        aux_row = -1 if aux_index is None else aux_index
        load = DecodeLoad(
            self.group_key, self.bootstrap_room, pages, aux_row, prefix,
            state_indices=state_indices or (),
        )  # fmt: skip
        self.kv_mgr.add_load(self.bootstrap_room, load)
        super().send_metadata(kv_indices, aux_index, *args, **kwargs)

    def poll(self) -> KVPoll:
        """`Success` once the fetch completed and the aux row is written; `Failed` only once
        the fetch (if any) ended; else SGLang's own states (and its waiting timeout)."""
        if self.conclude_state is not None:
            return self.conclude_state
        load = self.kv_mgr.load_of(self.bootstrap_room)
        consumer = self.kv_mgr.consumer_of(getattr(self, "group_key", ""))
        if isinstance(consumer, Exception) and (load is None or load.handle is None):
            return self._fail(f"kvxfer could not connect to the prefill engine: {consumer}")
        if load is None or load.handle is None:
            return super().poll()
        if not load.handle.done():
            return KVPoll.WaitingForInput
        result = load.handle.wait(0)
        if not result.ok:
            blocks = result.failed_block_ids
            return self._fail(
                f"kvxfer fetch failed for pages {blocks}: {'; '.join(result.errors[:3])}"
            )
        if load.aux is None:  # the aux row's `Published` is on its way, within SGLang's timeout
            return self._check_waiting_timeout() or KVPoll.WaitingForInput
        try:
            self.kv_mgr.write_aux(load)
        except ValueError as exc:
            return self._fail(str(exc))
        self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Success)
        self.conclude_state = KVPoll.Success
        return KVPoll.Success

    def _fail(self, reason: str) -> KVPoll:
        self.kv_mgr.record_failure(self.bootstrap_room, reason)
        self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
        self.conclude_state = KVPoll.Failed
        return KVPoll.Failed

    def abort(self) -> None:
        """Tell the prefill ranks this engine will never read the request (they free its
        pages at once), and stop its fetch here."""
        key = getattr(self, "group_key", None)
        if key is not None:
            self.kv_mgr.abort((key, self.bootstrap_room))
        super().abort()

    def _send_abort_notification(self, *, force_arm: bool = False) -> None:
        """SGLang's abort notice to every prefill rank of the request (its abort, a failure,
        its waiting timeout), as kvxfer's signed `Abandoned`: only an engine with the secret
        may end a request that a decode rank proved it reads. Best effort, as SGLang's: a rank
        not reached frees the request at its own deadline. No ABORT_ACK generation is armed
        (`force_arm` is SGLang's): kvxfer's pages are safe to release once the fetch ended
        (`is_abort_release_safe`), which no prefill acknowledgement tells."""
        frames = frames_of(Abandoned(room=self.bootstrap_room), self.kv_mgr.settings.secret)
        for info in self.bootstrap_infos:
            try:
                sock, lock = self._connect_to_bootstrap_server(info)
                with lock:
                    sock.send_multipart(frames)
            except Exception as exc:  # best effort, as SGLang's: never fails the abort itself
                log.debug("kvxfer: abort of request %s not sent: %s", self.bootstrap_room, exc)

    def clear(self) -> None:
        """Forget the request (after SGLang read its result)."""
        super().clear()
        load = self.kv_mgr.load_of(self.bootstrap_room)
        if load is None or load.handle is None or load.handle.done():
            self.kv_mgr.drop_load(self.bootstrap_room)


class KvxferKVBootstrapServer(CommonKVBootstrapServer):
    """SGLang's bootstrap server, unchanged: `/route`, `/register_dp_rank`, `/query_dp_ranks`
    and `/health` as `sglang-router` and SGLang's decode engines use them. kvxfer's own
    addresses travel over the ranks' control sockets (`Registered`), not through it."""
