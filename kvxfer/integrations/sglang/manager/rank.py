"""What both sides of kvxfer's SGLang manager share: one rank's settings, identity, cache
groups and lock, set by `KvxferKVManager` before either side starts."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from sglang.srt.disaggregation.common.conn import CommonKVManager

if TYPE_CHECKING:
    from kvxfer.connector.groups import CacheGroup
    from kvxfer.integrations.settings import ConnectorSettings
    from kvxfer.spec import KVCacheSpec


class Rank(CommonKVManager):
    """One SGLang rank's manager state that the prefill and decode sides both read.

    Attributes:
        settings: kvxfer's settings (`KVXFER_CONFIG`).
        host: where the rank's producer or consumers listen.
        engine_id: the rank's name to its peers.
        groups: its cache groups (the target's pool, the draft's, the window pool).
        spec: the first group's geometry (its page size is the engine's).
        _lock: guards each side's state: the scheduler's thread, the control listener and
            kvxfer's threads all touch it.
    """

    settings: ConnectorSettings
    host: str
    engine_id: str
    groups: list[CacheGroup]
    spec: KVCacheSpec
    _lock: threading.Lock
