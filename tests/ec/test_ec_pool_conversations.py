"""The encoder-cache consumer's conversations against a session server, by hand, no sockets.

They show what a consumer accepts as an answer: only one sealed for its open session that
echoes the `ref` of the question it asked. An answer to an earlier question (one queued before
its producer froze, say) answers nothing later (issue 22: a frozen producer cannot answer)."""

from __future__ import annotations

import threading

import pytest

from kvxfer.connector.messages import (
    EC_SERVICE,
    ECDone,
    ECInfo,
    ECQuery,
    ECTerms,
    ECValid,
    ProtocolError,
    decode,
    encode,
)
from kvxfer.ec import ECLoadError
from kvxfer.ec.pool.conversations import Conversations, Talk
from kvxfer.session.protocol import Claim, Reply, SessionServer, refusal

ADDRESS = "tcp://127.0.0.1:5800"
SECRET = "s3cret"
ENDPOINT = "127.0.0.1:15000"


@pytest.fixture
def conversations():
    talks = Conversations(
        [ADDRESS], SECRET, "consumer-0", "mooncake", threading.Event(), lambda _: None
    )
    yield talks
    talks.close()


@pytest.fixture
def server() -> SessionServer[None]:
    return SessionServer(EC_SERVICE, SECRET, max_sessions=4)


def _holder(message):
    """A producer that holds every item, as its answers say."""
    if isinstance(message, ECQuery):
        return ECInfo(ref=message.ref, mm_hash=message.mm_hash, found=True, dtype="uint8")
    assert isinstance(message, ECDone)
    return ECValid(ref=message.ref, lease=message.lease, ok=True)


def _serve(server: SessionServer[None], frames: list[bytes], answer=_holder) -> list[bytes]:
    """The producer's reply to `frames` (its side-channel thread's job)."""
    event = server.receive(b"consumer", frames)
    if isinstance(event, Reply):
        return event.frames
    if isinstance(event, Claim):
        assert event.claim == b"" and event.name == "consumer-0"
        _, welcome = server.accept(event, encode(ECTerms(endpoint=ENDPOINT)), lambda _: None)
        return welcome
    return server.seal(event.session, encode(answer(decode(event.payload))))


def _run(talk: Talk, server: SessionServer[None], answer=_holder, sent=None):
    """Drive a conversation to its end; every frame it sent is appended to `sent`."""
    frames = next(talk)
    while True:
        if sent is not None:
            sent.append(frames)
        try:
            frames = talk.send(_serve(server, frames, answer))
        except StopIteration as end:
            return end.value


def _query(conversations: Conversations, mm_hash: str = "item", link=None) -> Talk:
    return conversations.ask(ADDRESS, lambda ref: ECQuery(ref=ref, mm_hash=mm_hash), link)


def test_a_query_opens_one_session_and_later_questions_use_it(conversations, server):
    sent: list[list[bytes]] = []
    answer, link = _run(_query(conversations), server, sent=sent)
    assert isinstance(answer, ECInfo) and answer.found and answer.mm_hash == "item"
    assert link.endpoint == ENDPOINT and conversations.link(ADDRESS) is link
    assert [len(frames) for frames in sent] == [1, 1, 3]  # hello, handshake, the query
    (session,) = server.open_sessions()
    assert sent[-1][0] == session.id.encode()  # the envelope names the session

    sent.clear()
    answer, again = _run(_query(conversations, "other"), server, sent=sent)
    assert again is link and answer.mm_hash == "other"
    assert [len(frames) for frames in sent] == [3]  # no new handshake


def test_an_answer_to_an_earlier_question_answers_nothing_later(conversations, server):
    first = _query(conversations)
    frames = next(first)
    while len(frames) != 3:  # shake hands
        frames = first.send(_serve(server, frames))
    earlier = _serve(server, frames)  # the producer's answer to the first question
    with pytest.raises(StopIteration):
        first.send(earlier)

    later = _query(conversations)  # the same item, the same session, another question
    assert len(next(later)) == 3
    with pytest.raises(ProtocolError, match="another question"):
        later.send(earlier)  # signed, of this session, found=True: and still refused


def test_a_lost_session_is_shaken_again_once_but_a_leases_session_is_not(conversations, server):
    _, link = _run(_query(conversations), server)
    (session,) = server.open_sessions()
    server.end(session.id)  # the producer forgot it (idle, or restarted)

    done = conversations.ask(ADDRESS, lambda ref: ECDone(ref=ref, lease="l1"), link)
    with pytest.raises(ECLoadError, match="unknown session"):
        _run(done, server)  # the lease lived in that session: no other session will do
    assert conversations.link(ADDRESS) is None

    server.end(_run(_query(conversations), server)[1].client.session)
    sent: list[list[bytes]] = []
    answer, fresh = _run(_query(conversations), server, sent=sent)
    assert isinstance(answer, ECInfo) and fresh is not link
    assert [len(frames) for frames in sent] == [3, 1, 1, 3]  # refused, shaken again, asked


def test_a_refused_question_fails_alone_and_the_session_goes_on(conversations, server):
    _, link = _run(_query(conversations), server)
    refused = _query(conversations)
    next(refused)
    with pytest.raises(ECLoadError, match="refused: no"):
        refused.send(refusal("no"))  # that conversation fails...
    assert link.is_open and conversations.link(ADDRESS) is link  # ...the session stays

    sent: list[list[bytes]] = []
    answer, same = _run(_query(conversations), server, sent=sent)
    assert isinstance(answer, ECInfo) and same is link
    assert [len(frames) for frames in sent] == [3]  # asked on it, no new handshake
