"""The prefill scheduler's side of streaming (docs/vllm.md, "Streaming the prefill"), over
vLLM's own `Request`, `NewRequestData` and `SchedulerOutput`: which requests are offered as
their prompt is scheduled, and what happens to one vLLM preempts or aborts before it finished
(its publication fails before any later step can write its blocks; they are freed only once the
producer released it). The flow end to end is in test_pd_flow.py and the real-engine e2e."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch
from pd_engines import single_engine_parallelism
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request, RequestStatus

from kvxfer.integrations.settings import ConnectorSettings
from kvxfer.integrations.vllm.scheduler import SchedulerSide, nothing_to_load

PROMPT = list(range(100, 140))  # 40 tokens
TABLE = [7, 9, 11]  # blocks of 16


def _groups(*specs: object) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn"], spec)
            for i, spec in enumerate(specs)
        ],
    )


ATTENTION = {"block_size": 16, "num_kv_heads": 2, "head_size": 8, "dtype": torch.bfloat16}
ONE_GROUP = _groups(FullAttentionSpec(**ATTENTION))
WITH_A_WINDOW = _groups(
    FullAttentionSpec(**ATTENTION), SlidingWindowSpec(sliding_window=32, **ATTENTION)
)


def _scheduler_side(kv_cache_config: KVCacheConfig = ONE_GROUP, **settings) -> SchedulerSide:
    extra = {"bootstrap_address": "127.0.0.1:9", **settings}  # starts no service
    return SchedulerSide(
        single_engine_parallelism(),
        ConnectorSettings.from_extra_config(extra),
        "prefill-0",
        produces=True,
        kv_cache_config=kv_cache_config,
    )


def _request(request_id: str = "p-1", max_tokens: int = 1, transfer_id: str | None = "x-1"):
    params = {"do_remote_decode": True, "do_remote_prefill": False}
    if transfer_id is not None:
        params["transfer_id"] = transfer_id
    sampling = SamplingParams(max_tokens=max_tokens, extra_args={"kv_transfer_params": params})
    return Request(request_id, list(PROMPT), sampling, None)


def _schedule(
    side: SchedulerSide, request: Request, tokens: int = len(PROMPT), table: list[int] = TABLE
):
    """What vLLM's scheduler does with a waiting request: allocate, then build the step's
    output and the connector's metadata (`tokens` of its prompt scheduled, in `table`)."""
    side.update_state_after_alloc(request, None, 0)  # type: ignore[arg-type]
    output = SchedulerOutput.make_empty()
    output.scheduled_new_reqs = [NewRequestData.from_request(request, (list(table),))]
    output.num_scheduled_tokens = {request.request_id: tokens}
    return side.build_connector_meta(output)


def _continue(side: SchedulerSide, request_id: str, computed: int, tokens: int, blocks):
    """A later step of a running request: `tokens` more scheduled, `blocks` newly allocated."""
    output = SchedulerOutput.make_empty()
    output.scheduled_cached_reqs = CachedRequestData(
        req_ids=[request_id],
        resumed_req_ids=set(),
        new_token_ids=[],
        all_token_ids={},
        new_block_ids=[(list(blocks),)],
        num_computed_tokens=[computed],
        num_output_tokens=[0],
    )
    output.num_scheduled_tokens = {request_id: tokens}
    return side.build_connector_meta(output)


def _next_step(side: SchedulerSide, preempted: set[str] | None = None):
    output = SchedulerOutput.make_empty()
    output.preempted_req_ids = preempted
    return side.build_connector_meta(output)


def _finish(side: SchedulerSide, request: Request, status: RequestStatus):
    request.status = status
    request.num_computed_tokens = len(PROMPT)
    return side.request_finished(request, list(TABLE))


def test_a_one_token_concurrent_prefill_is_offered_as_scheduled_and_handed_over_once():
    side = _scheduler_side()
    request = _request()
    metadata = _schedule(side, request)
    (send,) = metadata.sends
    assert (send.request_id, send.offered_as, send.num_tokens) == ("p-1", "x-1", len(PROMPT))
    assert send.ready_tokens == 0 and send.block_ids == [TABLE]
    (step,) = metadata.stream_steps  # this step computes the whole prompt
    assert (step.offered_as, step.tokens, step.block_ids) == ("x-1", len(PROMPT), None)
    delay_free, params = _finish(side, request, RequestStatus.FINISHED_LENGTH_CAPPED)
    assert delay_free and params is not None
    assert params["remote_request_id"] == "x-1" and params["remote_num_tokens"] == len(PROMPT)
    after = _next_step(side)
    assert after.sends == [] and after.send_failures == []  # offered once, not again


@pytest.mark.parametrize(
    ("request_kwargs", "scheduled", "settings"),
    [
        pytest.param({"transfer_id": None}, len(PROMPT), {}, id="sequential-flow"),
        pytest.param({"max_tokens": 2}, len(PROMPT), {}, id="decodes-on"),
        pytest.param({}, 32, {"kv_cache_config": WITH_A_WINDOW}, id="chunked-with-a-window"),
        pytest.param({}, len(PROMPT), {"stream_prefill": False}, id="turned-off"),
    ],
)
def test_others_are_offered_when_they_finish(request_kwargs, scheduled, settings):
    side = _scheduler_side(**settings)
    request = _request(**request_kwargs)
    assert _schedule(side, request, scheduled).sends == []
    delay_free, _ = _finish(side, request, RequestStatus.FINISHED_LENGTH_CAPPED)
    (send,) = _next_step(side).sends
    assert delay_free and send.ready_tokens is None


def test_a_chunked_prefill_streams_chunk_by_chunk_with_its_growing_table():
    side = _scheduler_side()
    request = _request()
    first = _schedule(side, request, tokens=32, table=TABLE[:2])  # a budget of 32 tokens
    (send,) = first.sends
    assert send.block_ids == [TABLE[:2]] and send.ready_tokens == 0
    assert [(s.tokens, s.block_ids) for s in first.stream_steps] == [(32, None)]
    second = _continue(side, "p-1", computed=32, tokens=8, blocks=TABLE[2:])
    assert second.sends == []
    assert [(s.tokens, s.block_ids) for s in second.stream_steps] == [(len(PROMPT), [TABLE])]
    delay_free, params = _finish(side, request, RequestStatus.FINISHED_LENGTH_CAPPED)
    assert delay_free and params is not None and params["remote_block_ids"] == TABLE


def test_a_preempted_stream_fails_before_its_blocks_are_written_and_is_not_streamed_again():
    side = _scheduler_side()
    request = _request()
    _schedule(side, request)
    # vLLM freed its blocks under a preemption: the next step's metadata fails it first.
    (failure,) = _next_step(side, preempted={"p-1", "someone-else"}).send_failures
    assert (failure.request_id, failure.offered_as) == ("p-1", "x-1")
    assert "preempted" in failure.reason
    request.num_preemptions = 1
    request.status = RequestStatus.WAITING
    assert _schedule(side, request).sends == []  # computed again: offered when it finishes
    _finish(side, request, RequestStatus.FINISHED_LENGTH_CAPPED)
    (send,) = _next_step(side).sends
    assert send.ready_tokens is None and send.offered_as == "x-1"


def test_an_aborted_stream_fails_and_keeps_its_blocks_until_released():
    side = _scheduler_side()
    request = _request()
    _schedule(side, request)
    delay_free, params = _finish(side, request, RequestStatus.FINISHED_ABORTED)
    # Held until the producer released it: a decode rank may be reading its blocks.
    assert delay_free and params == nothing_to_load()
    metadata = _next_step(side)
    assert metadata.sends == []
    assert [(f.request_id, f.offered_as) for f in metadata.send_failures] == [("p-1", "x-1")]
