"""`MooncakeECConnector` with a shared secret: the handshake is a challenge-response (the secret
never on the wire), session frames carry MACs, and a peer that cannot prove the secret gets
nothing while the producer touches nothing. Raw peers speak the side channel by hand."""

from __future__ import annotations

import os

import pytest
import torch
import zmq
from ec_cases import same_bits

from kvxfer.connector import auth
from kvxfer.connector.messages import (
    ECChallenge,
    ECDone,
    ECHandshake,
    ECHello,
    ECPin,
    ECPinned,
    ECQuery,
    ECValid,
    ECWelcome,
    ErrorReply,
    decode,
    encode,
)
from kvxfer.ec import ECConnectorFactory, ECLoadError

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
SECRET = "correct horse battery staple"
ITEM = torch.arange(4096, dtype=torch.float32).reshape(64, 64)
POISON = 0xA5


@pytest.fixture
def producer():
    connector = ECConnectorFactory.create(
        "MooncakeECConnector", "producer", {"pool_bytes": 1 << 20, "secret": SECRET}
    )
    connector.save("item", ITEM)
    yield connector
    connector.close()


def _consumer(address: str, **config):
    config = {"producer_addresses": [address], "recv_bytes": 1 << 20, **config}
    return ECConnectorFactory.create("MooncakeECConnector", "consumer", config)


class RawPeer:
    """A DEALER socket on the producer's side channel, one message at a time."""

    def __init__(self, address: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def ask(self, *frames: bytes):
        self.sock.send_multipart(list(frames))
        assert self.sock.poll(5000), "no answer"
        answer = self.sock.recv_multipart()
        return decode(answer[0]), answer

    def close(self) -> None:
        self.sock.close()


def _handshake(peer: RawPeer, secret: str, name: str = "raw"):
    """A full handshake; returns (the handshake frame sent, the welcome, the session key)."""
    client_nonce = auth.new_nonce()
    challenge, _ = peer.ask(encode(ECHello(consumer=name, nonce=client_nonce)))
    assert isinstance(challenge, ECChallenge)
    proof = auth.proof(secret, "consumer", client_nonce, challenge.nonce, "ec", name)
    frame = encode(
        ECHandshake(
            consumer=name,
            client_nonce=client_nonce,
            server_nonce=challenge.nonce,
            proof=proof,
        )
    )
    welcome, _ = peer.ask(frame)
    if not isinstance(welcome, ECWelcome):
        return frame, welcome, b""
    expected = auth.proof(
        secret, "producer", client_nonce, challenge.nonce, welcome.session, welcome.endpoint
    )
    assert auth.proof_matches(expected, welcome.proof)  # the producer proved it too
    key = auth.session_key(secret, client_nonce, challenge.nonce, welcome.session)
    return frame, welcome, key


def _signed(key: bytes, message) -> list[bytes]:
    frame = encode(message)
    return [frame, auth.sign(key, frame)]


def test_a_consumer_without_the_secret_gets_nothing_and_the_producer_touches_nothing(producer):
    for config in ({}, {"secret": "wrong"}):
        with _consumer(producer.address, **config) as consumer:
            consumer._recv.fill_(POISON)
            assert consumer.has("item") is False
            with pytest.raises(ECLoadError, match="secret"):
                consumer.load("item")
            assert bool((consumer._recv == POISON).all())  # nothing was read
            assert consumer.stats_snapshot()["engines"] == 0  # no Mooncake engine was needed
    stats = producer.stats_snapshot()
    assert stats["sessions"] == 0 and stats["leases"] == 0 and stats["pinned"] == 0
    with _consumer(producer.address, secret=SECRET) as consumer:
        assert consumer.has("item") and same_bits(consumer.load("item"), ITEM)
    assert producer.stats_snapshot()["pinned"] == 0


def test_forged_and_replayed_proofs_are_refused(producer):
    peer = RawPeer(producer.address)
    try:
        # a proof made without the secret
        nonce = auth.new_nonce()
        challenge, _ = peer.ask(encode(ECHello(consumer="raw", nonce=nonce)))
        forged = ECHandshake(
            consumer="raw",
            client_nonce=nonce,
            server_nonce=challenge.nonce,
            proof=auth.proof("guess", "consumer", nonce, challenge.nonce, "ec", "raw"),
        )
        refusal, _ = peer.ask(encode(forged))
        assert isinstance(refusal, ErrorReply) and "secret" in refusal.reason
        assert SECRET not in refusal.reason

        # a good handshake, replayed as it was, then after a new hello with the same nonce
        frame, welcome, _ = _handshake(peer, SECRET)
        assert isinstance(welcome, ECWelcome)
        refusal, _ = peer.ask(frame)
        assert isinstance(refusal, ErrorReply) and "no matching hello" in refusal.reason
        old = decode(frame)
        assert isinstance(old, ECHandshake)
        again, _ = peer.ask(encode(ECHello(consumer="raw", nonce=old.client_nonce)))
        assert isinstance(again, ECChallenge) and again.nonce != old.server_nonce
        refusal, _ = peer.ask(frame)
        assert isinstance(refusal, ErrorReply) and "no matching hello" in refusal.reason

        # a handshake from another socket cannot use this socket's hello
        thief = RawPeer(producer.address)
        nonce = auth.new_nonce()
        challenge, _ = peer.ask(encode(ECHello(consumer="raw", nonce=nonce)))
        proof = auth.proof(SECRET, "consumer", nonce, challenge.nonce, "ec", "raw")
        shake = ECHandshake(
            consumer="raw", client_nonce=nonce, server_nonce=challenge.nonce, proof=proof
        )
        refusal, _ = thief.ask(encode(shake))
        thief.close()
        assert isinstance(refusal, ErrorReply) and "no matching hello" in refusal.reason
        assert producer.stats_snapshot()["sessions"] == 1
    finally:
        peer.close()


def test_session_frames_need_the_session_key_and_leases_their_session(producer):
    peer, other = RawPeer(producer.address), RawPeer(producer.address)
    try:
        _, welcome, key = _handshake(peer, SECRET)
        _, other_welcome, other_key = _handshake(other, SECRET, "other")
        session = welcome.session
        pin = ECPin(session=session, ref=1, mm_hash="item")

        unsigned, _ = peer.ask(encode(pin))
        bad_mac, _ = peer.ask(encode(pin), b"\0" * auth.MAC_BYTES)
        empty_key, _ = peer.ask(*_signed(auth.session_key("", "a", "b", session), pin))
        wrong_session, _ = peer.ask(*_signed(other_key, pin))
        for refusal in (unsigned, bad_mac, empty_key, wrong_session):
            assert isinstance(refusal, ErrorReply) and "MAC" in refusal.reason, refusal
        unknown, _ = peer.ask(*_signed(key, ECQuery(session="f" * 32, ref=2, mm_hash="item")))
        assert isinstance(unknown, ErrorReply) and unknown.session_lost
        assert producer.stats_snapshot()["leases"] == 0  # nothing was pinned

        pinned, frames = peer.ask(*_signed(key, pin))
        assert isinstance(pinned, ECPinned) and pinned.ok and pinned.ref == 1
        assert auth.verify(key, frames[0], frames[1])  # the answer is signed too
        assert producer.stats_snapshot()["leases"] == 1
        # another session cannot end this lease
        done = ECDone(session=other_welcome.session, ref=3, lease=pinned.lease)
        stolen, _ = other.ask(*_signed(other_key, done))
        assert isinstance(stolen, ECValid) and not stolen.ok and "not this session" in stolen.reason
        assert producer.stats_snapshot()["leases"] == 1
        done = ECDone(session=session, ref=4, lease=pinned.lease)
        valid, _ = peer.ask(*_signed(key, done))
        assert isinstance(valid, ECValid) and valid.ok and valid.ref == 4
        assert producer.stats_snapshot()["leases"] == 0
        assert producer.stats_snapshot()["pinned"] == 0
    finally:
        peer.close()
        other.close()
