"""`PoolECConnector` with a shared secret: the handshake is the session layer's
challenge-response (the secret never on the wire), session frames carry MACs, and a peer that
cannot prove the secret gets nothing while the producer touches nothing. Raw peers speak the
side channel by hand: honest steps through a `SessionClient`, attacks as forged frames."""

from __future__ import annotations

import os
import threading

import pytest
import torch
import zmq
from ec_cases import same_bits

from kvxfer.connector.messages import (
    EC_SERVICE,
    KV_SERVICE,
    ECDone,
    ECPin,
    ECPinned,
    ECQuery,
    ECTerms,
    ECValid,
    decode,
    decode_terms,
    encode,
)
from kvxfer.ec import ECConnectorFactory, ECLoadError
from kvxfer.session import auth, wire
from kvxfer.session.protocol import (
    Claim,
    Delivered,
    Opened,
    Reply,
    SessionClient,
    SessionServer,
)
from kvxfer.testing import POISON

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
SECRET = "correct horse battery staple"
ITEM = torch.arange(4096, dtype=torch.float32).reshape(64, 64)


@pytest.fixture
def producer():
    connector = ECConnectorFactory.create(
        "PoolECConnector", "producer", {"pool_bytes": 1 << 20, "secret": SECRET}
    )
    connector.save("item", ITEM)
    yield connector
    connector.close()


def _consumer(address: str, **config):
    # The handshake is waited for however loaded the machine (what is checked here is who gets
    # in, not how fast): a producer that is late is neither given up on nor skipped.
    config = {
        "producer_addresses": [address],
        "recv_bytes": 1 << 20,
        "query_timeout_s": 30.0,
        "retry_after_s": 0.0,
        **config,
    }
    return ECConnectorFactory.create("PoolECConnector", "consumer", config)


class RawPeer:
    """A DEALER socket on the producer's side channel, one message at a time."""

    def __init__(self, address: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def ask(self, *frames: bytes) -> list[bytes]:
        self.sock.send_multipart(list(frames))
        assert self.sock.poll(5000), "no answer"
        return self.sock.recv_multipart()

    def refused(self, *frames: bytes) -> wire.Refused:
        """Send frames that must be refused; the refusal."""
        answer = self.ask(*frames)
        assert len(answer) == 1, answer
        refusal = wire.decode(answer[0])
        assert isinstance(refusal, wire.Refused), refusal
        assert SECRET not in refusal.reason
        return refusal

    def close(self) -> None:
        self.sock.close()


def _open(peer: RawPeer, secret: str = SECRET, name: str = "raw"):
    """A full handshake through a `SessionClient`; returns (the client, the handshake frame it
    sent, the producer's terms)."""
    client = SessionClient(EC_SERVICE, secret, name, b"")
    shake = client.receive(peer.ask(*client.hello()))
    assert isinstance(shake, Reply)
    opened = client.receive(peer.ask(*shake.frames))
    assert isinstance(opened, Opened)  # the producer proved the secret too
    return client, shake.frames[0], decode_terms(opened.terms, ECTerms)


def _answer(client: SessionClient, frames: list[bytes]):
    delivered = client.receive(frames)  # checks the session and the MAC
    assert isinstance(delivered, Delivered)
    return decode(delivered.payload)


def test_a_consumer_without_the_secret_gets_nothing_and_the_producer_touches_nothing(producer):
    for config in ({}, {"secret": "wrong"}):
        with _consumer(producer.address, **config) as consumer:
            consumer.consumer.buffer.memory.fill_(POISON)
            assert consumer.has("item") is False
            with pytest.raises(ECLoadError, match="secret"):
                consumer.load("item")
            assert bool((consumer.consumer.buffer.memory == POISON).all())  # nothing was read
            assert consumer.stats_snapshot()["engines"] == 0  # no Mooncake engine was needed
    stats = producer.stats_snapshot()
    assert stats["sessions"] == 0 and stats["leases"] == 0 and stats["pinned"] == 0
    with _consumer(producer.address, secret=SECRET) as consumer:
        assert consumer.has("item") and same_bits(consumer.load("item"), ITEM)
    assert producer.stats_snapshot()["pinned"] == 0


class Impostor:
    """A producer that does not hold the secret and welcomes every consumer anyway (it skips
    its own check of the consumer's proof); its welcome's proof is made with its guess."""

    def __init__(self) -> None:
        self._sessions: SessionServer[None] = SessionServer(EC_SERVICE, "guess", 4)
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.welcomed = 0
        self._names: dict[bytes, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(20):
                continue
            identity, *frames = self._sock.recv_multipart()
            message = wire.decode(frames[0])
            if isinstance(message, wire.Hello):
                self._names[identity] = message.name
                event = self._sessions.receive(identity, frames)
                assert isinstance(event, Reply)
                self._sock.send_multipart([identity, *event.frames])
            elif isinstance(message, wire.Handshake):
                claim = Claim(
                    identity,
                    self._names[identity],
                    message.claim,
                    message.client_nonce,
                    message.server_nonce,
                )
                terms = encode(ECTerms(endpoint="127.0.0.1:1"))
                _, welcome = self._sessions.accept(claim, terms, lambda _: None)
                self.welcomed += 1
                self._sock.send_multipart([identity, *welcome])

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close()


def test_a_producer_without_the_secret_cannot_make_a_consumer_read_anything():
    impostor = Impostor()
    try:
        with _consumer(impostor.address, secret=SECRET) as consumer:
            consumer.consumer.buffer.memory.fill_(POISON)
            assert consumer.has("item") is False
            with pytest.raises(ECLoadError, match="could not prove the shared secret"):
                consumer.load("item")
            assert impostor.welcomed >= 2  # it did answer, and was not believed
            stats = consumer.stats_snapshot()
            assert stats["sessions"] == 0 and stats["engines"] == 0
            assert bool((consumer.consumer.buffer.memory == POISON).all())
    finally:
        impostor.close()


def test_forged_and_replayed_proofs_are_refused(producer):
    peer = RawPeer(producer.address)
    try:
        # a proof made without the secret
        guesser = SessionClient(EC_SERVICE, "guess", "raw", b"")
        shake = guesser.receive(peer.ask(*guesser.hello()))
        assert isinstance(shake, Reply)
        assert "secret" in peer.refused(*shake.frames).reason

        # a good handshake, replayed as it was, then after a new hello with the same nonce
        _, frame, _ = _open(peer)
        assert "no matching Hello" in peer.refused(frame).reason
        old = wire.decode(frame)
        assert isinstance(old, wire.Handshake)
        hello = wire.Hello(service=EC_SERVICE, name="raw", nonce=old.client_nonce)
        again = wire.decode(peer.ask(wire.encode(hello))[0])
        assert isinstance(again, wire.Challenge) and again.nonce != old.server_nonce
        assert "no matching Hello" in peer.refused(frame).reason

        # the claim or the name changed after the proof was made
        client = SessionClient(EC_SERVICE, SECRET, "raw", b"")
        shake = client.receive(peer.ask(*client.hello()))
        assert isinstance(shake, Reply)
        honest = wire.decode(shake.frames[0])
        assert isinstance(honest, wire.Handshake)
        tampered = wire.Handshake(
            client_nonce=honest.client_nonce,
            server_nonce=honest.server_nonce,
            claim=b"more",
            proof=honest.proof,
        )
        assert "secret" in peer.refused(wire.encode(tampered)).reason

        # a handshake from another socket cannot use this socket's hello
        thief = RawPeer(producer.address)
        client = SessionClient(EC_SERVICE, SECRET, "raw", b"")
        shake = client.receive(peer.ask(*client.hello()))
        assert isinstance(shake, Reply)
        assert "no matching Hello" in thief.refused(*shake.frames).reason
        thief.close()

        # a hello for the KV side channel: a proof for one service is worthless for the other
        kv = SessionClient(KV_SERVICE, SECRET, "raw", b"")
        assert "serves 'ec'" in peer.refused(*kv.hello()).reason
        assert producer.stats_snapshot()["sessions"] == 1
    finally:
        peer.close()


def test_session_frames_need_the_session_key_and_leases_their_session(producer):
    peer, other = RawPeer(producer.address), RawPeer(producer.address)
    try:
        client, _, terms = _open(peer)
        rival, _, _ = _open(other, name="other")
        assert terms.endpoint  # the producer's Mooncake endpoint, bound into its proof
        session = client.session.encode()
        pin = encode(ECPin(ref=1, mm_hash="item"))

        empty_key = auth.sign(auth.session_key("", "a", "b", client.session), pin)
        _, _, rival_mac = rival.seal(pin)
        for frames in (
            [session, pin, b""],  # unsigned
            [session, pin, b"\0" * auth.MAC_BYTES],  # a forged MAC
            [session, pin, empty_key],  # signed without the secret
            [session, pin, rival_mac],  # signed with another session's key
        ):
            assert "MAC" in peer.refused(*frames).reason
        assert "frames" in peer.refused(session, pin).reason  # no MAC frame at all
        unknown = peer.refused(b"f" * 32, *client.seal(encode(ECQuery(ref=2, mm_hash="x")))[1:])
        assert unknown.session_lost  # shake hands again
        assert producer.stats_snapshot()["leases"] == 0  # nothing was pinned

        pinned = _answer(client, peer.ask(*client.seal(pin)))  # the answer is signed too
        assert isinstance(pinned, ECPinned) and pinned.ok and pinned.ref == 1
        assert producer.stats_snapshot()["leases"] == 1
        with pytest.raises(wire.ProtocolError, match="another session"):
            rival.receive(peer.ask(*client.seal(encode(ECQuery(ref=3, mm_hash="item")))))

        # another session cannot end this lease
        stolen = _answer(rival, other.ask(*rival.seal(encode(ECDone(ref=4, lease=pinned.lease)))))
        assert isinstance(stolen, ECValid) and not stolen.ok and "not this session" in stolen.reason
        assert producer.stats_snapshot()["leases"] == 1
        valid = _answer(client, peer.ask(*client.seal(encode(ECDone(ref=5, lease=pinned.lease)))))
        assert isinstance(valid, ECValid) and valid.ok and valid.ref == 5
        assert producer.stats_snapshot()["leases"] == 0
        assert producer.stats_snapshot()["pinned"] == 0
    finally:
        peer.close()
        other.close()


def test_oversized_and_malformed_frames_are_refused_and_the_producer_serves_on(producer):
    peer = RawPeer(producer.address)
    try:
        huge = b"\x91" + b"\0" * (wire.MAX_FRAME_BYTES + 1)
        assert "exceeds" in peer.refused(huge).reason  # a handshake frame
        client, _, _ = _open(peer)
        big = client.seal(b"\0" * (wire.MAX_FRAME_BYTES + 1))  # signed, still too large
        assert "exceeds" in peer.refused(*big).reason
        assert "not a kvxfer" in peer.refused(*client.seal(b"\xc1")).reason  # not msgpack
        assert "frames" in peer.refused(b"a", b"b", b"c", b"d").reason
        stale = wire.Hello(service=EC_SERVICE, name="raw", nonce=auth.new_nonce(), version=1)
        assert "version" in peer.refused(wire.encode(stale)).reason
    finally:
        peer.close()
    # beyond ZeroMQ's own limit the peer is dropped, unanswered
    flood = zmq.Context.instance().socket(zmq.DEALER)
    flood.setsockopt(zmq.LINGER, 0)
    flood.connect(producer.address)
    try:
        flood.send(b"\0" * (65 << 20))
        assert not flood.poll(500)
    finally:
        flood.close()
    with _consumer(producer.address, secret=SECRET) as consumer:
        assert same_bits(consumer.load("item"), ITEM)
