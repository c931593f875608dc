"""Checks of the fault harness: waiting for progress, results, leaks, late bytes, and hostile
frames."""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import msgspec
import zmq

from kvxfer.plan import DEFAULT_STAGING_SLOTS
from kvxfer.session import wire
from kvxfer.testing.geometry import Request
from kvxfer.testing.memory import BlockIds
from kvxfer.testing.rig import Consumer, Producer

T = TypeVar("T")


def poll(
    probe: Callable[[], T], done: Callable[[T], bool], timeout: float, every: float = 0.05
) -> T:
    """Call `probe` until `done(value)` or `timeout` seconds passed; returns the last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if done(value) or time.monotonic() >= deadline:
            return value
        time.sleep(every)


def wait_until(
    done: Callable[[], bool], timeout: float, what: str = "the condition", every: float = 0.01
) -> float:
    """Wait until `done()` holds (a state to reach, polled every `every` seconds); the seconds
    it took.

    Raises:
        AssertionError: `timeout` seconds passed first, naming `what`.
    """
    start = time.monotonic()
    while not done():
        waited = time.monotonic() - start
        assert waited < timeout, f"not within {timeout} s: {what}"
        time.sleep(every)
    return time.monotonic() - start


def wait_for_progress(consumer: Consumer, block_ids: BlockIds, timeout: float = 20.0) -> None:
    """Wait until bytes of `block_ids` changed in the consumer's cache (a fetch is moving
    bytes). Watches the request's first blocks every 2 ms (chunks go in token order) and all
    of them every 0.1 s. Raises TimeoutError if nothing landed within `timeout` seconds."""
    ids = [int(b) for b in block_ids]
    deadline = time.monotonic() + timeout
    rounds = 0
    while time.monotonic() < deadline:
        if consumer.model.changed(ids if rounds % 50 == 49 else ids[:8]):
            return
        rounds += 1
        time.sleep(0.002)
    raise TimeoutError(f"{consumer.name}: no byte of the request landed within {timeout} s")


def pools_whole(report: dict[str, Any], slots: int) -> bool:
    """Whether every staging pool in a report is back to `slots` free slots."""
    return all(free == slots for free in report["free_slots"].values())


def leaks(
    producers: Sequence[Producer], consumers: Sequence[Consumer], timeout: float = 10.0
) -> list[str]:
    """What leaked, once given `timeout` seconds to settle (quarantines end, releases come):
    staging slots not free, requests still pending, release callbacks not called exactly once
    per published request. Dead or closed processes are skipped. Empty when nothing leaked."""

    def problems() -> list[str]:
        found = []
        for p in producers:
            if p.gone or not p.alive():
                continue
            report = p.report()
            slots = p.options.get("staging_slots", DEFAULT_STAGING_SLOTS)
            if not pools_whole(report, slots):
                found.append(f"{p.name}: staging free slots {report['free_slots']} of {slots}")
            if report["pending"]:
                found.append(f"{p.name}: still pending {report['pending'][:5]}")
            published = Counter(report["published"])
            released = Counter(report["releases"])
            wrong = {
                rid: released.get(rid, 0)
                for rid in set(published) | set(released)
                if released.get(rid, 0) != published.get(rid, 0)
            }
            if wrong:
                sample = dict(sorted(wrong.items())[:5])
                found.append(f"{p.name}: release calls per request (want 1 each): {sample}")
        for c in consumers:
            if c.gone or c.closed or c.options is None or not c.alive():
                continue
            report = c.report()
            slots = c.options.get("staging_slots", DEFAULT_STAGING_SLOTS)
            if not pools_whole(report, slots):
                found.append(f"{c.name}: staging free slots {report['free_slots']} of {slots}")
        return found

    return poll(problems, lambda found: not found, timeout, every=0.2)


def settle_results(
    consumer: Consumer,
    requests: Sequence[Request],
    block_ids: dict[str, BlockIds],
    results: dict[str, dict[str, Any]],
) -> dict[str, list[int]]:
    """Check each request's result against its destination blocks (`block_ids`, by request
    id): the blocks it failed are among them, and it is ok exactly when none failed; then
    settle the consumer's model with it (failed blocks back to poison). The failed blocks of
    every result, by "<request id> failed" (for `describe`)."""
    for request in requests:
        rid = request.request_id
        result = results[rid]
        assert set(result["failed_block_ids"]) <= {int(b) for b in block_ids[rid]}, rid
        assert result["ok"] == (not result["failed_block_ids"]), result
        consumer.model.settle(block_ids[rid], request, result["failed_block_ids"])
    return {f"{rid} failed": r["failed_block_ids"] for rid, r in results.items()}


def watch_for_late_bytes(
    consumers: Sequence[Consumer], seconds: float
) -> dict[str, dict[int, int]]:
    """Compare every consumer's cache with its model for `seconds` (returns at the first
    difference): {consumer name: {block: differing bytes}} of those that differ."""
    deadline = time.monotonic() + seconds
    while True:
        found = {c.name: m for c in consumers if (m := c.model.mismatches())}
        if found or time.monotonic() >= deadline:
            return found
        time.sleep(0.05)


def describe(mismatches: dict[int, int], groups: dict[str, Sequence[int]]) -> str:
    """Differing bytes per named group of blocks (e.g. a request's failed blocks)."""
    parts = []
    rest = dict(mismatches)
    for name, blocks in groups.items():
        hit = {b: rest.pop(b) for b in [int(x) for x in blocks] if b in rest}
        if hit:
            parts.append(f"{sum(hit.values())} bytes in {len(hit)} {name} blocks")
    if rest:
        parts.append(f"{sum(rest.values())} bytes in {len(rest)} other blocks")
    return "; ".join(parts) or "none"


def send_raw(address: str, frames: list[bytes], wait: float = 0.3) -> list[Any]:
    """Send raw frames to a side channel from a fresh DEALER; return what came back (decoded
    msgpack, or the raw bytes) until the first answer or `wait` seconds."""
    sock: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send_multipart(frames)
        if not sock.poll(int(wait * 1000)):
            return []
        replies: list[Any] = []
        while sock.poll(0):
            frame = sock.recv()
            try:
                replies.append(msgspec.msgpack.decode(frame))
            except msgspec.DecodeError:
                replies.append(frame)
        return replies
    finally:
        sock.close()


def garbage_frames(rng: random.Random, oversized: bool = False) -> list[tuple[str, list[bytes]]]:
    """Hostile side-channel messages, named: malformed, unknown, forged sessions, a handshake
    with impossible fields; with `oversized`, frames over the protocol's and ZeroMQ's limits."""
    pack = msgspec.msgpack.encode
    forged_transfer = {
        "type": "transfer",
        "version": 1,
        "session": "forged",
        "request_id": "victim",
        "chunk_id": 0,
        "dst_block_ids": [0, 1],
        "num_tokens": 16,
        "token_start": 0,
        "token_end": 16,
        "strategy": "direct",
        "staging_offset": -1,
        "wait_seconds": 1.0,
    }
    forged_hello = {
        "type": "handshake",
        "version": 1,
        "engine_id": "evil",
        "rank": 99,
        "spec": {"num_layers": -1},
        "endpoint": "256.1.1.1:99999",
        "cache_regions": [{"region_id": 0, "address": 4096, "nbytes": 1 << 40}],
        "staging_region": None,
        "staging_slot_bytes": 0,
    }
    # Well-formed messages of this protocol version that no producer may accept.
    unasked = wire.Handshake(client_nonce="00", server_nonce="11", claim=b"x", proof="00")
    other_service = wire.Hello(service="teleport", name="evil", nonce="22")
    frames = [
        ("not msgpack", [b"\x00\xffnot msgpack"]),
        ("empty frame", [b""]),
        ("two frames", [b"a", b"b"]),
        ("random bytes", [rng.randbytes(rng.randint(1, 2000))]),
        ("unknown version", [pack({"type": "error", "version": 9, "reason": "x"})]),
        ("unknown type", [pack({"type": "teleport", "version": 1})]),
        ("a list", [pack([1, 2, 3])]),
        ("forged session", [pack(forged_transfer)]),
        ("forged done", [pack({"type": "request_done", "version": 1, "session": "forged"})]),
        ("bad handshake", [pack(forged_hello)]),
        ("forged session frames", [b"forged", pack(forged_transfer), bytes(16)]),
        ("handshake without a challenge", [wire.encode(unasked)]),
        ("hello of another service", [wire.encode(other_service)]),
        ("four frames", [b"a", b"b", b"c", b"d"]),
    ]
    if oversized:
        frames.append(("over the frame limit", [b"x" * ((8 << 20) + 1)]))
        frames.append(("over the socket limit", [b"y" * (65 << 20)]))
    return frames
