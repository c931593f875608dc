"""A consumer rank reports finished requests to every producer rank in batches while other
fetches run (one `RequestsDone` per producer rank per batch, not one message per request):
within a few milliseconds, at once when the batch is full or the last fetch in flight
finished, and always before a later ask for one of them. Real producers and consumers in one
process over the local transport (the reports are the session's, not the transport's); what
the producer received is recorded in its own handler, in order."""

from __future__ import annotations

import threading

import pytest

from kvxfer.connector import KVConsumer, KVProducer, ReleaseReason
from kvxfer.connector.consumer import sessions as sessions_mod
from kvxfer.connector.messages import RequestsDone, TransferRequest
from kvxfer.testing import make_scenario, poll, side_specs

NUM_TOKENS = 64
HELD = "held-open"  # a request fetched, never published


class Rig:
    """One producer rank (TP 1) and a decode engine of two ranks (TP 2): a request is released
    once both decode ranks reported it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        src = side_specs(1, heads=4, block_size=16, num_blocks=64)
        dst = side_specs(2, heads=4, block_size=32, layout="HND", num_blocks=64)
        self.scenario = make_scenario(src, dst, NUM_TOKENS)
        self.received: list[object] = []  # the producer's session messages, in order
        self.released: list[str] = []
        self.reasons: list[ReleaseReason] = []
        real = KVProducer._on_session_message

        def recording(producer: KVProducer, session: object, message: object) -> None:
            self.received.append(message)
            real(producer, session, message)  # type: ignore[arg-type]

        monkeypatch.setattr(KVProducer, "_on_session_message", recording)
        ((spec, caches, self.src_ids),) = self.scenario.src
        self.producer = KVProducer(
            spec, caches, "prefill", release=self._released, transport="local"
        )
        self.consumers = [
            KVConsumer(s, c, "decode", transport="local") for s, c, _ in self.scenario.dst
        ]
        for consumer in self.consumers:
            consumer.connect([self.producer.address])

    def _released(self, request_id: str, reason: ReleaseReason) -> None:
        self.released.append(request_id)
        self.reasons.append(reason)

    def fetch(self, rank: int, request_id: str) -> None:
        ids = self.scenario.dst[rank][2]
        result = self.consumers[rank].fetch(request_id, ids, NUM_TOKENS).wait(30.0)
        assert result.ok, result.errors

    def hold(self, rank: int) -> None:
        """A fetch in flight on `rank` for the rest of the test (its request is never
        published): finished requests then wait in the batch."""
        self.consumers[rank].fetch(HELD, self.scenario.dst[rank][2], NUM_TOKENS, timeout=600.0)

    def reports(self) -> list[list[str]]:
        return [m.request_ids for m in self.received if isinstance(m, RequestsDone)]

    def close(self) -> None:
        for consumer in self.consumers:
            consumer.close()
        self.producer.close()


@pytest.fixture
def rig(monkeypatch):
    r = Rig(monkeypatch)
    yield r
    r.close()


def test_the_last_fetch_in_flight_reports_at_once(rig, monkeypatch):
    monkeypatch.setattr(sessions_mod, "_DONE_BATCH_S", 3600.0)  # never by time here
    rig.producer.publish("r", rig.src_ids, NUM_TOKENS)
    for rank in (0, 1):
        rig.fetch(rank, "r")
    assert poll(lambda: list(rig.released), bool, 30.0) == ["r"]
    assert sorted(rig.reports()) == [["r"], ["r"]]


def test_finished_requests_are_reported_within_moments_while_others_run(rig):
    rig.producer.publish("r", rig.src_ids, NUM_TOKENS)
    for rank in (0, 1):
        rig.hold(rank)
        rig.fetch(rank, "r")
    # Nothing else happens: the batch goes by the loops' own turns
    assert poll(lambda: list(rig.released), bool, 30.0) == ["r"]
    assert rig.reasons == [ReleaseReason.READ]
    assert sorted(rig.reports()) == [["r"], ["r"]]
    rig.scenario.assert_exact()


def test_a_full_batch_goes_at_once_in_one_message(rig, monkeypatch):
    monkeypatch.setattr(sessions_mod, "_DONE_BATCH_S", 3600.0)  # never by time here
    monkeypatch.setattr(sessions_mod, "_DONE_BATCH_MAX", 4)
    ids = [f"r{i}" for i in range(4)]
    for request_id in ids:
        rig.producer.publish(request_id, rig.src_ids, NUM_TOKENS)
    for rank in (0, 1):
        rig.hold(rank)
        handles = [
            rig.consumers[rank].fetch(rid, rig.scenario.dst[rank][2], NUM_TOKENS) for rid in ids
        ]
        assert all(h.wait(30.0).ok for h in handles)
    released = poll(lambda: sorted(rig.released), lambda r: len(r) == 4, 30.0)
    assert released == ids
    assert sorted(sorted(batch) for batch in rig.reports()) == [ids, ids]  # one per rank


def test_a_report_waiting_in_the_batch_goes_before_a_new_ask_for_its_request(rig, monkeypatch):
    """Else the producer would take the report for the new fetch's: drop its held chunks and
    give its staging ranges back while they are read."""
    batch_s = sessions_mod._DONE_BATCH_S
    monkeypatch.setattr(sessions_mod, "_DONE_BATCH_S", 3600.0)  # never by time here
    rig.producer.publish("r", rig.src_ids, NUM_TOKENS)
    rig.hold(0)
    rig.fetch(0, "r")
    rig.fetch(0, "r")  # fetched again (rank 1 has not reported: the request is still held)
    order = [
        type(m).__name__ for m in rig.received if isinstance(m, TransferRequest | RequestsDone)
    ]
    first_done = order.index("RequestsDone")  # rank 0's first report
    assert "TransferRequest" in order[:first_done] and "TransferRequest" in order[first_done:]
    monkeypatch.setattr(sessions_mod, "_DONE_BATCH_S", batch_s)
    rig.fetch(1, "r")
    assert poll(lambda: list(rig.released), bool, 30.0) == ["r"]
    rig.scenario.assert_exact()


def test_a_closing_consumer_reports_what_it_finished(rig, monkeypatch):
    monkeypatch.setattr(sessions_mod, "_DONE_BATCH_S", 3600.0)  # never by time here
    rig.producer.publish("r", rig.src_ids, NUM_TOKENS)
    for rank in (0, 1):
        rig.hold(rank)
        rig.fetch(rank, "r")
    assert rig.released == []  # both reports wait in their batches
    closed = threading.Thread(target=lambda: [c.close() for c in rig.consumers])
    closed.start()
    closed.join(30.0)
    assert poll(lambda: list(rig.released), bool, 30.0) == ["r"]
