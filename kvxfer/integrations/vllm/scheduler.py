"""The scheduler side of `KvxferConnector`: which requests load or send KV, the metadata that
tells the workers, and (a prefill engine's DP rank 0) the bootstrap service."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

from kvxfer.integrations.bootstrap import BootstrapServer
from kvxfer.integrations.settings import ConnectorSettings
from kvxfer.integrations.vllm.metadata import (
    AbortSpec,
    KvxferConnectorMetadata,
    LoadSpec,
    RemoteEngine,
    SendFailure,
    SendSpec,
    StreamStep,
)
from kvxfer.integrations.vllm.timelines import RequestTimelines

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


class SchedulerSide:
    """Turns requests' `kv_transfer_params` into loads (decode) and sends (prefill).

    On a prefill engine (`produces`), the scheduler of DP rank 0 starts the bootstrap service
    where every worker of every DP rank registers its side channel, unless `bootstrap_address`
    names one run elsewhere. A finished prefill's parameters name the service and this
    scheduler's DP rank, so decode workers find exactly this DP rank's workers.

    Streaming the prefill (`stream_prefill`, the concurrent flow): a request that a router sent
    to both engines at once (with its `transfer_id`) is offered in the step that first schedules
    it, not when it finishes, so that the decode engine, which asked for it already, reads each
    layer as the forward pass writes it; each step that computes more of it says how far
    (`StreamStep`, with the blocks a chunked prefill's step allocated). Only where its blocks
    stay its own until `request_finished` (which then keeps them until the decode engine is
    done), or their loss is seen before anything else can write them: `max_tokens` 1 (it
    finishes once its prompt is computed), never preempted before, no recurrent state (written
    whole at the prompt's end), and, for a prompt one step does not schedule whole, one
    full-attention KV cache group (a sliding window drops blocks as a chunked prefill
    advances). vLLM frees a preempted request's blocks without telling its KV connector, but
    lists it in the next `SchedulerOutput.preempted_req_ids`; the step that could first write
    its blocks for another request starts by failing the publication (`SendFailure`), so no
    read of them is confirmed and no pack of them offered after that (docs/vllm.md,
    "Streaming the prefill"). Anything else
    is offered when it finishes, as before.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        settings: ConnectorSettings,
        engine_id: str,
        *,
        produces: bool = False,
        kv_cache_config: Any = None,
    ):
        self._settings = settings
        # A hybrid model's recurrent state (Mamba groups): see `on_new_request`.
        self._has_state = bool(getattr(kv_cache_config, "has_mamba_layers", False))
        self._engine_id = engine_id
        parallel = vllm_config.parallel_config
        self._tp_size = parallel.tensor_parallel_size
        self._pp_size = parallel.pipeline_parallel_size
        self._dp_rank = data_parallel_rank(vllm_config)
        master_ip = parallel.data_parallel_master_ip
        self._bootstrap_url = settings.bootstrap_url(master_ip)
        self._bootstrap: BootstrapServer | None = None
        if produces and settings.bootstrap_address is None and self._dp_rank == 0:
            host = settings.bootstrap_host(master_ip)
            self._bootstrap = BootstrapServer(
                host.strip("[]"), settings.bootstrap_port, secret=settings.secret
            ).start()
        # With fixed side-channel ports, this DP rank's first worker (PP rank 0, TP rank 0)
        # listens here, and its others after it, pp-major (decode engines given parameters
        # without a bootstrap address connect to `remote_port + p * tp_size + t`).
        self._first_port = (
            settings.side_channel_port + self._dp_rank * self._pp_size * self._tp_size
            if settings.side_channel_port
            else None
        )
        # What the next step asks of the workers, filled as the scheduler calls in.
        self._step = KvxferConnectorMetadata()
        self._loading: dict[str, AbortSpec] = {}  # loads not finished on every worker yet
        self._streams = produces and settings.stream_prefill and not self._has_state
        self._streams_chunked = self._streams and _one_full_attention_group(kv_cache_config)
        self._stream_candidates: dict[str, Request] = {}  # allocated this step
        self._streaming: dict[str, SendSpec] = {}  # offered while computing, not finished
        self._stream_tables: dict[str, list[list[int]]] = {}  # their block tables so far
        # Prefill: each request to hand over's events here (its arrival, when first scheduled),
        # sent with its publish. Decode: the timelines of the requests it loads.
        self._prefill_events: dict[str, dict[str, float]] = {}
        self._timelines = RequestTimelines()

    def on_new_request(self, request: Request) -> None:
        """Prefill of a model with recurrent state (Mamba layers): drop the prompt's last
        token, so that the state handed over is the one after `N - 1` tokens; the decode
        engine loads `N - 1` tokens (`remote_num_tokens`) and computes the last one from that
        state, as it must (a state cannot be rewound). vLLM's own connectors do the same. Once
        per request (a preempted request is not truncated again)."""
        params = request.kv_transfer_params
        if not (self._has_state and params and params.get("do_remote_decode")):
            return
        if params.get("_kvxfer_truncated") or request.num_prompt_tokens <= 1:
            return
        if request.prompt_token_ids is None:  # prompt embeddings: computed whole, not sent
            params["do_remote_decode"] = False
            return
        request.prompt_token_ids.pop()
        request._all_token_ids.pop()
        request.num_prompt_tokens -= 1
        request.max_tokens = 1
        params["_kvxfer_truncated"] = True

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        try:
            _abort_spec(request.request_id, params)
        except ValueError as exc:
            # A malformed request must not take the engine down: it is prefilled here instead.
            log.warning(
                "request %s: kv_transfer_params are unusable (%s); computing its prompt locally",
                request.request_id,
                exc,
            )
            params["do_remote_prefill"] = False
            return 0, False
        count = _remote_tokens(request, self._has_state) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        if self._streams and _streamable(request):
            self._stream_candidates[request.request_id] = request
        if params and params.get("do_remote_decode"):
            self._prefill_events.setdefault(
                request.request_id,
                {"arrived": float(request.arrival_time), "prefill_scheduled": time.time()},
            )
        if not params or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # one transfer per request
        remote = _abort_spec(request.request_id, params)
        if num_external_tokens <= 0:
            # A full local prefix hit: nothing to move; the prefill engine frees its blocks.
            self._step.aborts.append(remote)
            return
        self._loading[request.request_id] = remote
        self._timelines.load_started(request)
        num_tokens = _remote_tokens(request, self._has_state)
        self._step.loads.append(
            LoadSpec(
                request_id=request.request_id,
                remote_request_id=remote.remote_request_id,
                remote=remote.remote,
                block_ids=[[int(b) for b in group] for group in blocks.get_block_ids()],
                num_tokens=num_tokens,
                start_token=num_tokens - num_external_tokens,
                # Sent to both engines at once (no `remote_num_tokens`: the prefill engine has
                # not answered): its prefill may still be computing.
                streamed=self._settings.stream_prefill and "remote_num_tokens" not in params,
                # vLLM's scheduler sets num_computed_tokens to num_tokens - 1 after a load that
                # covers the whole request (`_update_waiting_for_remote_kv`).
                recomputes_last=num_tokens == request.num_tokens,
            )
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvxferConnectorMetadata:
        self._fail_preempted(scheduler_output)
        self._offer_streams(scheduler_output)
        self._advance_streams(scheduler_output)
        self._timelines.step_scheduled(scheduler_output)
        metadata, self._step = self._step, KvxferConnectorMetadata()
        return metadata

    def _fail_preempted(self, output: SchedulerOutput) -> None:
        """Streamed requests vLLM preempted (their blocks freed, perhaps given to a request
        this step writes): their publications fail before this step's forward pass runs."""
        for request_id in getattr(output, "preempted_req_ids", None) or ():
            send = self._end_stream(request_id)
            if send is not None:
                why = "the prefill engine preempted it (its blocks were freed)"
                self._step.send_failures.append(SendFailure(request_id, send.offered_as, why))

    def _offer_streams(self, output: SchedulerOutput) -> None:
        """Offer this step's streamable requests (one whose prompt this step does not schedule
        whole only with one full-attention group): published before the step computes them,
        with the blocks allocated so far."""
        candidates, self._stream_candidates = self._stream_candidates, {}
        for new in output.scheduled_new_reqs if candidates else ():
            request = candidates.get(new.req_id)
            if request is None:
                continue
            prompt = request.num_prompt_tokens
            end = new.num_computed_tokens + output.num_scheduled_tokens.get(new.req_id, 0)
            if end < prompt and not self._streams_chunked:
                continue
            tables = _block_tables(new.block_ids)
            params = request.kv_transfer_params or {}
            send = SendSpec(
                new.req_id,
                tables,
                prompt,
                params["transfer_id"],
                new.num_computed_tokens,
                self._prefill_timeline(new.req_id),
            )
            self._step.sends.append(send)
            self._streaming[new.req_id], self._stream_tables[new.req_id] = send, tables
            self._step.stream_steps.append(
                StreamStep(new.req_id, send.offered_as, min(end, prompt))
            )

    def _advance_streams(self, output: SchedulerOutput) -> None:
        """The next chunks of the streamed requests a chunked prefill computes in this step,
        with the blocks it allocated for them."""
        cached = output.scheduled_cached_reqs
        for index, request_id in enumerate(cached.req_ids if self._streaming else ()):
            send = self._streaming.get(request_id)
            computed = cached.num_computed_tokens[index]
            if send is None or computed >= send.num_tokens:
                continue
            end = min(send.num_tokens, computed + output.num_scheduled_tokens.get(request_id, 0))
            new_blocks = cached.new_block_ids[index]
            tables = None
            if new_blocks and any(new_blocks):
                grown = self._stream_tables[request_id]
                tables = [old + list(more) for old, more in zip(grown, new_blocks, strict=True)]
                self._stream_tables[request_id] = tables
            self._step.stream_steps.append(StreamStep(request_id, send.offered_as, end, tables))

    def _end_stream(self, request_id: str) -> SendSpec | None:
        self._stream_tables.pop(request_id, None)
        return self._streaming.pop(request_id, None)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self._timelines.connector_output(output)
        for request_id in output.finished_recving or ():
            self._loading.pop(request_id, None)

    def take_phases(self) -> list[dict[str, float]]:
        """Decode: the phases of the loaded requests whose first token came since the last
        call (`RequestTimelines`)."""
        return self._timelines.take_phases()

    def _prefill_timeline(self, request_id: str) -> dict[str, float]:
        """The prefill's events of a request it hands over, for its publish: its arrival
        here (the decode engine's timeline keeps the earlier of the two engines' arrivals: the
        front's request in, whether it asked both engines at once or one after the other) and
        when it was first scheduled."""
        return dict(self._prefill_events.get(request_id, {}))

    def request_finished(
        self, request: Request, block_ids: list[int] | tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Prefill: hand the request's blocks over (`block_ids`: one table, or one per KV cache
        group with vLLM's hybrid allocator). Decode: abort a load that never finished."""
        from vllm.v1.request import RequestStatus

        tables = _block_tables(block_ids)
        params = request.kv_transfer_params
        self._timelines.request_finished(request.request_id)
        timeline = self._prefill_events.pop(request.request_id, {})
        if not params:
            return False, None
        if not params.get("do_remote_decode"):
            self._abort_if_not_loaded(request, params)
            return False, None
        finished_normally = request.status in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        )
        streamed = self._end_stream(request.request_id)
        if streamed is not None:
            return self._finish_stream(request, streamed, tables, finished_normally)
        if not finished_normally or not any(tables) or request.num_computed_tokens <= 0:
            # Aborted, or no KV computed: nothing to hand over, its blocks are freed now. The
            # answer still carries parameters, saying so: a router then sends the request to
            # a decode engine, which computes the prompt itself (with none, a router cannot
            # tell this engine from one without a KV connector, and fails the request).
            log.info(
                "request %s: no KV to hand over (status %s, %d tokens computed); the decode "
                "engine will compute its prompt",
                request.request_id,
                request.status,
                request.num_computed_tokens,
            )
            return False, nothing_to_load()
        num_tokens = request.num_computed_tokens
        # The concurrent flow (a router that sent the decode request at the same time, with
        # the `transfer_id` it minted): offered under that id, which the decode fetches by.
        transfer_id = params.get("transfer_id")
        published = transfer_id if isinstance(transfer_id, str) and transfer_id else None
        if published is not None:
            # The decode engine was sent the prompt, not this answer: it asks for the prompt's
            # tokens, which a prefill that went on decoding (`max_tokens` > 1) passed.
            num_tokens = min(num_tokens, request.num_prompt_tokens)
        self._step.sends.append(
            SendSpec(request.request_id, tables, num_tokens, published, timeline=timeline)
        )
        return True, self._handed(published or request.request_id, tables, num_tokens)

    def _finish_stream(
        self,
        request: Request,
        send: SendSpec,
        tables: list[list[int]],
        finished_normally: bool,
    ) -> tuple[bool, dict[str, Any]]:
        """A request offered while it computed: handed over as offered, or (vLLM finished it
        otherwise) its publication fails. Its blocks are freed once the producer released
        it, either way (the decode engine may be reading them)."""
        if finished_normally and request.num_computed_tokens >= send.num_tokens:
            return True, self._handed(send.offered_as, tables, send.num_tokens)
        why = f"the prefill engine finished it as {request.status.name}"
        self._step.send_failures.append(SendFailure(request.request_id, send.offered_as, why))
        return True, nothing_to_load()

    def _handed(self, offered_as: str, tables: list[list[int]], num_tokens: int) -> dict[str, Any]:
        """A finished prefill's answer: where a decode engine finds its KV."""
        handed = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self._engine_id,
            "remote_request_id": offered_as,
            "remote_bootstrap_addr": self._bootstrap_url,
            "remote_dp_rank": self._dp_rank,
            "remote_host": self._settings.side_channel_host,
            # One list, or one per KV cache group (as vLLM's connectors pass them with HMA).
            "remote_block_ids": tables[0] if len(tables) == 1 else tables,
            "remote_num_tokens": num_tokens,
            "tp_size": self._tp_size,
            "pp_size": self._pp_size,
        }
        if self._first_port is not None:
            handed["remote_port"] = self._first_port
        return handed

    def close(self) -> None:
        """Stop the bootstrap service, if this scheduler runs it."""
        if self._bootstrap is not None:
            self._bootstrap.close()
            self._bootstrap = None

    def _abort_if_not_loaded(self, request: Request, params: dict[str, Any]) -> None:
        """Decode side: a request finished before its KV was loaded (as vLLM's NIXL connector
        does, tell the prefill engine to free its blocks now, not at its request_timeout_s).
        While its load runs, vLLM keeps the blocks until the workers report it finished."""
        remote = self._loading.pop(request.request_id, None)
        if remote is None and params.get("do_remote_prefill"):
            # Finished before its blocks were allocated (aborted while waiting).
            params["do_remote_prefill"] = False
            with contextlib.suppress(ValueError):  # unusable parameters: nothing to tell
                remote = _abort_spec(request.request_id, params)
        if remote is not None:
            self._step.aborts.append(remote)


def nothing_to_load() -> dict[str, Any]:
    """The `kv_transfer_params` of a prefill that hands no KV over: a decode engine given
    them computes the whole prompt (its `get_num_new_matched_tokens` sees no remote prefill)."""
    return {"do_remote_prefill": False, "do_remote_decode": False}


def _block_tables(block_ids: list[int] | tuple[list[int], ...]) -> list[list[int]]:
    """One block table per KV cache group: vLLM passes a tuple of per-group lists to
    `request_finished_all_groups` (hybrid allocator), one list to `request_finished`."""
    groups: list[Any] = list(block_ids)
    if groups and isinstance(groups[0], (list, tuple)):
        return [[int(b) for b in group] for group in groups]
    return [[int(b) for b in groups]]


def _one_full_attention_group(kv_cache_config: Any) -> bool:
    """Whether the engine's KV cache is one full-attention group (None: the worker's view of
    a missing configuration, one group of every layer)."""
    if kv_cache_config is None:
        return True
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    groups = list(kv_cache_config.kv_cache_groups)
    return len(groups) == 1 and isinstance(groups[0].kv_cache_spec, FullAttentionSpec)


def _streamable(request: Request) -> bool:
    """A prefill request of the concurrent flow (a router's `transfer_id`) that finishes once
    its prompt is computed (`max_tokens` 1), offered for the first time (a preempted one had
    its publication failed: it is offered again, under its id, only when it finishes)."""
    params = request.kv_transfer_params or {}
    transfer_id = params.get("transfer_id")
    return (
        bool(params.get("do_remote_decode"))
        and isinstance(transfer_id, str)
        and bool(transfer_id)
        and request.max_tokens == 1
        and request.prompt_token_ids is not None
        and not getattr(request, "num_preemptions", 0)
    )


def _abort_spec(request_id: str, params: dict[str, Any]) -> AbortSpec:
    """Where a decode request's KV lies, read from its parameters, as an abort order: the
    prefill engine's `remote_request_id` (the sequential flow: its answer's parameters), else
    the router's `transfer_id` (the concurrent flow: vllm-router's mooncake mode sends both
    engines the request at once, with `remote_engine_id` and `remote_bootstrap_addr`).

    Raises:
        ValueError: a key missing or malformed, naming it.
    """
    remote_request_id = params.get("remote_request_id", params.get("transfer_id"))
    if not isinstance(remote_request_id, str) or not remote_request_id:
        raise ValueError(
            f"neither remote_request_id nor transfer_id names a request ({remote_request_id!r})"
        )
    return AbortSpec(request_id, remote_request_id, RemoteEngine.from_params(params))


def data_parallel_rank(vllm_config: VllmConfig) -> int:
    """This engine's DP rank: vLLM's `data_parallel_index` (kept when vLLM runs each DP rank
    of a dense model as an engine of its own, with `data_parallel_rank` reset to 0)."""
    parallel = vllm_config.parallel_config
    return int(getattr(parallel, "data_parallel_index", parallel.data_parallel_rank))


def _remote_tokens(request: Request, has_state: bool) -> int:
    """Prompt tokens the prefill engine holds KV for: as its parameters say (the sequential
    flow), else the prompt, less its last token for a model with recurrent state (the prefill
    engine drops it: `SchedulerSide.on_new_request`), when the request was sent to both
    engines at once."""
    params = request.kv_transfer_params or {}
    prompt = len(request.prompt_token_ids or [])
    remote = params.get("remote_num_tokens")
    if remote is not None:
        return min(prompt, int(remote))
    return prompt - 1 if has_state and prompt > 1 else prompt
