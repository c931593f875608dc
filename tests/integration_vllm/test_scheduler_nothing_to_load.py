"""A prefill whose request has no KV to hand over still answers with `kv_transfer_params`, which
send the decode engine to compute the prompt itself (a router given none reports the prefill
engine as one without a KV connector: kvxfer's P/D proxy answered 502)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from pd_engines import single_engine_parallelism
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.request import RequestStatus

from kvxfer.integrations.settings import ConnectorSettings
from kvxfer.integrations.vllm.scheduler import SchedulerSide, nothing_to_load


def _scheduler_side() -> SchedulerSide:
    return SchedulerSide(single_engine_parallelism(), ConnectorSettings(), "prefill-0")


def _request(status: RequestStatus, computed: int) -> SimpleNamespace:
    return SimpleNamespace(
        request_id="r-1",
        kv_transfer_params={"do_remote_decode": True},
        status=status,
        num_computed_tokens=computed,
    )


@pytest.mark.parametrize(
    ("status", "computed", "blocks"),
    [
        pytest.param(RequestStatus.FINISHED_LENGTH_CAPPED, 0, [3], id="no-token-computed"),
        pytest.param(RequestStatus.FINISHED_STOPPED, 5, [], id="no-block"),
        pytest.param(RequestStatus.FINISHED_ABORTED, 5, [3], id="aborted"),
    ],
)
def test_nothing_to_hand_over_sends_the_decode_engine_to_compute_the_prompt(
    status: RequestStatus, computed: int, blocks: list[int]
) -> None:
    side = _scheduler_side()
    delay_free, params = side.request_finished(_request(status, computed), blocks)  # type: ignore[arg-type]
    assert (delay_free, params) == (False, nothing_to_load())
    metadata = side.build_connector_meta(SchedulerOutput.make_empty())
    assert metadata.sends == []  # nothing published, blocks freed now


def test_a_prompt_shorter_than_a_block_is_handed_over() -> None:
    side = _scheduler_side()
    request = _request(RequestStatus.FINISHED_LENGTH_CAPPED, 1)
    delay_free, params = side.request_finished(request, [7])  # type: ignore[arg-type]
    assert delay_free and params is not None
    assert params["do_remote_prefill"] and params["remote_block_ids"] == [7]
    assert params["remote_num_tokens"] == 1
    metadata = side.build_connector_meta(SchedulerOutput.make_empty())
    assert [s.request_id for s in metadata.sends] == ["r-1"]


def test_the_decode_side_computes_the_prompt_given_those_params() -> None:
    side = _scheduler_side()
    request = SimpleNamespace(
        request_id="d-1", kv_transfer_params=nothing_to_load(), prompt_token_ids=[1, 2, 3]
    )
    assert side.get_num_new_matched_tokens(request, 0) == (0, False)  # type: ignore[arg-type]
