"""A producer's holds on packed chunks, asked by hand on a real session (a raw ZeroMQ socket,
a real `KVProducer`): a chunk read from staging is confirmed by the hold its `ChunkReady`
promises (timed by the consumer from before its ask), so the producer must keep the range
untouched that long unless the consumer gives it back; a chunk read from the cache is still
confirmed by a round trip, which a failed prefill answers "no"."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
import zmq
from helpers import first_tokens_ask

from kvxfer.connector import KVProducer
from kvxfer.connector import streams as streams_mod
from kvxfer.connector.messages import (
    KV_SERVICE,
    ChunkFailed,
    ChunkRead,
    ChunkReady,
    ChunkValid,
    KVClaim,
    Message,
    Ping,
    Pong,
    RequestsDone,
    StagingRead,
    decode,
    encode,
)
from kvxfer.connector.producer import packing as producer_mod
from kvxfer.connector.producer.states import ServedState
from kvxfer.plan import DEFAULT_STAGING_SLOTS
from kvxfer.session.protocol import Delivered, Opened, Reply, SessionClient
from kvxfer.spec import allocate_kv_caches
from kvxfer.testing import poll
from kvxfer.testing.geometry import Geometry

SRC = Geometry(tp=1, heads=2, block_size=16, layout="NHD", layers=2, head_dim=64, num_blocks=16)
DST = Geometry(tp=1, heads=2, block_size=32, layout="HND", layers=2, head_dim=64, num_blocks=16)


class HandSession:
    """A consumer rank's session, opened and driven by hand."""

    def __init__(self, address: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        claim = encode(KVClaim(engine_id="decode", spec=DST.spec(0)))
        self.client = SessionClient(KV_SERVICE, "", "decode", claim)
        event = self.client.receive(self._ask(self.client.hello()))
        assert isinstance(event, Reply)
        assert isinstance(self.client.receive(self._ask(event.frames)), Opened)

    def send(self, message: Message) -> None:
        self.sock.send_multipart(self.client.seal(encode(message)))

    def receive(self, timeout: float = 20.0) -> Message:
        assert self.sock.poll(int(timeout * 1000)), "no answer from the producer"
        event = self.client.receive(self.sock.recv_multipart())
        assert isinstance(event, Delivered), event
        return decode(event.payload)

    def settled(self) -> None:
        """Return once the producer handled everything sent before (one thread, in order)."""
        self.send(Ping())
        assert isinstance(self.receive(), Pong)

    def transfer(self, request_id: str, chunk_id: int, strategy: str, wait: float) -> Message:
        self.ask(request_id, chunk_id, strategy, wait)
        return self.receive()

    def ask(self, request_id: str, chunk_id: int, strategy: str, wait: float) -> None:
        self.send(
            first_tokens_ask(
                request_id, chunk_id, layers=SRC.layers, strategy=strategy, wait_seconds=wait
            )
        )

    def _ask(self, frames: list[bytes]) -> list[bytes]:
        self.sock.send_multipart(frames)
        assert self.sock.poll(20_000), "no handshake answer"
        return self.sock.recv_multipart()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def producer():
    spec = SRC.spec(0)
    producer = KVProducer(spec, allocate_kv_caches(spec), "prefill", session_timeout_s=0.5)
    yield producer
    producer.close()


def _zero(value: object) -> bool:
    return value == 0


def _leases(producer: KVProducer) -> int:
    leases = producer.stats_snapshot()["leases"]
    assert isinstance(leases, int)
    return leases


def _offered(producer: KVProducer, wait: float) -> tuple[HandSession, float, ChunkReady]:
    """A consumer session that asked for chunk 1 of a published request "r", packed: the
    session, when it asked, the producer's answer."""
    producer.publish("r", np.array([3, 5]), 32)
    consumer = HandSession(producer.address)
    asked = time.monotonic()
    ready = consumer.transfer("r", 1, "pack+unpack", wait=wait)
    assert isinstance(ready, ChunkReady) and ready.staging is not None
    return consumer, asked, ready


def test_a_packed_chunk_is_held_until_its_consumer_gives_it_back(producer):
    consumer, asked, ready = _offered(producer, wait=5.0)
    try:
        # The fetch's remaining time and a second more, from the ask's arrival
        assert 6.0 <= ready.held_seconds <= 6.0 + (time.monotonic() - asked)
        consumer.settled()
        assert _leases(producer) == 1
        consumer.send(StagingRead("r", 1))
        consumer.settled()
        assert _leases(producer) == 0

        again = consumer.transfer("r", 2, "pack+unpack", wait=5.0)
        assert isinstance(again, ChunkReady) and again.staging is not None
        consumer.send(RequestsDone(request_ids=["r"]))  # the last chunk's range goes too
        consumer.settled()
        assert _leases(producer) == 0
    finally:
        consumer.close()


def test_a_chunk_read_from_the_cache_is_confirmed_until_the_prefill_fails(producer):
    producer.publish("r", np.array([3, 5]), 32, ready_tokens=32)
    consumer = HandSession(producer.address)
    try:
        ready = consumer.transfer("r", 1, "unpack", wait=5.0)
        assert isinstance(ready, ChunkReady) and ready.staging is None
        assert ready.src_block_ids == [3, 5] and ready.held_seconds == 0.0
        assert _leases(producer) == 0  # no staging held
        consumer.send(ChunkRead("r", 1, ready.generation))
        assert consumer.receive() == ChunkValid(request_id="r", chunk_id=1, ok=True)
        producer.fail("r")  # the engine may give the blocks away at once
        consumer.send(ChunkRead("r", 1, ready.generation))
        valid = consumer.receive()
        assert isinstance(valid, ChunkValid) and not valid.ok
        assert "released before the read was confirmed" in valid.reason
    finally:
        consumer.close()


def test_an_ended_session_keeps_its_pool_out_of_use_until_its_holds_end(producer):
    """A consumer that went silent may be frozen mid-read, not dead: the producer ends its
    session, but reuses its pool (for another consumer's packs) only once every range it had
    leased to it is past its hold, on the consumer's clock too."""
    consumer, asked, ready = _offered(producer, wait=1.0)
    try:
        held_until = asked + ready.held_seconds
        # Silent from now on: the session ends after half a second
        assert poll(lambda: producer.stats_snapshot()["sessions"], _zero, 30.0) == 0
        spares = poll(lambda: producer.stats_snapshot()["spare_pools"], bool, 30.0)
        assert spares == 1, "the ended session's pool never came back"
        assert time.monotonic() >= held_until, "the pool was reused while a hold ran"
    finally:
        consumer.close()


def test_a_pack_the_prefill_failed_during_is_never_offered(monkeypatch):
    """The consumer would trust a packed chunk without asking again, so a pack that ran while
    the engine may have taken its blocks back (`fail` returned) is refused, not offered."""
    inside, go = threading.Event(), threading.Event()
    real = producer_mod.run_cell_copy

    def slow_pack(copy, src, dst, backend):
        inside.set()
        assert go.wait(20.0)
        real(copy, src, dst, backend)

    monkeypatch.setattr(streams_mod, "INLINE_COPY_BYTES", 0)  # on the worker: the test waits
    monkeypatch.setattr(producer_mod, "run_cell_copy", slow_pack)
    spec = SRC.spec(0)
    producer = KVProducer(spec, allocate_kv_caches(spec), "prefill")
    consumer = HandSession(producer.address)
    try:
        producer.publish("r", np.array([3, 5]), 32, ready_tokens=32)
        consumer.ask("r", 1, "pack+unpack", wait=5.0)
        assert inside.wait(20.0), "the pack never started"
        producer.fail("r")  # the engine may now write those blocks for another request
        go.set()
        answer = consumer.receive()
        assert isinstance(answer, ChunkFailed), answer
        assert answer.reason == "the request was released while its chunk was packed"
        consumer.settled()
        assert _leases(producer) == 0
        assert set(producer.staging_free_slots().values()) == {DEFAULT_STAGING_SLOTS}
    finally:
        consumer.close()
        producer.close()


def _tick_after_a_gap(
    producer: KVProducer,
    gap: float,
    producer_away: bool,
    backdate: Callable[[float], None],
    then: Callable[[], int] = lambda: 0,
) -> int:
    """On the producer's side-channel thread: `backdate(now)` moves what it times `gap`
    seconds back (when its consumers were last heard, a deadline), the previous tick is `gap`
    seconds ago too (`producer_away`: its thread was not run meanwhile) or just now (it ran);
    then one tick, and `then()` right after it, on the same thread: its value."""
    done = threading.Event()
    after: list[int] = []

    def gap_then_tick() -> None:
        now = time.monotonic()
        backdate(now)
        producer._gaps.ticked = now - gap if producer_away else now
        producer._on_tick()
        after.append(then())
        done.set()

    producer._server.post(gap_then_tick)
    assert done.wait(60), "the side channel ran no posted work"
    return after[0]


def _silence_after_a_gap(producer: KVProducer, gap: float, producer_away: bool) -> int:
    """`_tick_after_a_gap` with its consumer sessions last heard `gap` seconds ago: the open
    sessions right after the tick."""

    def silent(now: float) -> None:
        for link in producer._sessions.open_sessions():
            link.last_heard = now - gap

    def open_sessions() -> int:
        return len(list(producer._sessions.open_sessions()))

    return _tick_after_a_gap(producer, gap, producer_away, silent, open_sessions)


@pytest.mark.parametrize("producer_away", [True, False], ids=["producer-not-run", "producer-ran"])
def test_silence_counts_only_while_the_producer_listened(producer_away):
    """A consumer silent for twice `session_timeout_s` keeps its session when the producer's
    own thread was not run for that long either (its pings may wait unread in the socket: a
    loaded host that runs neither), and loses it when the producer ran and heard nothing."""
    spec = SRC.spec(0)
    producer = KVProducer(spec, allocate_kv_caches(spec), "prefill", session_timeout_s=5.0)
    consumer = HandSession(producer.address)
    try:
        assert _silence_after_a_gap(producer, 10.0, producer_away) == int(producer_away)
    finally:
        consumer.close()
        producer.close()


@pytest.mark.parametrize("producer_away", [True, False], ids=["producer-not-run", "producer-ran"])
def test_a_deadline_counts_only_while_the_producer_could_serve(producer_away):
    """A request published with a 5 s deadline whose 10 s passed while the producer's own
    thread was not run (a loaded host; its decode engine still fetching) is kept; one whose
    producer ran all along is released at its deadline."""
    spec = SRC.spec(0)
    producer = KVProducer(spec, allocate_kv_caches(spec), "prefill")
    try:
        producer.publish("r", np.array([3, 5]), 32, deadline_s=5.0)

        def published_10_s_ago(now: float) -> None:
            for request in producer._requests._live.values():
                request.deadline = now - 5.0  # published 10 s ago, with 5 s

        _tick_after_a_gap(producer, 10.0, producer_away, published_10_s_ago)
        assert producer.expired_requests == int(not producer_away)
    finally:
        producer.close()


@pytest.mark.parametrize("producer_away", [True, False], ids=["producer-not-run", "producer-ran"])
def test_a_chunk_waits_for_its_publish_only_while_the_producer_could_serve(producer_away):
    """A chunk asked with 5 s to wait for its request's publish, whose 10 s passed while the
    producer's own thread was not run, still waits and is served at the publish; one whose
    producer ran all along is answered that the request was not published in time."""
    spec = SRC.spec(0)
    producer = KVProducer(spec, allocate_kv_caches(spec), "prefill")
    consumer = HandSession(producer.address)
    try:
        consumer.ask("r", 0, "direct", wait=5.0)
        consumer.settled()

        def asked_10_s_ago(now: float) -> None:
            for link in producer._sessions.open_sessions():
                for chunk in link.state.in_state(ServedState.WAITING):
                    chunk.deadline = now - 5.0  # asked 10 s ago, with 5 s

        _tick_after_a_gap(producer, 10.0, producer_away, asked_10_s_ago)
        producer.publish("r", np.array([3, 5]), 32)
        answer = consumer.receive()
        if producer_away:
            assert isinstance(answer, ChunkReady), answer
        else:
            assert isinstance(answer, ChunkFailed), answer
            assert "not published within 5.0 s" in answer.reason
    finally:
        consumer.close()
        producer.close()


def test_a_chunk_asked_again_gives_its_first_range_back():
    """A consumer that asks for a chunk it was offered already (its newest ask stands) frees
    the first offer's range: reading the second one leaves the whole pool free."""
    spec = SRC.spec(0)
    producer = KVProducer(spec, allocate_kv_caches(spec), "prefill")
    consumer, _, _ = _offered(producer, wait=5.0)
    try:
        again = consumer.transfer("r", 1, "pack+unpack", wait=5.0)
        assert isinstance(again, ChunkReady) and again.staging is not None
        consumer.settled()
        assert _leases(producer) == 1
        consumer.send(StagingRead("r", 1))
        consumer.settled()
        assert _leases(producer) == 0
        assert list(producer.staging_free_slots().values()) == [DEFAULT_STAGING_SLOTS]
    finally:
        consumer.close()
        producer.close()
