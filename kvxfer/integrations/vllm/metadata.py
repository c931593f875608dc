"""What the scheduler side tells the worker side each step (vLLM's connector metadata)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
)

if TYPE_CHECKING:
    pass


_REMOTE_KEYS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "tp_size")


# ---- scheduler -> worker metadata -------------------------------------------------------------


@dataclass
class LoadSpec:
    """A decode worker's order: fetch tokens `[start_token, num_tokens)` of a remote request."""

    request_id: str
    remote_request_id: str
    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_tp_size: int
    block_ids: list[int]
    num_tokens: int
    start_token: int


@dataclass
class SendSpec:
    """A prefill worker's order: offer tokens `[0, num_tokens)` in `block_ids` to decoders."""

    request_id: str
    block_ids: list[int]
    num_tokens: int


@dataclass
class AbortSpec:
    """A decode worker's order: vLLM finished a request before its KV was loaded (aborted,
    or finished while waiting). The worker gives up its load, if one runs, and tells the
    prefill engine, which frees the request's blocks at once."""

    request_id: str
    remote_request_id: str
    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_tp_size: int


@dataclass
class KvxferConnectorMetadata(KVConnectorMetadata):
    """What one step asks of every worker."""

    loads: list[LoadSpec] = field(default_factory=list)
    sends: list[SendSpec] = field(default_factory=list)
    aborts: list[AbortSpec] = field(default_factory=list)
