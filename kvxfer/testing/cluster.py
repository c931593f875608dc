"""A whole transfer in one call: prefill and decode ranks in separate processes, talking
through Mooncake TCP on 127.0.0.1, every destination byte checked in the decode process.

Every process rebuilds the same requests from seeds (global KV, block tables), so producers
fill their caches and consumers compute their expectations without shipping tensors between
processes. Ranks are engine ranks, so a `Geometry` with `pp > 1` runs every rank of every
pipeline stage. For faults injected at chosen points (signals, restarts), see
`kvxfer.testing.rig`.
"""

from __future__ import annotations

import contextlib
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvxfer.plan import DEFAULT_STAGING_SLOTS
from kvxfer.reference import write_rank_cells
from kvxfer.spec import allocate_kv_caches
from kvxfer.testing.geometry import Geometry, Request, request_blocks
from kvxfer.testing.memory import POISON, SOURCE_FILL, bits, by_block, global_kv, poison
from kvxfer.testing.processes import context

if TYPE_CHECKING:
    from kvxfer.connector import ReleaseReason

SETTLE_S = 10.0
"""How long a stopped producer waits for its last requests to be released before it reports."""


def producer_main(
    side: dict[str, Any],
    ranks: list[int],
    requests: list[dict[str, Any]],
    options: dict[str, Any],
    conn: Any,
) -> None:
    """Serve `ranks` of the prefill engine until told to stop; report releases."""
    from kvxfer.connector import KVProducer

    try:
        g, reqs = Geometry(**side), [Request(**r) for r in requests]
        releases: list[tuple[int, str]] = []

        def on_release(rank: int) -> Callable[[str, ReleaseReason], None]:
            return lambda request_id, _reason: releases.append((rank, request_id))

        producers = []
        for rank in ranks:
            spec = g.spec(rank)
            caches = allocate_kv_caches(spec)
            poison(caches, SOURCE_FILL)  # not the poison: a wrong read shows
            producer = KVProducer(
                spec,
                caches,
                "prefill",
                release=on_release(rank),
                **options,
            )
            for index, request in enumerate(reqs):
                ids = request_blocks(spec, reqs, index, "src")
                kv = global_kv(spec, request)
                write_rank_cells(spec, caches, ids, kv, 0, request.num_tokens)
                if request.publish:
                    producer.publish(request.request_id, ids, request.num_tokens)
            producers.append(producer)
        conn.send({p.spec.engine_rank: p.address for p in producers})
        command = conn.recv()  # "stop"
        assert command == "stop"
        # The consumers are done: wait until their last RequestsDone messages landed.
        slots = options.get("staging_slots", DEFAULT_STAGING_SLOTS)
        deadline = time.monotonic() + SETTLE_S
        while time.monotonic() < deadline and not all(
            not p.pending_requests
            and all(free == slots for free in dict(p.staging_free_slots()).values())
            for p in producers
        ):
            time.sleep(0.005)
        report = {
            "releases": releases,
            "pending": {p.spec.engine_rank: p.pending_requests for p in producers},
            "free_slots": {p.spec.engine_rank: p.staging_free_slots() for p in producers},
            "slots": slots,
        }
        for p in producers:
            p.close()
        conn.send(report)
    except Exception:
        conn.send({"error": traceback.format_exc()})


def consumer_main(
    src: dict[str, Any],
    dst: dict[str, Any],
    ranks: list[int],
    requests: list[dict[str, Any]],
    options: dict[str, Any],
    conn: Any,
    progress: Any = None,
) -> None:
    """Fetch every request on `ranks` of the decode engine and check every byte. The prefill
    ranks' addresses come down `conn` (the consumers start while the producers do). `progress`,
    if given, is set once a fetch has completed 10 chunks (a kill test's trigger)."""
    from kvxfer.connector import KVConsumer

    try:
        s, d, reqs = Geometry(**src), Geometry(**dst), [Request(**r) for r in requests]
        timeout = options.pop("fetch_timeout", 20.0)
        consumers = []
        for rank in ranks:
            spec = d.spec(rank)
            caches = allocate_kv_caches(spec)
            poison(caches)
            consumers.append(KVConsumer(spec, caches, "decode", **options))
        addresses = conn.recv()
        plans: dict[int, list[tuple[int, int, int]]] = {}  # (source rank, layer, head) per pair
        for consumer in consumers:
            connected = consumer.connect(addresses)
            plans[consumer.spec.engine_rank] = [
                (p.src_rank, p.route.layer_start, p.route.head_start) for p in connected
            ]
        results: dict[str, Any] = {}
        for index, request in enumerate(reqs):
            kv = global_kv(s.spec(0), request)
            expected = {}
            handles = {}
            for consumer in consumers:
                spec = consumer.spec
                ids = request_blocks(spec, reqs, index, "dst")
                want = [t.clone() for t in consumer.caches]
                write_rank_cells(spec, want, ids, kv, request.start_token, request.num_tokens)
                expected[spec.engine_rank] = (ids, want)
                handles[spec.engine_rank] = consumer.fetch(
                    request.request_id,
                    ids,
                    request.num_tokens,
                    request.start_token,
                    timeout=timeout,
                )
            if progress is not None:
                while not all(h.done() for h in handles.values()):
                    if any(h.chunks_done >= 10 for h in handles.values()):
                        progress.set()
                    time.sleep(0.001)
            for consumer in consumers:
                rank = consumer.spec.engine_rank
                result = handles[rank].wait()
                ids, want = expected[rank]
                results[f"{request.request_id}/{rank}"] = {
                    **asdict(result),
                    "bad_blocks": _bad_blocks(consumer, ids, want, result.failed_block_ids),
                    "untouched_ok": _others_untouched(consumer, reqs),
                    "request_blocks": ids.tolist(),
                }
        for c in consumers:
            results[f"stats/{c.spec.engine_rank}"] = c.stats.summary()
            results[f"free_slots/{c.spec.engine_rank}"] = c.staging_free_slots()
            results[f"pairs/{c.spec.engine_rank}"] = sorted(plans[c.spec.engine_rank])
        for consumer in consumers:
            consumer.close()
        conn.send(results)
    except Exception:
        conn.send({"error": traceback.format_exc()})


def _bad_blocks(
    consumer: Any, ids: np.ndarray, want: list[torch.Tensor], failed: list[int]
) -> list[tuple[int, int, int]]:
    """Blocks of the request, not reported failed, whose bytes differ from the expectation:
    (block, layer, differing bytes)."""
    bad = []
    for block in ids.tolist():
        if block in failed:
            continue
        for layer, (got, exp) in enumerate(zip(consumer.caches, want, strict=True)):
            a = bits(by_block(consumer.spec, got)[block])
            b = bits(by_block(consumer.spec, exp)[block])
            if not torch.equal(a, b):
                bad.append((block, layer, int((a != b).sum())))
    return bad


def _others_untouched(consumer: Any, requests: list[Request]) -> bool:
    """Blocks outside every request still hold the poison."""
    used = {
        int(b)
        for i in range(len(requests))
        for b in request_blocks(consumer.spec, requests, i, "dst")
    }
    others = sorted(set(range(consumer.spec.num_blocks)) - used)
    return all(
        bool((bits(by_block(consumer.spec, t)[b]) == POISON).all())
        for t in consumer.caches
        for b in others
    )


# ---- the parent ---------------------------------------------------------------------------


@dataclass
class ClusterRun:
    """What `run_cluster`'s processes reported: each decode rank's results by
    `"{request_id}/{rank}"` (also `stats/`, `free_slots/`, `pairs/` by rank), and each prefill
    process's report (releases, pending requests, free staging slots)."""

    consumers: dict[str, Any]
    producers: list[dict[str, Any]] = field(default_factory=list)

    def result(self, request_id: str, rank: int) -> dict[str, Any]:
        """Decode rank `rank`'s result of one request (the TransferResult's fields, plus
        `bad_blocks`, `untouched_ok` and `request_blocks`)."""
        return self.consumers[f"{request_id}/{rank}"]


def _receive(conn: Any, timeout: float, who: str) -> Any:
    if not conn.poll(timeout):
        raise TimeoutError(f"{who} did not answer within {timeout} s")
    message = conn.recv()
    if isinstance(message, dict) and "error" in message:
        raise AssertionError(f"{who} failed:\n{message['error']}")
    return message


def run_cluster(
    src: Geometry,
    dst: Geometry,
    requests: list[Request],
    *,
    producer_options: dict[str, Any] | None = None,
    consumer_options: dict[str, Any] | None = None,
    process_per_rank: bool = False,
    kill_producers_mid_transfer: bool = False,
    timeout: float = 120.0,
) -> ClusterRun:
    """Run the prefill ranks and the decode ranks in separate processes; collect reports.

    Args:
        src, dst: the prefill and the decode engine.
        requests: published by every prefill rank, fetched by every decode rank, in order.
        producer_options, consumer_options: `KVProducer` / `KVConsumer` keywords; the
            consumer's may hold `fetch_timeout` (seconds, default 20), each fetch's timeout.
        process_per_rank: a process per rank (default: one per engine).
        kill_producers_mid_transfer: SIGKILL the prefill processes once a fetch moved 10
            chunks (then they report nothing).
        timeout: seconds any process may take to answer.
    """
    ctx = context()
    src_groups = [[r] for r in range(src.ranks)] if process_per_rank else [list(range(src.ranks))]
    dst_groups = [[r] for r in range(dst.ranks)] if process_per_rank else [list(range(dst.ranks))]
    reqs = [asdict(r) for r in requests]
    producers: list[tuple[Any, Any]] = []
    consumers: list[tuple[Any, Any]] = []
    addresses: dict[int, str] = {}
    try:
        for ranks in src_groups:
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=producer_main,
                args=(asdict(src), ranks, reqs, producer_options or {}, child),
                daemon=True,
            )
            proc.start()
            producers.append((proc, parent))
        progress = ctx.Event() if kill_producers_mid_transfer else None
        for ranks in dst_groups:
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=consumer_main,
                args=(
                    asdict(src),
                    asdict(dst),
                    ranks,
                    reqs,
                    dict(consumer_options or {}),
                    child,
                    progress,
                ),
                daemon=True,
            )
            proc.start()
            consumers.append((proc, parent))
        for _, parent in producers:
            addresses.update(_receive(parent, timeout, "producer process"))
        ordered = [addresses[r] for r in sorted(addresses)]
        for _, parent in consumers:
            with contextlib.suppress(OSError):  # a consumer that failed to start says why
                parent.send(ordered)
        if progress is not None:
            assert progress.wait(timeout), "10 chunks did not arrive before the kill"
            for proc, _ in producers:
                proc.kill()
        results: dict[str, Any] = {}
        for proc, parent in consumers:
            results.update(_receive(parent, timeout, "consumer process"))
            proc.join(timeout)
        reports = []
        if not kill_producers_mid_transfer:
            for _, parent in producers:
                parent.send("stop")
            for proc, parent in producers:
                reports.append(_receive(parent, timeout, "producer process"))
                proc.join(timeout)
        return ClusterRun(results, reports)
    finally:
        for proc, _ in [*producers, *consumers]:
            if proc.is_alive():
                proc.kill()
