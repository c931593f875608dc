"""A request's timeline (issue 38, item 2): the producer's events travel with its chunks, the
consumer adds its own, and a fetch's result holds them all, in the order they happened.

The transfer runs between real processes over Mooncake TCP on 127.0.0.1
(`kvxfer.testing.Rig`); the prefill computes layer by layer while the decode rank reads, as the
streamed flow does.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvxfer.connector.timeline import EVENTS, PHASES, describe, mark, merge, phases
from kvxfer.testing import BlockPool, Request, Rig
from kvxfer.testing.geometry import Geometry

LAYERS = 4
PREFILL = Geometry(head_dim=32, block_size=16, num_blocks=128, layers=LAYERS)
DECODE = Geometry(head_dim=32, block_size=32, layout="HND", num_blocks=64, layers=LAYERS)
TOKENS = 256
WAIT_S = 60.0


def test_merge_keeps_the_first_start_and_the_last_end():
    timeline = {"fetch_asked": 5.0, "last_byte_read": 7.0}
    merge(timeline, {"fetch_asked": 4.0, "last_byte_read": 6.0, "first_byte_read": 5.5})
    merge(timeline, {"fetch_asked": 4.5, "last_byte_read": 8.0, "someday_event": 1.0})
    assert timeline == {"fetch_asked": 4.0, "first_byte_read": 5.5, "last_byte_read": 8.0}


def test_phases_span_the_events_the_timeline_holds_and_never_go_negative():
    timeline = {"arrived": 10.0, "prefill_scheduled": 9.9, "first_token": 10.5}
    got = phases(timeline)
    assert got == {"prefill_wait": 0.0, "total": 0.5}  # a clock 0.1 s behind: 0, not -0.1
    assert set(phases(dict.fromkeys(EVENTS, 1.0))) == set(PHASES)


def test_kvxfers_share_starts_once_the_kv_is_both_computed_and_asked_for():
    asked_late = {"last_layer_published": 1.0, "fetch_asked": 1.5, "fetch_done": 1.75}
    computed_late = {"last_layer_published": 1.5, "fetch_asked": 1.0, "fetch_done": 1.75}
    assert phases(asked_late)["kvxfer"] == phases(computed_late)["kvxfer"] == 0.25


def test_describe_lists_events_in_order_and_the_phases():
    line = describe("r1", {"fetch_asked": 1.0, "arrived": 0.5, "fetch_done": 1.25})
    assert line.startswith("request r1: events ms [arrived=+0.0 fetch_asked=+500.0")
    assert "fetch_done=+750.0" in line


def test_an_unknown_event_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown timeline event 'publishd'"):
        mark({}, "publishd")


@pytest.fixture
def rig() -> Iterator[Rig]:
    with Rig() as r:
        yield r


def test_a_streamed_fetch_reports_the_prefills_events_and_its_own_in_order(rig):
    producer = rig.producer(PREFILL)
    consumer = rig.consumer(DECODE, options={"chunk_tokens": 32, "strategy": "pack+unpack"})
    consumer.connect([producer.address])
    src = BlockPool(PREFILL.num_blocks, 1).take(PREFILL.blocks_for(TOKENS))
    dst = BlockPool(DECODE.num_blocks, 2).take(DECODE.blocks_for(TOKENS)).tolist()
    request = Request("timed", TOKENS, seed=5)
    scheduled = time.time()
    consumer.fetch(request, dst, timeout=WAIT_S, streamed=True)
    producer.publish_computing(request, src, timeline={"prefill_scheduled": scheduled})
    for layer in range(LAYERS):
        producer.compute(request, src, TOKENS, (layer, layer + 1))
    result = consumer.result(request.request_id, timeout=WAIT_S)
    assert result["ok"], result["errors"][:3]
    timeline = result["timeline"]
    ordered = [
        "prefill_scheduled",
        "first_layer_published",
        "last_layer_published",
        "last_byte_read",
        "fetch_done",
    ]
    assert [timeline[e] for e in ordered] == sorted(timeline[e] for e in ordered), timeline
    assert timeline["prefill_scheduled"] == scheduled  # the engine's event, as it gave it
    assert timeline["fetch_asked"] <= timeline["first_byte_read"] <= timeline["last_byte_read"]
    assert timeline["first_byte_read"] >= timeline["first_layer_published"]
    assert set(phases(timeline)) >= {"read", "read_tail", "copy", "kvxfer"}
