"""The scheduler side of `KvxferConnector`: which requests load or send KV, and the metadata
that tells the workers."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from kvxfer.integrations.settings import ConnectorSettings
from kvxfer.integrations.vllm.metadata import (
    _REMOTE_KEYS,
    AbortSpec,
    KvxferConnectorMetadata,
    LoadSpec,
    SendSpec,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


class SchedulerSide:
    """Turns requests' `kv_transfer_params` into loads (decode) and sends (prefill)."""

    def __init__(self, vllm_config: VllmConfig, settings: ConnectorSettings, engine_id: str):
        self._settings = settings
        self._engine_id = engine_id
        self._tp_size = vllm_config.parallel_config.tensor_parallel_size
        self._loads: list[LoadSpec] = []
        self._sends: list[SendSpec] = []
        self._aborts: list[AbortSpec] = []
        self._loading: dict[str, AbortSpec] = {}  # loads not finished on every worker yet

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        missing = [key for key in _REMOTE_KEYS if params.get(key) is None]
        if missing:
            # A malformed request must not take the engine down: it is prefilled here instead.
            log.warning(
                "request %s: kv_transfer_params lack %s; computing its prompt locally",
                request.request_id,
                missing,
            )
            params["do_remote_prefill"] = False
            return 0, False
        count = _remote_tokens(request) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # one transfer per request
        remote = _abort_spec(request.request_id, params)
        if num_external_tokens <= 0:
            # A full local prefix hit: nothing to move; the prefill engine frees its blocks.
            self._aborts.append(remote)
            return
        self._loading[request.request_id] = remote
        num_tokens = _remote_tokens(request)
        self._loads.append(
            LoadSpec(
                request_id=request.request_id,
                remote_request_id=str(params["remote_request_id"]),
                remote_engine_id=str(params["remote_engine_id"]),
                remote_host=str(params["remote_host"]),
                remote_port=int(params["remote_port"]),
                remote_tp_size=int(params["tp_size"]),
                block_ids=[int(b) for b in blocks.get_block_ids()[0]],
                num_tokens=num_tokens,
                start_token=num_tokens - num_external_tokens,
            )
        )

    def build_connector_meta(self) -> KvxferConnectorMetadata:
        metadata = KvxferConnectorMetadata(
            loads=self._loads, sends=self._sends, aborts=self._aborts
        )
        self._loads, self._sends, self._aborts = [], [], []
        return metadata

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for request_id in output.finished_recving or ():
            self._loading.pop(request_id, None)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if not params:
            return False, None
        if not params.get("do_remote_decode"):
            self._abort_if_not_loaded(request, params)
            return False, None
        finished_normally = request.status in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        )
        if not finished_normally or not block_ids or request.num_computed_tokens <= 0:
            return False, None  # aborted or empty: nothing to hand over, free now
        num_tokens = request.num_computed_tokens
        self._sends.append(SendSpec(request.request_id, [int(b) for b in block_ids], num_tokens))
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self._engine_id,
            "remote_request_id": request.request_id,
            "remote_host": self._settings.side_channel_host,
            "remote_port": self._settings.side_channel_port,
            "remote_block_ids": [int(b) for b in block_ids],
            "remote_num_tokens": num_tokens,
            "tp_size": self._tp_size,
        }

    def _abort_if_not_loaded(self, request: Request, params: dict[str, Any]) -> None:
        """Decode side: a request finished before its KV was loaded (as vLLM's NIXL connector
        does, tell the prefill engine to free its blocks now, not at its request_timeout_s).
        While its load runs, vLLM keeps the blocks until the workers report it finished."""
        remote = self._loading.pop(request.request_id, None)
        if remote is None and params.get("do_remote_prefill"):
            # Finished before its blocks were allocated (aborted while waiting).
            params["do_remote_prefill"] = False
            if all(params.get(key) is not None for key in _REMOTE_KEYS):
                remote = _abort_spec(request.request_id, params)
        if remote is not None:
            self._aborts.append(remote)


def _abort_spec(request_id: str, params: dict[str, Any]) -> AbortSpec:
    """Where a decode request's KV comes from, as an abort order."""
    return AbortSpec(
        request_id=request_id,
        remote_request_id=str(params["remote_request_id"]),
        remote_engine_id=str(params["remote_engine_id"]),
        remote_host=str(params["remote_host"]),
        remote_port=int(params["remote_port"]),
        remote_tp_size=int(params["tp_size"]),
    )


def _remote_tokens(request: Request) -> int:
    """Prompt tokens the prefill engine holds KV for."""
    params = request.kv_transfer_params or {}
    prompt = len(request.prompt_token_ids or [])
    remote = params.get("remote_num_tokens")
    return min(prompt, int(remote)) if remote is not None else prompt
