"""A P/D request's timeline: when each step of its way happened, and the phases between them.

Times are wall-clock seconds (`time.time()`): the events of one request happen in three
processes at least (the prefill engine, its workers, the decode engine's), whose monotonic
clocks share no origin. On one host they agree; across hosts a phase that starts on one and
ends on the other (`prefill_wait`, `read_tail`, `kvxfer`) is off by the hosts' clock offset,
and one that comes out negative is counted as 0.

    event                   where                 when
    ----------------------  --------------------  ------------------------------------------
    arrived                 either engine         the request reached an engine's API server
                                                  (vLLM's `arrival_time`): the earlier of the
                                                  two, the front's request in, whether it asks
                                                  both engines at once or one after the other
    prefill_scheduled       prefill scheduler     first scheduled, its blocks allocated
    first_layer_published   producer rank         its first KV offered as computed (a whole
                                                  request: its publish)
    last_layer_published    producer rank         the whole request computed, in every layer
    decode_arrived          decode engine         the request reached the decode engine's API
                                                  server (a router may send it there late)
    load_ordered            decode scheduler      its blocks allocated, its load ordered
    fetch_asked             consumer rank         `KVConsumer.fetch` called
    first_chunk_offered     consumer rank         the first `ChunkReady` came
    first_byte_read         consumer rank         the first read started
    last_byte_read          consumer rank         the last read landed
    fetch_done              consumer rank         every chunk in the cache (ok or not)
    decode_scheduled        decode scheduler      scheduled with its KV in place
    first_token             decode scheduler      the step that scheduled it was over

Where several ranks see an event (TP ranks of one engine, cache groups, chunks), the earliest
counts for events that start something and the latest for those that end something
(`LATEST`): a request is read when its last rank has read it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

EVENTS = (
    "arrived",
    "prefill_scheduled",
    "first_layer_published",
    "last_layer_published",
    "decode_arrived",
    "load_ordered",
    "fetch_asked",
    "first_chunk_offered",
    "first_byte_read",
    "last_byte_read",
    "fetch_done",
    "decode_scheduled",
    "first_token",
)

# Events that end something: of several ranks' (or chunks'), the latest counts.
LATEST = frozenset({"last_layer_published", "last_byte_read", "fetch_done"})

# Phase -> (from event, to event); a pair of "from" events starts at the later of the two.
# `kvxfer` is kvxfer's share of a request's time (`read_tail` and `copy` its parts): from when
# the prefill's last layer is computed and the decode engine asked for it, to the KV in the
# decode engine's cache. The others are the engines' and the router's (queues, compute,
# scheduling).
_READY = ("last_layer_published", "fetch_asked")  # the KV computed and asked for
PHASES: dict[str, tuple[str | tuple[str, str], str]] = {
    "prefill_wait": ("arrived", "prefill_scheduled"),
    "prefill_first_layer": ("prefill_scheduled", "first_layer_published"),
    "prefill_layers": ("first_layer_published", "last_layer_published"),
    "decode_sent": ("arrived", "decode_arrived"),
    "decode_wait": ("decode_arrived", "load_ordered"),
    "load_to_fetch": ("load_ordered", "fetch_asked"),
    "fetch_wait": ("fetch_asked", "first_byte_read"),
    "offer_wait": ("fetch_asked", "first_chunk_offered"),
    "read_wait": ("first_chunk_offered", "first_byte_read"),
    "read": ("first_byte_read", "last_byte_read"),
    "read_tail": (_READY, "last_byte_read"),
    "copy": ("last_byte_read", "fetch_done"),
    "handoff": ("fetch_done", "decode_scheduled"),
    "decode_first_token": ("decode_scheduled", "first_token"),
    "kvxfer": (_READY, "fetch_done"),
    "total": ("arrived", "first_token"),
}


def merge(into: dict[str, float], events: Mapping[str, float]) -> dict[str, float]:
    """Add `events` to the timeline `into` (in place; returned): an event both hold keeps the
    earliest time, or the latest for the events in `LATEST`. Unknown names are dropped (a
    newer peer's events)."""
    for event, when in events.items():
        if event not in _KNOWN:
            continue
        held = into.get(event)
        if held is None:
            into[event] = float(when)
        elif event in LATEST:
            into[event] = max(held, float(when))
        else:
            into[event] = min(held, float(when))
    return into


def mark(timeline: dict[str, float], event: str, when: float | None = None) -> None:
    """Record `event` now (or at `when`), by `merge`'s rule."""
    if event not in _KNOWN:
        raise ValueError(f"unknown timeline event {event!r}; one of {', '.join(EVENTS)}")
    merge(timeline, {event: time.time() if when is None else when})


def phases(timeline: Mapping[str, float]) -> dict[str, float]:
    """Every phase whose events the timeline holds: its seconds (0 where clocks disagree
    enough to make it negative)."""
    spans = {}
    for phase, (start, end) in PHASES.items():
        starts = (start,) if isinstance(start, str) else start
        if end in timeline and all(s in timeline for s in starts):
            spans[phase] = max(0.0, timeline[end] - max(timeline[s] for s in starts))
    return spans


def describe(request_id: str, timeline: Mapping[str, float]) -> str:
    """One log line: the request, each event in ms from its first, and the phases in ms."""
    if not timeline:
        return f"request {request_id}: no timeline"
    origin = min(timeline.values())
    ordered = sorted((when, event) for event, when in timeline.items())
    events = " ".join(f"{event}=+{(when - origin) * 1e3:.1f}" for when, event in ordered)
    spans = " ".join(f"{phase}={s * 1e3:.1f}" for phase, s in phases(timeline).items())
    return f"request {request_id}: events ms [{events}] phases ms [{spans}]"


_KNOWN = frozenset(EVENTS)
