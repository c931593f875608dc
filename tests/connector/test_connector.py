"""KVProducer / KVConsumer behaviour, in one process over real Mooncake TCP on 127.0.0.1:
side-channel hygiene, handshake checks, lifecycle, staging pools, timeouts and stats."""

from __future__ import annotations

import functools
import threading
import time

import msgspec
import pytest
import zmq

from kvxfer.connector import KVConsumer, KVProducer, ReleaseReason
from kvxfer.connector.messages import KV_SERVICE, MAX_FRAME_BYTES, ChunkValid, KVClaim, encode
from kvxfer.session import auth, wire
from kvxfer.session.protocol import Opened, Reply, SessionClient
from kvxfer.testing import make_scenario, poll, side_specs, wait_until
from kvxfer.testing.scenario import ScenarioEngines

SMALL = {"staging_bytes": 4096, "staging_slots": 2}


class Engines(ScenarioEngines):
    """A 2-rank prefill engine and a 2-rank decode engine (2 -> 2, 16 -> 32 tokens a block),
    recording each prefill rank's releases and their reasons."""

    def __init__(self, num_tokens=100, producer=None, consumer=None, connect=True):
        src = side_specs(2, heads=4, block_size=16, num_blocks=40)
        dst = side_specs(2, heads=4, block_size=32, layout="HND", num_blocks=40)
        self.num_tokens = num_tokens
        self.released: list[tuple[int, str]] = []
        self.reasons: dict[tuple[int, str], ReleaseReason] = {}
        scenario = make_scenario(src, dst, num_tokens)
        super().__init__(scenario, {**SMALL, **(producer or {})}, {**SMALL, **(consumer or {})})
        if connect:
            self.connect()

    def producer_options(self, spec):
        return {"release": functools.partial(self._released, spec.tp_rank), **self._producer}

    def _released(self, rank, request_id, reason):
        self.released.append((rank, request_id))
        self.reasons[rank, request_id] = reason

    def fetch(self, request_id, ranks=(0, 1), timeout=10.0):
        """Fetch on the decode ranks `ranks` and wait: their results."""
        handles = [
            self.consumers[r].fetch(
                request_id, self.scenario.dst[r][2], self.num_tokens, timeout=timeout
            )
            for r in ranks
        ]
        return [h.wait() for h in handles]


@pytest.fixture
def engines():
    e = Engines()
    yield e
    e.close()


def raw_socket(address):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def ask(sock, frames, timeout=5.0):
    """Send `frames`; the producer's answer, as its frames."""
    sock.send_multipart(frames)
    assert sock.poll(int(timeout * 1000)), "no reply"
    return sock.recv_multipart()


def refused(frames):
    """The reason of a refusal (fails on anything else)."""
    assert len(frames) == 1, frames
    reply = wire.decode(frames[0])
    assert isinstance(reply, wire.Refused), reply
    return reply.reason


def open_raw_session(sock, spec, secret=""):
    """A real session opened by hand on a raw socket, as a consumer's would be."""
    client = SessionClient(KV_SERVICE, secret, "evil", encode(KVClaim(engine_id="evil", spec=spec)))
    event = client.receive(ask(sock, client.hello()))
    assert isinstance(event, Reply)
    assert isinstance(client.receive(ask(sock, event.frames)), Opened)
    return client


def test_garbage_on_the_side_channel_gets_errors_and_service_goes_on(engines):
    sock = raw_socket(engines.producers[0].address)
    future = wire.PROTOCOL_VERSION + 1
    hello_future = msgspec.msgpack.encode({"type": "hello", "version": future, "name": "x"})
    client = open_raw_session(sock, engines.scenario.dst[0][0])
    stray = client.seal(encode(ChunkValid(request_id="r", chunk_id=0, ok=True)))
    forged_mac = [*stray[:2], bytes(16)]
    unknown = [b"forged", *stray[1:]]
    cases = [
        ([b"\x00\xffnot msgpack"], "not a kvxfer handshake message"),
        ([b"x" * (MAX_FRAME_BYTES + 1)], "exceeds"),
        ([hello_future], f"protocol version {future} is not supported"),
        ([encode(ChunkValid(request_id="r", chunk_id=0, ok=True))], "not a kvxfer handshake"),
        (stray, "does not accept ChunkValid"),
        ([stray[0], b"\x00\xff", client.seal(b"\x00\xff")[2]], "not a kvxfer message"),
        (forged_mac, "without a valid MAC"),
        (unknown, "unknown session"),
        ([b"a", b"b"], "got 2 frames"),
    ]
    for frames, reason in cases:
        assert reason in refused(ask(sock, frames))
    sock.close()
    engines.publish("after-garbage")
    results = engines.fetch("after-garbage")
    assert all(r.ok for r in results)
    engines.scenario.assert_exact()


def test_shared_secret_is_required_when_set():
    e = Engines(producer={"secret": "s3cret"}, consumer={"secret": "wrong"}, connect=False)
    try:
        with pytest.raises(ConnectionError, match="wrong or missing shared secret"):
            e.consumers[0].connect(e.addresses)
        good = KVConsumer(*e.scenario.dst[0][:2], "decode", secret="s3cret", **SMALL)
        assert len(good.connect(e.addresses)) >= 1
        good.close()
    finally:
        e.close()


def test_a_handshake_must_answer_this_producers_challenge(engines):
    spec = engines.scenario.dst[0][0]
    claim = encode(KVClaim(engine_id="evil", spec=spec))
    sock = raw_socket(engines.producers[0].address)
    unasked = wire.Handshake(client_nonce="00", server_nonce="11", claim=claim, proof="")
    assert "no matching Hello" in refused(ask(sock, [wire.encode(unasked)]))
    hello = wire.Hello(service=KV_SERVICE, name="evil", nonce="22")
    (reply,) = ask(sock, [wire.encode(hello)])
    challenge = wire.decode(reply)
    assert isinstance(challenge, wire.Challenge)
    forged = wire.Handshake(  # a proof made for other nonces (a replay) does not pass
        client_nonce="22",
        server_nonce=challenge.nonce,
        claim=claim,
        proof=auth.proof("", "consumer", KV_SERVICE, "22", "00", "evil", claim),
    )
    assert "shared secret" in refused(ask(sock, [wire.encode(forged)]))
    sock.close()


def test_a_consumer_with_a_secret_refuses_a_producer_without_it():
    e = Engines(consumer={"secret": "s3cret"}, connect=False)
    try:
        with pytest.raises(ConnectionError, match="shared secret"):
            e.consumers[0].connect(e.addresses)
    finally:
        e.close()


def test_a_consumer_of_another_model_is_refused_at_handshake(engines):
    (spec,) = side_specs(1, heads=4, head_dim=16, num_blocks=8)
    other = KVConsumer(spec, [np_empty(spec) for _ in range(spec.num_layers)], "decode")
    with pytest.raises(ConnectionError, match="head_dim differs"):
        other.connect(engines.addresses)
    other.close()


@pytest.mark.parametrize("consumer_away", [True, False], ids=["consumer-not-run", "consumer-ran"])
def test_a_handshake_deadline_counts_only_while_the_consumer_ran(consumer_away):
    """A handshake whose deadline passed while the consumer's own loop was not run (a loaded
    host that ran neither side) still waits for the producer's answer; one whose consumer ran
    all along and heard nothing has failed."""
    from kvxfer.connector.consumer.sessions import SessionState

    (spec,) = side_specs(1, heads=4, head_dim=16, num_blocks=8)
    silent = zmq.Context.instance().socket(zmq.ROUTER)  # accepts, never answers
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    consumer = KVConsumer(spec, [np_empty(spec) for _ in range(spec.num_layers)], "decode")
    outcome: list[BaseException] = []

    def connect() -> None:
        try:
            consumer.connect([f"tcp://127.0.0.1:{port}"], timeout=60.0)
        except BaseException as exc:
            outcome.append(exc)

    connecting = threading.Thread(target=connect)
    connecting.start()
    try:
        sessions = consumer._sessions
        assert poll(lambda: list(sessions._open.values()), bool, timeout=60.0)
        states: list[SessionState] = []
        done = threading.Event()

        def gap_then_tick() -> None:
            now = time.monotonic()
            for session in sessions._open.values():
                session.deadline = session.held_deadline = now - 1.0  # both passed
            consumer._gaps.ticked = now - 10.0 if consumer_away else now
            consumer._tick()
            states.extend(s.state for s in [*sessions._open.values(), *sessions.by_rank.values()])
            done.set()

        consumer._loop.post(gap_then_tick)
        assert done.wait(60), "the consumer's loop ran no posted work"
        if consumer_away:
            assert states == [SessionState.CONNECTING]
        else:
            connecting.join(60)
            assert outcome and "did not answer the handshake in time" in str(outcome[0])
    finally:
        consumer.close()
        connecting.join(60)
        silent.close()


def test_a_producer_that_accepted_is_waited_for_until_its_held_timeout():
    """A first handshake whose producer's host accepted the connection (its process exists and
    is not run yet: a loaded or frozen host) fails at `held_timeout`, not at `timeout`; an
    address where nothing listens fails at once, whatever `held_timeout`."""
    (spec,) = side_specs(1, heads=4, head_dim=16, num_blocks=8)
    silent = zmq.Context.instance().socket(zmq.ROUTER)  # accepts, never answers
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    consumer = KVConsumer(spec, [np_empty(spec) for _ in range(spec.num_layers)], "decode")
    try:
        began = time.monotonic()
        with pytest.raises(ConnectionError, match="did not answer the handshake in time"):
            consumer.connect([f"tcp://127.0.0.1:{port}"], timeout=0.2, held_timeout=1.5)
        assert time.monotonic() - began >= 1.5
        began = time.monotonic()
        with pytest.raises(ConnectionError, match="refused the connection: nothing listens"):
            consumer.connect(["tcp://127.0.0.1:9"], timeout=0.2, held_timeout=600.0)
        assert time.monotonic() - began < 300.0  # at once: far from its held_timeout
    finally:
        consumer.close()
        silent.close()


def np_empty(spec):
    from kvxfer import allocate_kv_caches

    return allocate_kv_caches(spec)[0]


def test_fetch_waits_for_a_late_publish(engines):
    handles = [
        engines.consumers[r].fetch("late", engines.scenario.dst[r][2], 100, timeout=10)
        for r in (0, 1)
    ]
    time.sleep(0.3)
    assert not any(h.done() for h in handles)
    engines.publish("late")
    assert all(h.wait().ok for h in handles)
    engines.scenario.assert_exact()


def test_fetch_of_a_request_never_published_times_out_with_every_block(engines):
    began = time.monotonic()
    (result,) = engines.fetch("never", ranks=(0,), timeout=0.5)
    assert time.monotonic() - began < 5
    assert not result.ok
    assert result.failed_block_ids == sorted(engines.scenario.dst[0][2].tolist())
    assert result.errors
    engines.scenario.assert_untouched()


def test_release_happens_once_after_every_decode_rank_is_done(engines):
    engines.publish("r1")
    engines.fetch("r1", ranks=(0,))
    time.sleep(0.2)
    assert engines.released == []  # rank 1 of the decode engine has not reported yet
    engines.fetch("r1", ranks=(1,))
    wait_until(lambda: len(engines.released) >= 2, 30.0, "both producers' releases")
    time.sleep(0.2)  # a second release of either would come within this
    assert sorted(engines.released) == [(0, "r1"), (1, "r1")]
    assert set(engines.reasons.values()) == {ReleaseReason.READ}
    assert all(p.pending_requests == [] for p in engines.producers)
    assert [p.expired_requests for p in engines.producers] == [0, 0]


def test_release_at_the_deadline_and_late_fetches_fail(engines):
    engines.publish("short", deadline_s=0.2)
    # the expiry sweep runs on the side-channel thread
    wait_until(lambda: len(engines.released) >= 2, 30.0, "both producers' releases")
    assert sorted(engines.released) == [(0, "short"), (1, "short")]
    assert set(engines.reasons.values()) == {ReleaseReason.EXPIRED}
    assert [p.expired_requests for p in engines.producers] == [1, 1]
    (result,) = engines.fetch("short", ranks=(0,), timeout=2)
    assert not result.ok and any("already released" in e for e in result.errors)
    assert sorted(engines.released) == [(0, "short"), (1, "short")]  # still once
    assert [p.stats_snapshot()["expired_requests"] for p in engines.producers] == [1, 1]


def test_pools_are_whole_again_after_many_requests(engines):
    for i in range(12):
        engines.publish(f"many-{i}")
        results = engines.fetch(f"many-{i}")
        assert all(r.ok for r in results), [r.errors for r in results]
    engines.scenario.assert_exact()
    time.sleep(0.2)
    for consumer in engines.consumers:
        assert set(consumer.staging_free_slots().values()) == {SMALL["staging_slots"]}
    for producer in engines.producers:
        assert set(producer.staging_free_slots().values()) <= {SMALL["staging_slots"]}
    stats = engines.consumers[0].stats.summary()
    assert stats["count"] == 12 and stats["failures"] == 0
    assert stats["p90_ms"] >= stats["p50_ms"] > 0 and stats["mb_per_s"] > 0


def test_a_full_pool_means_waiting_not_failing():
    # One slot shared by four concurrent fetches on one rank: they queue for it.
    e = Engines(consumer={"staging_slots": 1, "staging_bytes": 2048, "strategy": "pack+unpack"})
    try:
        for i in range(4):
            e.publish(f"q{i}")
        handles = [
            e.consumers[0].fetch(f"q{i}", e.scenario.dst[0][2], 100, timeout=20) for i in range(4)
        ]
        assert all(h.wait().ok for h in handles)
    finally:
        e.close()


def test_stats_export_to_prometheus(engines):
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    engines.consumers[0].stats.enable_prometheus(registry)
    engines.publish("p")
    engines.fetch("p")
    assert registry.get_sample_value("kvxfer_transfers_total", {"outcome": "ok"}) == 1
    assert registry.get_sample_value("kvxfer_transfer_bytes_total") > 0
    assert registry.get_sample_value("kvxfer_transfer_seconds_count") == 1


def test_bad_fetch_arguments_raise_before_anything_moves(engines):
    with pytest.raises(ValueError, match="too few block ids"):
        engines.consumers[0].fetch("x", [0], 100)
    with pytest.raises(ValueError, match="start_token"):
        engines.consumers[0].fetch("x", engines.scenario.dst[0][2], 100, start_token=101)
    with pytest.raises(ValueError, match="already published"):
        engines.publish("dup")
        engines.publish("dup")


def test_consumers_that_are_not_connected_refuse_to_fetch():
    e = Engines(connect=False)
    try:
        with pytest.raises(ValueError, match="connect"):
            e.consumers[0].fetch("x", e.scenario.dst[0][2], 100)
        with pytest.raises(ConnectionError, match="refused the connection: nothing listens"):
            e.consumers[0].connect(["tcp://127.0.0.1:9"], timeout=0.3)
    finally:
        e.close()


def test_replan_switches_strategies_without_a_new_handshake():
    roomy = {"staging_bytes": 1 << 16}  # mirrors of 32-token blocks need whole blocks
    e = Engines(producer=roomy, consumer=roomy)
    try:
        for i, strategy in enumerate(["direct", "pack", "unpack", "pack+unpack"]):
            for consumer in e.consumers:
                assert {p.strategy for p in consumer.replan(strategy)} == {strategy}
            e.publish(f"re-{i}")
            results = e.fetch(f"re-{i}")
            assert all(r.ok and r.strategy == strategy for r in results)
        e.scenario.assert_exact()
        with pytest.raises(ValueError, match="unknown strategy"):
            e.consumers[0].replan("teleport")
    finally:
        e.close()


def test_a_shared_transport_stays_open_when_a_connector_closes(engines):
    from kvxfer.transport import MooncakeTransport

    shared = MooncakeTransport()
    try:
        spec, caches, _ = engines.scenario.dst[0]
        other = np_empty(spec)
        kept = shared.register(other)
        consumer = KVConsumer(spec, caches, "decode", transport=shared, **SMALL)
        assert len(shared.regions) == 1  # a consumer registers no cache: reads land in staging
        plans = consumer.connect(engines.addresses)
        assert len(shared.regions) == 1 + len(plans)  # a staging pool per producer it reads
        # A shared transport runs its own completion thread (the loop drives only its own):
        # rank 0's share moves through it, rank 1's through a consumer's own transport
        assert not shared.driven and engines.consumers[1].transport.driven
        engines.publish("shared")
        handle = consumer.fetch("shared", engines.scenario.dst[0][2], engines.num_tokens)
        (other,) = engines.fetch("shared", ranks=(1,))
        result = handle.wait(20.0)
        assert result.ok and other.ok, (result.errors, other.errors)
        engines.scenario.assert_exact()
        consumer.close()
        assert list(shared.regions) == [kept.region_id]  # only the consumer's pools went
    finally:
        shared.close()


def test_an_abort_before_the_publish_releases_the_request_at_its_publish(engines):
    engines.consumers[0].abort("early")  # decode gave up after prefill, before the publish
    time.sleep(0.3)
    assert engines.released == []
    engines.publish("early")
    assert sorted(engines.released) == [(0, "early"), (1, "early")]
    assert set(engines.reasons.values()) == {ReleaseReason.ABORTED}
    assert all(p.pending_requests == [] for p in engines.producers)


def test_a_failed_prefill_and_a_close_release_with_their_reasons(engines):
    for p, (_, _, ids) in zip(engines.producers, engines.scenario.src, strict=True):
        p.publish("failing", ids, engines.num_tokens, ready_tokens=0)
        p.publish("pending", ids, engines.num_tokens)
        p.fail("failing")
    wait_until(lambda: len(engines.released) == 2, 60.0, "both producers' failed releases")
    for p in engines.producers:
        p.close()
    assert engines.reasons == {
        (0, "failing"): ReleaseReason.FAILED,
        (1, "failing"): ReleaseReason.FAILED,
        (0, "pending"): ReleaseReason.CLOSED,
        (1, "pending"): ReleaseReason.CLOSED,
    }


def test_a_producer_restarted_at_the_same_address_serves_the_next_fetch_at_once():
    # A slow heartbeat: the restart must be found by the new producer's answer alone.
    e = Engines(consumer={"heartbeat_s": 5.0, "peer_timeout_s": 30.0})
    try:
        ports = [int(a.rsplit(":", 1)[1]) for a in e.addresses]
        for p in e.producers:
            p.close()
        # Back within a heartbeat: the consumers still hold sessions the new producers forgot.
        e.producers = [
            KVProducer(s, c, "prefill", port=port, **SMALL)
            for (s, c, _), port in zip(e.scenario.src, ports, strict=True)
        ]
        e.publish("after-restart")
        results = e.fetch("after-restart")
        assert all(r.ok for r in results), [r.errors for r in results]
        e.scenario.assert_exact()
    finally:
        e.close()


def test_bad_connector_input_gets_a_clear_error_and_leaves_nothing_half_open():
    e = Engines(connect=False)
    try:
        producer, consumer = e.producers[0], e.consumers[0]
        ids = e.scenario.src[0][2]
        with pytest.raises(ValueError, match="num_tokens"):
            producer.publish("zero", ids, 0)
        with pytest.raises(ValueError, match="request_id"):
            producer.publish(42, ids, 10)
        port = e.addresses[0].rsplit(":", 1)[1]
        with pytest.raises(ValueError, match=f"tcp://127.0.0.1:{port}"):
            consumer.connect([f"127.0.0.1:{port}"])  # the scheme is missing: the fix is named
        assert consumer.staging_free_slots() == {}  # nothing registered by the refusal
        assert len(consumer.connect(e.addresses)) >= 1  # and a good connect works after it
        assert consumer.stats_snapshot()["transport"] == "tcp"
        assert producer.stats_snapshot()["transport"] == "tcp"
        producer.close()
        with pytest.raises(RuntimeError, match="closed"):
            producer.publish("late", ids, 10)
        consumer.close()
        with pytest.raises(RuntimeError, match="closed"):
            consumer.fetch("late", e.scenario.dst[0][2], 10)
    finally:
        e.close()
