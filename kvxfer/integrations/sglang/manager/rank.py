"""What both sides of kvxfer's SGLang manager share: one rank's settings, identity, cache
groups and lock, set by `KvxferKVManager` before either side starts, and SGLang's status
message, which the prefill side signs and the decode side checks."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from sglang.srt.disaggregation.common.conn import CommonKVManager

from kvxfer.integrations.sglang.control import (
    STATUS_TAG,
    ControlError,
    signed_status,
    verified_status,
)

if TYPE_CHECKING:
    from kvxfer.connector.groups import CacheGroup
    from kvxfer.integrations.settings import ConnectorSettings
    from kvxfer.spec import KVCacheSpec

log = logging.getLogger(__name__)


class Rank(CommonKVManager):
    """One SGLang rank's manager state that the prefill and decode sides both read, and its
    signed status messages.

    Attributes:
        settings: kvxfer's settings (`KVXFER_CONFIG`).
        host: where the rank's producer or consumers listen.
        engine_id: the rank's name to its peers.
        groups: its cache groups (the target's pool, the draft's, the window pool).
        spec: the first group's geometry (its page size is the engine's).
        _lock: guards each side's state: the scheduler's thread, the control listener and
            kvxfer's threads all touch it.
    """

    # SGLang's status messages (a prefill's failure, to its decode ranks) carry their reason,
    # under a tag of their own beside kvxfer's frames, signed (`control.signed_status`).
    kv_status_msg_tag = STATUS_TAG
    kv_status_msg_carries_reason = True

    settings: ConnectorSettings
    host: str
    engine_id: str
    groups: list[CacheGroup]
    spec: KVCacheSpec
    _lock: threading.Lock

    def _encode_kv_status_message(self, **fields: Any) -> list[bytes]:
        """SGLang's status message, signed with kvxfer's secret."""
        return signed_status(super()._encode_kv_status_message(**fields), self.settings.secret)

    def parse_kv_status_message(self, msg: list[bytes]) -> Any:
        """SGLang's reading of a status message whose proof holds; None for another message,
        and for one whose proof does not hold (dropped, with a warning)."""
        if not msg or msg[0] != self.kv_status_msg_tag:
            return None
        try:
            parts = verified_status(msg, self.settings.secret)
        except ControlError as exc:
            log.warning("kvxfer: dropped a status message: %s", exc)
            return None
        return super().parse_kv_status_message(parts)
