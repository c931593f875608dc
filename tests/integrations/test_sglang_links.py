"""A decode rank's link to a prefill DP group (`kvxfer.integrations.sglang.links`) without
SGLang: the transition table (every legal move, every other raising, the docstring's table the
code's), and what a link keeps and drops as answers, refusals and handshakes come.
`make test-sglang` runs links between SGLang's own managers."""

from __future__ import annotations

import pytest
from helpers import TransitionTableCases

from kvxfer.integrations.sglang import links
from kvxfer.integrations.sglang.links import GroupLink, LinkEvent, LinkState

S, E = LinkState, LinkEvent

LEGAL = {
    E.ANSWERED: {S.REGISTERING: S.CONNECTING},
    E.REFUSED: {S.REGISTERING: S.FAILED},
    E.CONNECTED: {S.CONNECTING: S.CONNECTED},
    E.FAILED: {S.CONNECTING: S.FAILED},
    E.RETRY: {S.FAILED: S.REGISTERING},
}


class TestLinkTable(TransitionTableCases):
    module = links
    states, events = LinkState, LinkEvent
    legal = LEGAL


def _answered(link: GroupLink) -> None:
    for rank in range(link.ranks):
        link.answer(rank, [f"side-channel-{rank}"])


def test_the_last_answer_connects_with_every_ranks_side_channels_in_rank_order():
    link = GroupLink(3, "n1")
    assert link.expects("n1") and not link.expects("n0")
    assert not link.answer(2, ["c"])
    assert not link.answer(0, ["a"])
    assert link.answer(1, ["b"])
    assert link.state is S.CONNECTING
    assert link.side_channels() == [["a"], ["b"], ["c"]]
    assert not link.expects("n1")  # a late duplicate is no longer waited for


def test_a_refusal_counts_only_while_the_group_registers():
    link = GroupLink(2, "n")
    link.answer(0, ["a"])
    error = ConnectionRefusedError("its proof does not hold")
    assert link.refuse(error)
    assert link.state is S.FAILED and link.outcome() is error
    assert not link.refuse(ConnectionRefusedError("again"))  # already failed: kept as it was
    assert link.outcome() is error

    answered = GroupLink(1, "n")
    _answered(answered)
    assert not answered.refuse(error)  # every rank answered, signed: an unsigned refusal waits
    assert answered.state is S.CONNECTING and answered.outcome() is None


def test_aborts_before_connecting_go_to_the_producers_once_connected():
    link = GroupLink(1, "n")
    assert link.abort_early(7)
    _answered(link)
    assert link.abort_early(8)
    consumer = object()
    assert link.connected(consumer) == {7, 8}  # type: ignore[arg-type]
    assert link.outcome() is consumer
    assert not link.abort_early(9)  # connected: the caller tells the consumer itself
    assert link.early_aborts == set()


def test_a_failed_handshake_registers_again_from_scratch():
    link = GroupLink(2, "old")
    _answered(link)
    link.abort_early(5)
    link.failed(TimeoutError("handshake"))
    assert isinstance(link.outcome(), TimeoutError)
    assert not link.abort_early(6)
    link.retry(3, "new")
    assert link.state is S.REGISTERING and link.outcome() is None
    assert (link.ranks, link.answers, link.early_aborts) == (3, {}, set())
    assert link.expects("new") and not link.expects("old")


def test_a_connected_link_cannot_be_retried():
    link = GroupLink(1, "n")
    _answered(link)
    link.connected(object())  # type: ignore[arg-type]
    with pytest.raises(links.IllegalTransition, match="'connected' cannot take event 'retry'"):
        link.retry(1, "again")
