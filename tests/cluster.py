"""Prefill and decode ranks in separate processes, talking through Mooncake TCP on 127.0.0.1.

A `Side` describes one engine; every process rebuilds the same requests from seeds (global KV,
block tables), so producers fill their caches and consumers compute their expectations without
shipping tensors between processes. Ranks are engine ranks (pp-major: `pp_rank * tp + tp_rank`),
so a `Side` with `pp > 1` runs every rank of every pipeline stage.
"""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from kvxfer import KVCacheSpec, allocate_kv_caches
from kvxfer.layout import BLOCK, layer_axes
from kvxfer.plan import DEFAULT_STAGING_SLOTS
from kvxfer.reference import random_global_kv, write_rank_cells
from kvxfer.spec import pp_layer_ranges

POISON = 0xA5


@dataclass(frozen=True)
class Side:
    tp: int
    heads: int = 4
    block_size: int = 16
    layout: str = "NHD"
    placement: str = "kv_first"
    mla: bool = False
    layers: int = 2
    head_dim: int = 8
    dtype: str = "bfloat16"
    num_blocks: int = 64
    pp: int = 1
    # Each stage's global layers (start, stop); default: vLLM's default split of `layers`.
    layer_ranges: tuple[tuple[int, int], ...] | None = None

    @property
    def ranks(self) -> int:
        """Ranks of the engine, every stage's."""
        return self.pp * self.tp

    def spec(self, rank: int) -> KVCacheSpec:
        """The spec of engine rank `rank`."""
        stage, tp_rank = divmod(rank, self.tp)
        ranges = self.layer_ranges or [
            (r.start, r.stop) for r in pp_layer_ranges(self.layers, self.pp)
        ]
        start, stop = ranges[stage]
        return KVCacheSpec(
            num_layers=stop - start,
            num_kv_heads=1 if self.mla else self.heads,
            head_dim=self.head_dim,
            dtype=self.dtype,  # type: ignore[arg-type]
            tp_size=self.tp,
            tp_rank=tp_rank,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            layout=self.layout,  # type: ignore[arg-type]
            kv_placement=self.placement,  # type: ignore[arg-type]
            mla=self.mla,
            pp_size=self.pp,
            pp_rank=stage,
            layer_start=start,
            total_layers=self.layers if self.pp > 1 else 0,
        )


@dataclass(frozen=True)
class Request:
    request_id: str
    num_tokens: int
    start_token: int = 0
    seed: int = 0
    publish: bool = True


def block_table(spec: KVCacheSpec, requests: list[Request], index: int, side: str) -> np.ndarray:
    """Request `index`'s blocks: scattered, disjoint from the other requests' blocks on the
    same rank, reproducible in every process."""
    rng = np.random.default_rng([spec.engine_rank, 0 if side == "src" else 1])
    order = rng.permutation(spec.num_blocks)
    needed = [-(-r.num_tokens // spec.block_size) for r in requests]
    start = sum(needed[:index])
    if start + needed[index] > spec.num_blocks:
        raise ValueError(f"num_blocks {spec.num_blocks} is too small for these requests")
    return order[start : start + needed[index]].astype(np.int64)


def global_kv(side: Side, request: Request) -> torch.Tensor:
    return random_global_kv(side.spec(0), request.num_tokens, seed=request.seed)


def block_view(spec: KVCacheSpec, layer: torch.Tensor, block: int) -> torch.Tensor:
    """One block of a layer tensor, whatever the layout (its axes in the tensor's order, less
    the block axis): compared as bytes, so `k_transposed` layers need no canonical view."""
    return layer.movedim(layer_axes(spec.layout, spec.kv_placement, spec.mla).index(BLOCK), 0)[
        block
    ]


# ---- processes ----------------------------------------------------------------------------


def producer_main(side: dict, ranks: list[int], requests: list[dict], options: dict, conn) -> None:
    """Serve `ranks` of the prefill engine until told to stop; report releases."""
    from kvxfer.connector import KVProducer

    try:
        s, reqs = Side(**side), [Request(**r) for r in requests]
        releases: list[tuple[int, str]] = []
        producers = []
        for rank in ranks:
            spec = s.spec(rank)
            caches = allocate_kv_caches(spec)
            for t in caches:
                t.view(torch.uint8).fill_(0x3C)  # not the poison: a wrong read shows
            producer = KVProducer(
                spec,
                caches,
                "prefill",
                release=lambda rid, r=rank: releases.append((r, rid)),
                **options,
            )
            for index, request in enumerate(reqs):
                ids = block_table(spec, reqs, index, "src")
                write_rank_cells(spec, caches, ids, global_kv(s, request), 0, request.num_tokens)
                if request.publish:
                    producer.publish(request.request_id, ids, request.num_tokens)
            producers.append(producer)
        conn.send({p.spec.engine_rank: p.address for p in producers})
        command = conn.recv()  # "stop"
        assert command == "stop"
        time.sleep(0.2)  # let the last RequestDone messages land
        report = {
            "releases": releases,
            "pending": {p.spec.engine_rank: p.pending_requests for p in producers},
            "free_slots": {p.spec.engine_rank: p.staging_free_slots() for p in producers},
            "slots": options.get("staging_slots", DEFAULT_STAGING_SLOTS),
        }
        for p in producers:
            p.close()
        conn.send(report)
    except Exception:
        conn.send({"error": traceback.format_exc()})


def consumer_main(
    src: dict,
    dst: dict,
    ranks: list[int],
    addresses: list[str],
    requests: list[dict],
    options: dict,
    conn,
    progress=None,
) -> None:
    """Fetch every request on `ranks` of the decode engine and check every byte. `progress`,
    if given, is set once a fetch has completed 10 chunks (a kill test's trigger)."""
    from kvxfer.connector import KVConsumer

    try:
        s, d, reqs = Side(**src), Side(**dst), [Request(**r) for r in requests]
        timeout = options.pop("fetch_timeout", 20.0)
        consumers = []
        plans: dict[int, list[tuple[int, int, int]]] = {}  # (source rank, layer, head) per pair
        for rank in ranks:
            spec = d.spec(rank)
            caches = allocate_kv_caches(spec)
            for t in caches:
                t.view(torch.uint8).fill_(POISON)
            consumer = KVConsumer(spec, caches, "decode", **options)
            connected = consumer.connect(addresses)
            plans[rank] = [(p.src_rank, p.route.layer_start, p.route.head_start) for p in connected]
            consumers.append(consumer)
        results: dict[str, Any] = {}
        for index, request in enumerate(reqs):
            kv = global_kv(s, request)
            expected = {}
            handles = {}
            for consumer in consumers:
                spec = consumer.spec
                ids = block_table(spec, reqs, index, "dst")
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


def _bad_blocks(consumer, ids: np.ndarray, want: list[torch.Tensor], failed: list[int]) -> list:
    """Blocks of the request, not reported failed, whose bytes differ from the expectation."""
    bad = []
    for block in ids.tolist():
        if block in failed:
            continue
        for layer, (got, exp) in enumerate(zip(consumer.caches, want, strict=True)):
            a = block_view(consumer.spec, got, block).contiguous().view(torch.uint8)
            b = block_view(consumer.spec, exp, block).contiguous().view(torch.uint8)
            if not torch.equal(a, b):
                bad.append((block, layer, int((a != b).sum())))
    return bad


def _others_untouched(consumer, requests: list[Request]) -> bool:
    """Blocks outside every request still hold the poison."""
    used = {
        int(b) for i in range(len(requests)) for b in block_table(consumer.spec, requests, i, "dst")
    }
    others = sorted(set(range(consumer.spec.num_blocks)) - used)
    return all(
        bool((block_view(consumer.spec, t, b).contiguous().view(torch.uint8) == POISON).all())
        for t in consumer.caches
        for b in others
    )


# ---- the parent ---------------------------------------------------------------------------


@dataclass
class ClusterRun:
    consumers: dict[str, Any]
    producers: list[dict] = field(default_factory=list)

    def result(self, request_id: str, rank: int) -> dict:
        return self.consumers[f"{request_id}/{rank}"]


def _receive(conn, timeout: float, who: str) -> Any:
    if not conn.poll(timeout):
        raise TimeoutError(f"{who} did not answer within {timeout} s")
    message = conn.recv()
    if isinstance(message, dict) and "error" in message:
        raise AssertionError(f"{who} failed:\n{message['error']}")
    return message


def run_cluster(
    src: Side,
    dst: Side,
    requests: list[Request],
    *,
    producer_options: dict | None = None,
    consumer_options: dict | None = None,
    process_per_rank: bool = False,
    kill_producers_mid_transfer: bool = False,
    timeout: float = 120.0,
) -> ClusterRun:
    """Run the prefill ranks and the decode ranks in separate processes; collect reports."""
    ctx = mp.get_context("spawn")
    src_groups = [[r] for r in range(src.ranks)] if process_per_rank else [list(range(src.ranks))]
    dst_groups = [[r] for r in range(dst.ranks)] if process_per_rank else [list(range(dst.ranks))]
    reqs = [asdict(r) for r in requests]
    producers, addresses = [], {}
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
        for _, parent in producers:
            addresses.update(_receive(parent, timeout, "producer process"))
        ordered = [addresses[r] for r in sorted(addresses)]
        progress = ctx.Event() if kill_producers_mid_transfer else None
        consumers = []
        for ranks in dst_groups:
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=consumer_main,
                args=(
                    asdict(src),
                    asdict(dst),
                    ranks,
                    ordered,
                    reqs,
                    dict(consumer_options or {}),
                    child,
                    progress,
                ),
                daemon=True,
            )
            proc.start()
            consumers.append((proc, parent))
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
            for proc, parent in producers:
                parent.send("stop")
                reports.append(_receive(parent, timeout, "producer process"))
                proc.join(timeout)
        return ClusterRun(results, reports)
    finally:
        for proc, _ in producers:
            if proc.is_alive():
                proc.kill()
