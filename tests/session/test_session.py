"""The session layer on its own: a server and a client exchanging frames, no sockets."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvxfer.session.protocol import (
    Claim,
    ClientState,
    Delivered,
    Delivery,
    Opened,
    Rejected,
    Reply,
    ServerSession,
    SessionClient,
    SessionServer,
)
from kvxfer.session.wire import PROTOCOL_VERSION, Hello, ProtocolError, Refused, decode, encode

PEER = b"peer-1"


def _shake(server: SessionServer, client: SessionClient, identity: bytes = PEER) -> Reply:
    """The client's hello, the server's challenge: the client's handshake, to be sent."""
    challenge = server.receive(identity, client.hello())
    assert isinstance(challenge, Reply)
    shake = client.receive(challenge.frames)
    assert isinstance(shake, Reply)
    return shake


def _handshake(
    server: SessionServer[str], client: SessionClient, identity: bytes = PEER
) -> tuple[ServerSession[str], Opened]:
    shake = _shake(server, client, identity)
    claim = server.receive(identity, shake.frames)
    assert isinstance(claim, Claim)
    session, welcome = server.accept(claim, b"terms:" + claim.claim, lambda sid: f"state-{sid}")
    opened = client.receive(welcome)
    assert isinstance(opened, Opened)
    return session, opened


def test_a_handshake_opens_one_session_whose_frames_flow_both_ways() -> None:
    server: SessionServer[str] = SessionServer("kv", "s3cret", max_sessions=4)
    client = SessionClient("kv", "s3cret", "decode-0", b"my-geometry")
    session, opened = _handshake(server, client)
    assert opened.terms == b"terms:my-geometry"
    assert client.state is ClientState.OPEN and client.session == session.id
    assert session.name == "decode-0" and session.state == f"state-{session.id}"
    delivery = server.receive(b"peer-1-reconnected", client.seal(b"ask"))
    assert isinstance(delivery, Delivery) and delivery.payload == b"ask"
    assert delivery.session is session and session.identity == b"peer-1-reconnected"
    answer = client.receive(server.seal(session, b"answer"))
    assert answer == Delivered(b"answer")
    assert server.open_sessions() == [session]


@pytest.mark.parametrize(("client_secret", "server_secret"), [("a", "b"), ("", "b"), ("a", "")])
def test_a_client_without_the_servers_secret_is_refused(
    client_secret: str, server_secret: str
) -> None:
    server: SessionServer[None] = SessionServer("kv", server_secret, max_sessions=4)
    client = SessionClient("kv", client_secret, "decode-0", b"claim")
    shake = _shake(server, client)
    with pytest.raises(ProtocolError, match="shared secret"):
        server.receive(PEER, shake.frames)
    assert server.open_sessions() == []


def test_a_server_without_the_secret_cannot_open_a_session_on_the_client() -> None:
    impostor: SessionServer[None] = SessionServer("kv", "guess", max_sessions=4)
    client = SessionClient("kv", "s3cret", "decode-0", b"claim")
    shake = _shake(impostor, client)
    # The impostor skips its own proof check and welcomes the client anyway.
    claim = Claim(PEER, "decode-0", b"claim", *_nonces(shake.frames))
    _, welcome = impostor.accept(claim, b"terms", lambda sid: None)
    with pytest.raises(ProtocolError, match="could not prove the shared secret"):
        client.receive(welcome)
    assert client.state is ClientState.CLOSED
    with pytest.raises(ProtocolError, match="no open session"):
        client.seal(b"ask")


def _nonces(frames: list[bytes]) -> tuple[str, str]:
    from kvxfer.session.wire import Handshake

    shake = decode(frames[0])
    assert isinstance(shake, Handshake)
    return shake.client_nonce, shake.server_nonce


def test_a_replayed_handshake_and_a_foreign_peers_handshake_find_no_challenge() -> None:
    server: SessionServer[None] = SessionServer("kv", "s", max_sessions=4)
    client = SessionClient("kv", "s", "decode-0", b"claim")
    shake = _shake(server, client)
    with pytest.raises(ProtocolError, match="no matching Hello"):
        server.receive(b"someone-else", shake.frames)  # the challenge was not theirs
    assert isinstance(server.receive(PEER, shake.frames), Claim)
    with pytest.raises(ProtocolError, match="no matching Hello"):
        server.receive(PEER, shake.frames)  # redeemed once


def test_a_proof_for_one_service_is_refused_by_another() -> None:
    ec: SessionServer[None] = SessionServer("ec", "s", max_sessions=4)
    with pytest.raises(ProtocolError, match="serves 'ec', not 'kv'"):
        ec.receive(PEER, SessionClient("kv", "s", "decode-0", b"claim").hello())


def test_hellos_beyond_max_sessions_are_refused_until_one_ends() -> None:
    server: SessionServer[str] = SessionServer("kv", "s", max_sessions=1)
    session, _ = _handshake(server, SessionClient("kv", "s", "a", b""))
    with pytest.raises(ProtocolError, match="1 sessions are open"):
        server.receive(b"peer-2", SessionClient("kv", "s", "b", b"").hello())
    assert server.end(session.id) is session
    assert isinstance(server.receive(b"peer-2", SessionClient("kv", "s", "b", b"").hello()), Reply)


def test_an_ended_session_answers_session_lost_and_the_client_may_shake_hands_again() -> None:
    server: SessionServer[str] = SessionServer("kv", "s", max_sessions=4)
    client = SessionClient("kv", "s", "decode-0", b"claim")
    session, _ = _handshake(server, client)
    server.end(session.id)
    lost = server.receive(PEER, client.seal(b"ask"))
    assert isinstance(lost, Reply)
    rejected = client.receive(lost.frames)
    assert rejected == Rejected("unknown session; shake hands again", session_lost=True)
    assert client.state is ClientState.OPEN  # it is the application's call to reconnect


def test_a_tampered_or_foreign_session_frame_is_refused() -> None:
    server: SessionServer[str] = SessionServer("kv", "s", max_sessions=4)
    client = SessionClient("kv", "s", "decode-0", b"claim")
    session, _ = _handshake(server, client)
    sid, _, mac = client.seal(b"ask")
    with pytest.raises(ProtocolError, match="valid MAC"):
        server.receive(PEER, [sid, b"asK", mac])
    with pytest.raises(ProtocolError, match="valid MAC"):
        client.receive([sid, b"answeR", server.seal(session, b"answer")[2]])
    other_server: SessionServer[str] = SessionServer("kv", "s", max_sessions=4)
    other, _ = _handshake(other_server, SessionClient("kv", "s", "decode-1", b""))
    with pytest.raises(ProtocolError, match="another session"):
        client.receive(other_server.seal(other, b"answer"))


def test_messages_out_of_turn_and_odd_frame_counts_are_protocol_errors() -> None:
    server: SessionServer[None] = SessionServer("kv", "s", max_sessions=4)
    client = SessionClient("kv", "s", "decode-0", b"claim")
    with pytest.raises(ProtocolError, match="got 2 frames"):
        server.receive(PEER, [b"a", b"b"])
    with pytest.raises(ProtocolError, match="does not accept Refused"):
        server.receive(PEER, [encode(Refused(reason="x"))])
    with pytest.raises(ProtocolError, match="not a kvxfer handshake message"):
        server.receive(PEER, [b"\xc1garbage"])
    client.hello()
    with pytest.raises(ProtocolError, match="hello\\(\\) on a client that is greeted"):
        client.hello()
    with pytest.raises(ProtocolError, match="unexpected Hello while greeted"):
        client.receive([encode(Hello(service="kv", name="x", nonce="00"))])


def test_another_protocol_version_is_named() -> None:
    server: SessionServer[None] = SessionServer("kv", "s", max_sessions=4)
    old = encode(Hello(service="kv", name="x", nonce="00", version=PROTOCOL_VERSION - 1))
    with pytest.raises(ProtocolError, match=f"this peer speaks version {PROTOCOL_VERSION}"):
        server.receive(PEER, [old])


def test_a_refusal_closes_the_client() -> None:
    client = SessionClient("kv", "s", "decode-0", b"claim")
    client.hello()
    rejected = client.receive([encode(Refused(reason="full"))])
    assert rejected == Rejected("full", session_lost=False)
    assert client.state is ClientState.CLOSED


def test_the_session_layer_imports_without_torch_or_zeromq() -> None:
    code = (
        "import sys, kvxfer.session.protocol, kvxfer.session.wire;"
        "bad = [m for m in ('torch', 'zmq', 'numpy') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_refused_session_frame_leaves_the_open_client_open() -> None:
    server: SessionServer[str] = SessionServer("kv", "s", max_sessions=4)
    client = SessionClient("kv", "s", "decode-0", b"claim")
    session, _ = _handshake(server, client)
    rejected = client.receive([encode(Refused(reason="a producer does not accept Pong"))])
    assert rejected == Rejected("a producer does not accept Pong", session_lost=False)
    assert client.state is ClientState.OPEN  # the server keeps the session: so does the client
    assert client.receive(server.seal(session, b"answer")) == Delivered(b"answer")


def test_overlapping_handshakes_cannot_open_more_than_max_sessions() -> None:
    server: SessionServer[str] = SessionServer("kv", "s", max_sessions=1)
    claims = []
    for name in ("a", "b"):  # both hellos come in while no session is open
        client = SessionClient("kv", "s", name, b"")
        challenge = server.receive(name.encode(), client.hello())
        assert isinstance(challenge, Reply)
        shake = client.receive(challenge.frames)
        assert isinstance(shake, Reply)
        claim = server.receive(name.encode(), shake.frames)
        assert isinstance(claim, Claim)
        claims.append(claim)
    server.accept(claims[0], b"", str)
    with pytest.raises(ProtocolError, match="1 sessions are open"):
        server.accept(claims[1], b"", str)
    assert len(server.open_sessions()) == 1


def test_a_challenge_waits_for_a_starved_client_and_the_count_bounds_them(monkeypatch):
    """A client unscheduled for an hour between its hello and its proof still finds its
    challenge (the client's handshake timeout decides how long it waits); the number of
    outstanding challenges stays bounded, the oldest going first; a set TTL still expires."""
    from kvxfer.session import auth

    now = [1000.0]
    monkeypatch.setattr(auth.time, "monotonic", lambda: now[0])
    challenges = auth.Challenges(max_pending=2)
    nonce = challenges.issue(b"peer", "c1", "decode")
    now[0] += 3600
    assert challenges.redeem(b"peer", "c1", nonce) == "decode"
    first = challenges.issue(b"peer", "a", "x")
    challenges.issue(b"peer", "b", "x")
    challenges.issue(b"peer", "c", "x")
    assert challenges.redeem(b"peer", "a", first) is None  # the oldest went first
    timed = auth.Challenges(ttl_s=10.0)
    nonce = timed.issue(b"peer", "c2", "decode")
    now[0] += 11
    assert timed.redeem(b"peer", "c2", nonce) is None
