"""The producer's request table: who may release a request, exactly once, in bounded memory."""

from __future__ import annotations

import numpy as np
import pytest

from kvxfer.connector.requests import ReleaseReason, RequestTable

IDS = np.arange(4, dtype=np.int64)


def test_every_rank_of_every_fetching_engine_must_report():
    table = RequestTable()
    table.publish("r", IDS, 10, timeout=60)
    table.report_done("r", "decode", 2, engine_size=4)  # a rank that reads nothing here, early
    table.note_fetcher("r", "decode", 4)
    table.note_fetcher("r", "other", 1)
    assert not table.report_done("r", "decode", 0, 4)
    assert not table.report_done("r", "decode", 1, 4)
    assert not table.report_done("r", "decode", 3, 4)  # decode is complete, "other" is not
    assert table.report_done("r", "other", 0, 1)
    assert table.release("r") and not table.release("r")  # once


def test_an_engine_that_did_not_fetch_cannot_report_or_abort_a_fetched_request():
    table = RequestTable()
    table.publish("r", IDS, 10, timeout=60)
    table.note_fetcher("r", "decode", 1)
    assert not table.report_done("r", "stranger", 0, 1)
    assert not table.abort("r", "stranger")
    assert table.abort("r", "decode")


def test_a_request_nobody_fetched_here_is_released_by_the_reporting_engine():
    table = RequestTable()  # as with MLA: this producer rank feeds no decode rank
    table.publish("r", IDS, 10, timeout=60)
    assert not table.report_done("r", "decode", 0, 2)
    assert table.report_done("r", "decode", 1, 2)


def test_an_abort_before_the_publish_is_kept_for_the_publish():
    table = RequestTable()
    assert not table.abort("early", "decode")
    assert table.publish("early", IDS, 10, timeout=60) is ReleaseReason.ABORTED  # at once
    assert table.publish("later", IDS, 10, timeout=60) is None


def test_reports_before_the_publish_count_at_the_publish():
    # Decode ranks that read nothing from this producer can finish before it publishes
    # (another prefill rank published first): their reports must not be lost.
    table = RequestTable()
    assert not table.report_done("r", "decode", 2, engine_size=4)
    assert not table.report_done("r", "decode", 3, engine_size=4)
    assert table.publish("r", IDS, 10, timeout=60) is None  # ranks 0 and 1 still read
    table.note_fetcher("r", "decode", 4)
    assert not table.report_done("r", "decode", 0, 4)
    assert table.report_done("r", "decode", 1, 4)


def test_a_request_every_rank_finished_before_its_publish_is_released_at_the_publish():
    table = RequestTable()
    for rank in range(2):
        assert not table.report_done("r", "decode", rank, engine_size=2)
    assert table.publish("r", IDS, 10, timeout=60) is ReleaseReason.READ
    assert table.release("r")


def test_early_reports_are_forgotten_within_bounds():
    table = RequestTable(released_ttl_s=60, max_released=10)
    for i in range(100):
        table.report_done(f"never{i}", "decode", 0, engine_size=2)  # never published here
    assert table.publish("never0", IDS, 10, timeout=60) is None  # its report was forgotten
    table.report_done("r", "decode", 0, engine_size=1)
    table.release("r")  # not published: nothing to release
    assert table.publish("r", IDS, 10, timeout=60) is ReleaseReason.READ


def test_released_ids_are_refused_then_forgotten_within_bounds():
    table = RequestTable(released_ttl_s=60, max_released=100)
    for i in range(1000):
        table.publish(f"r{i}", IDS, 10, timeout=60)
        assert table.release(f"r{i}")
    assert table.released_kept == 100  # the oldest were forgotten
    with pytest.raises(ValueError, match="already published"):
        table.publish("r999", IDS, 10, timeout=60)
    table.publish("r0", IDS, 10, timeout=60)  # forgotten: may be published again


def test_layer_readiness_grows_per_step_and_never_over_promises():
    table = RequestTable()
    table.publish("r", IDS, 64, timeout=60, ready_tokens=0)
    request = table.get("r")
    assert request is not None
    assert not table.is_ready(request, 16, 1)
    table.mark_ready("r", 32, layers=1)  # a step computing tokens [0, 32), its first layer
    assert table.is_ready(request, 32, 1) and not table.is_ready(request, 32, 2)
    assert not table.is_ready(request, 48, 1)
    table.mark_ready("r", 32, layers=3)
    assert table.is_ready(request, 32, 3)
    with pytest.raises(ValueError, match="layers 2 below the 3 marked"):
        table.mark_ready("r", 32, layers=2)
    # The next step's first layer, without the last step marked whole: the tokens both cover
    # keep the fewer layers.
    table.mark_ready("r", 64, layers=1)
    assert table.is_ready(request, 32, 1) and not table.is_ready(request, 32, 2)
    table.mark_ready("r", 32)  # the first step done in every layer
    assert table.is_ready(request, 32, 8) and table.is_ready(request, 64, 1)
    table.mark_ready("r", 64)
    assert table.is_ready(request, 64, 8)


def test_a_failed_publication_confirms_no_read_from_then_on():
    """After `fail` returns the engine may give the blocks away (a preemption): a read
    reported after that is not confirmed, even before the release."""
    table = RequestTable()
    table.publish("r", IDS, 64, timeout=60, ready_tokens=0)
    request = table.get("r")
    assert request is not None and table.holds("r", request.generation)
    assert table.fail("r", "preempted")
    assert not table.holds("r", request.generation)
    assert table.release("r")
