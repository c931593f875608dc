"""A request's fixed cost through kvxfer's connector, against the floor measured in the same run.

    MC_LOG_LEVEL=ERROR .venv/bin/python benchmarks/latency.py            # a table
    MC_LOG_LEVEL=ERROR .venv/bin/python benchmarks/latency.py --json     # one JSON object
    MC_LOG_LEVEL=ERROR .venv/bin/python benchmarks/latency.py --quick    # the test's small run
    MC_LOG_LEVEL=ERROR .venv/bin/python benchmarks/latency.py --record   # RESULTS.md's row

Two processes, over Mooncake TCP on 127.0.0.1, as a disaggregated deployment runs them: a
prefill process with both ranks of a prefill engine (TP 2, blocks of 16, NHD: two `KVProducer`s,
each with its own Mooncake transport) and a decode process with the four ranks of a decode
engine (TP 4, blocks of 32, HND: four `KVConsumer`s); 8 layers, 8 KV heads of 128, bf16. The
parent process only coordinates them through pipes. `--rank-processes` runs each rank in its
own process instead (two prefill, four decode), as vLLM runs tensor-parallel workers: each
decode process fetches its rank's share, lined up with the others by a barrier, a request's
time runs from the first process's `fetch` to the last one's done (`time.monotonic`: one clock
for every process), and the processes of rank 0 run the floor. Measured, medians of
`--repeats` rounds after one warm-up round (each round goes through every size, so noise hits
all alike):

- `kvxfer_ms`: a request of `tokens` tokens, published on both prefill ranks beforehand, is
  fetched on all four decode ranks at once, as a decode engine does (four `fetch` calls, then
  four waits): the time from the first `fetch` call to the last handle done. Every request id
  is fresh (published once); the source caches hold real KV (`kvxfer.reference`), every
  fetch's destination blocks are poisoned before it and compared, byte for byte, with what
  `kvxfer.reference` says they must hold after it (outside the timed region).
- `floor_ms`: what no connector between these two processes can beat: one ZeroMQ round trip
  (REQ/REP on 127.0.0.1) from the decode process to the prefill process, then one contiguous
  Mooncake read of the request's whole bytes (all four decode ranks' shares together:
  `8 layers x 2 x 8 heads x 128 x 2 bytes x tokens`) from a registered buffer of the prefill
  process into one of the decode process, through kvxfer's own `MooncakeTransport`.
- `quiet_floor_ms`, `ratio_to_quiet_floor`: the floor as `benchmarks/floor.py` measures it
  before these processes start, in two processes of its own that run nothing else, with
  Mooncake's own `batch_transfer_sync_read` (no kvxfer code on the path): the floor the
  targets are set against (`floor_ms` above runs beside the producers, through kvxfer's
  transport). `quiet_floor` also has that run's whole rows (Mooncake's read and the round trip
  apart, and kvxfer's transport reading the same bytes);
- `concurrent`: `--concurrent` requests of `--concurrent-tokens` tokens fetched at once (all four
  ranks each, disjoint blocks): requests per second from the first `fetch` to the last done,
  against the floor done one request after another (`floor_serial_per_s`: requests over the sum
  of their floors).
- `idle_cpu`: CPU seconds per wall second of each process (every thread: `time.process_time`)
  over `--idle-seconds`, with producers and consumers connected and idle, after the traffic
  (the floor's transports closed by then).

The script exits with 1 if a fetch failed, a byte differed, a floor read was wrong, or a
published request was never released; its checks are in the output (`checks`). It never
asserts a speed. On a 2-core machine both processes and Mooncake's threads share the cores:
the numbers are host costs, not a GPU deployment's latency.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import floor as quiet_floor  # benchmarks/floor.py, beside this script
import numpy as np
import torch
import zmq

from kvxfer.reference import write_rank_cells
from kvxfer.spec import allocate_kv_caches
from kvxfer.testing.geometry import Geometry, Request, request_blocks
from kvxfer.testing.memory import POISON, SOURCE_FILL, by_block, fill_blocks, global_kv, poison
from kvxfer.testing.processes import context
from kvxfer.testing.results import Benchmark

PREFILL = Geometry(
    tp=2, heads=8, block_size=16, layout="NHD", layers=8, head_dim=128, dtype="bfloat16"
)
"""The prefill engine (its `num_blocks` is set to what the run's requests need)."""
DECODE = Geometry(
    tp=4, heads=8, block_size=32, layout="HND", layers=8, head_dim=128, dtype="bfloat16"
)
"""The decode engine (its `num_blocks` is set to what the run's requests need)."""

BENCHMARK = Benchmark(
    name="latency",
    title="a request's fixed cost against the quiet floor",
    command="MC_LOG_LEVEL=ERROR .venv/bin/python benchmarks/latency.py",
    results_dir=Path(__file__).resolve().parent / "results",
)
# Issue 38's targets against the quiet floor: the smallest request at most 5x, the largest at
# most 2x, and requests fetched at once at least half the floor's serial rate.
SMALL_TARGET, LARGE_TARGET, CONCURRENT_TARGET = 5.0, 2.0, 0.5
DEFAULT_TOKENS = (16, 128, 512, 2048)
QUICK = {"tokens": (16, 128), "repeats": 2, "concurrent": 4, "idle_seconds": 0.5}
SETUP_TIMEOUT_S = 300.0  # a child's start (imports, caches, handshakes) on a loaded machine
ROUND_TIMEOUT_S = 300.0  # one round of measurements
FETCH_TIMEOUT_S = 60.0  # one fetch; a fetch still running then fails (and the run with it)
SETTLE_S = 10.0  # how long a stopping producer waits for its last releases
DEADLINE_S = 900.0  # a published request's deadline: never reached in a healthy run
IDLE_POLL_MS = 50  # the floor's REP thread looks for its stop this often


class ChildFailed(RuntimeError):
    """A child process raised (its traceback is the message), died or did not answer."""


def kv_bytes(tokens: int, geometry: Geometry = PREFILL) -> int:
    """A request's KV bytes over every rank: layers x K/V x heads x head_dim x itemsize x
    tokens."""
    itemsize = torch.empty(0, dtype=getattr(torch, geometry.dtype)).element_size()
    return geometry.layers * 2 * geometry.heads * geometry.head_dim * itemsize * tokens


def request_layout(tokens: list[int], concurrent: int, concurrent_tokens: int) -> list[Request]:
    """The run's block tables, one per slot: a slot per token size (reused by every round's
    request of that size, one after another), then one per concurrent request. Request ids
    here only name the slots; every fetched request has a fresh id."""
    slots = [Request(f"t{n}", n, seed=i) for i, n in enumerate(tokens)]
    slots += [Request(f"c{i}", concurrent_tokens, seed=1000 + i) for i in range(concurrent)]
    return slots


def sized(geometry: Geometry, layout: list[Request]) -> Geometry:
    """`geometry` with the blocks that every slot of `layout` needs, disjoint."""
    blocks = sum(geometry.blocks_for(r.num_tokens) for r in layout)
    return Geometry(**{**asdict(geometry), "num_blocks": blocks})


def _receive(conn: Any, proc: Any, timeout: float, who: str) -> Any:
    """The next message of a child, or ChildFailed (its traceback, its death, its silence)."""
    deadline = time.monotonic() + timeout
    while not conn.poll(0.2):
        if not proc.is_alive() and not conn.poll(0):
            raise ChildFailed(f"the {who} process died (exit code {proc.exitcode})")
        if time.monotonic() > deadline:
            raise ChildFailed(f"the {who} process did not answer within {timeout:.0f} s")
    message = conn.recv()
    if isinstance(message, dict) and "error" in message:
        raise ChildFailed(f"the {who} process failed:\n{message['error']}")
    return message


def _command(conn: Any) -> dict[str, Any]:
    """A child's next command; a parent silent this long is gone: stop."""
    if not conn.poll(SETUP_TIMEOUT_S + ROUND_TIMEOUT_S):
        return {"op": "stop", "orphaned": True}
    command: dict[str, Any] = conn.recv()
    return command


def _serve(
    conn: Any,
    handlers: dict[str, Callable[[dict[str, Any]], Any]],
    stop: Callable[[], dict[str, Any]],
) -> None:
    """Answer the parent's commands, each with its op's handler (and "idle", which both
    processes measure alike), until "stop": its report goes back unless the parent is gone
    ("orphaned")."""
    while True:
        command = _command(conn)
        op = command["op"]
        if op == "stop":
            report = stop()
            if not command.get("orphaned"):
                conn.send(report)
            return
        if op == "idle":
            conn.send(_idle(command["seconds"]))
        elif op in handlers:
            conn.send(handlers[op](command))
        else:
            raise ValueError(f"unknown command {op!r}")


def _idle(seconds: float) -> dict[str, float]:
    began_cpu, began = time.process_time(), time.perf_counter()
    time.sleep(seconds)
    wall = time.perf_counter() - began
    return {"cpu_per_s": (time.process_time() - began_cpu) / wall, "wall_s": wall}


def _pattern(nbytes: int) -> torch.Tensor:
    """The floor's source bytes, rebuilt in the decode process to check a read."""
    return torch.arange(-(-nbytes // 8), dtype=torch.int64).view(torch.uint8)[:nbytes]


# ---- the prefill process --------------------------------------------------------------------


class _FloorServer:
    """The floor's prefill side: a registered source buffer and a REP socket that answers
    every request at once (on its own thread, as a side channel does)."""

    def __init__(self, nbytes: int) -> None:
        from kvxfer.transport.mooncake import MooncakeTransport

        self.transport = MooncakeTransport()
        self.src = _pattern(nbytes).clone()
        self.region = self.transport.register(self.src)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:*")
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="floor-rep", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            if self.sock.poll(IDLE_POLL_MS):
                self.sock.send(self.sock.recv())

    def info(self) -> dict[str, Any]:
        r = self.region
        return {
            "endpoint": self.transport.endpoint,
            "region": (r.region_id, r.address, r.nbytes),
            "zmq": self.address,
        }

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()
        self.ctx.term()
        self.transport.close()


def _send_traceback(conn: Any) -> None:
    """(a child, in an `except`) Report the exception to the parent, if it still listens."""
    with contextlib.suppress(OSError):
        conn.send({"error": traceback.format_exc()})


def _close_quietly(things: list[Any]) -> None:
    """(a child, at its end) Close what it opened, whatever failed before."""
    for thing in things:
        if thing is not None:
            with contextlib.suppress(Exception):
                thing.close()


def _on_release(released: list[tuple[int, str]], rank: int) -> Callable[[str, Any], None]:
    return lambda request_id, _reason: released.append((rank, request_id))


def prefill_main(config: dict[str, Any], conn: Any) -> None:
    """A prefill process: the producers of its ranks (`config["ranks"]`), serving until told
    to stop."""
    from kvxfer.connector import KVProducer

    producers: list[Any] = []
    floor: _FloorServer | None = None
    try:
        torch.set_num_threads(config["torch_threads"])
        layout = [Request(**r) for r in config["layout"]]
        src = Geometry(**config["prefill"])
        released: list[tuple[int, str]] = []  # list.append: safe from the server threads
        published = 0
        tables: list[list[np.ndarray]] = []
        kvs = [global_kv(src.spec(0), r) for r in layout]
        for rank in config["ranks"]:
            spec = src.spec(rank)
            caches = allocate_kv_caches(spec)
            poison(caches, SOURCE_FILL)  # not the poison: a read from the wrong place shows
            ids = [request_blocks(spec, layout, i, "src") for i in range(len(layout))]
            for slot, request in enumerate(layout):
                write_rank_cells(spec, caches, ids[slot], kvs[slot], 0, request.num_tokens)
            tables.append(ids)
            producers.append(
                KVProducer(spec, caches, "prefill", release=_on_release(released, rank))
            )
        del kvs
        conn.send({"addresses": [p.address for p in producers]})

        def publish(command: dict[str, Any]) -> dict[str, Any]:
            nonlocal published
            for request_id, slot in command["requests"]:
                for producer, ids in zip(producers, tables, strict=True):
                    producer.publish(
                        request_id, ids[slot], layout[slot].num_tokens, deadline_s=DEADLINE_S
                    )
                published += 1
            return {"published": len(command["requests"])}

        def floor_open(command: dict[str, Any]) -> dict[str, Any]:
            nonlocal floor
            floor = _FloorServer(command["nbytes"])
            return floor.info()

        def floor_close(command: dict[str, Any]) -> dict[str, Any]:
            nonlocal floor
            if floor is not None:
                floor.close()
                floor = None
            return {"closed": True}

        def stop() -> dict[str, Any]:
            nonlocal producers
            deadline = time.monotonic() + SETTLE_S
            while time.monotonic() < deadline and any(p.pending_requests for p in producers):
                time.sleep(0.01)
            report = {
                "published": published,
                "released_by_rank": {
                    rank: sorted({r for k, r in released if k == rank}) for rank in config["ranks"]
                },
                "release_calls": len(released),
                "pending": sorted({r for p in producers for r in p.pending_requests}),
            }
            for p in producers:
                p.close()
            producers = []
            return report

        handlers = {"publish": publish, "floor_open": floor_open, "floor_close": floor_close}
        _serve(conn, handlers, stop)
    except Exception:
        _send_traceback(conn)
    finally:
        _close_quietly([floor, *producers])


# ---- the decode process ---------------------------------------------------------------------


class _FloorClient:
    """The floor's decode side: a REQ socket to the prefill process and a registered
    destination buffer that one contiguous Mooncake read fills."""

    def __init__(self, info: dict[str, Any], nbytes: int) -> None:
        from kvxfer.plan import Segments
        from kvxfer.transport import Peer
        from kvxfer.transport.base import Region
        from kvxfer.transport.mooncake import MooncakeTransport

        self.transport = MooncakeTransport()
        self.dst = torch.zeros(nbytes, dtype=torch.uint8)
        self.local = self.transport.register(self.dst)
        remote = Region(*info["region"])
        self.peer = Peer(info["endpoint"], {remote.region_id: remote})
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.REQ)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(info["zmq"])
        self._segments_type = Segments
        self._remote_id = remote.region_id
        self.segments: dict[int, Any] = {}

    def prepare(self, nbytes: int) -> None:
        """Build the read of `nbytes` (before timing it)."""
        one = np.zeros(1, dtype=np.int64)
        self.segments[nbytes] = self._segments_type(
            np.full(1, self._remote_id, dtype=np.int64),
            one,
            np.full(1, self.local.region_id, dtype=np.int64),
            one.copy(),
            np.full(1, nbytes, dtype=np.int64),
        )

    def once(self, nbytes: int) -> float:
        """One floor: a ZeroMQ round trip, then a read of `nbytes`; its wall seconds."""
        segments = self.segments[nbytes]
        began = time.perf_counter()
        self.sock.send(b"where")
        if not self.sock.poll(int(FETCH_TIMEOUT_S * 1000)):
            raise TimeoutError("the floor's REP socket did not answer")
        self.sock.recv()
        self.transport.read(segments, self.peer).result(FETCH_TIMEOUT_S)
        return time.perf_counter() - began

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()
        self.transport.close()


class _Decode:
    """A decode process's state: the consumers of its ranks (`config["ranks"]`), their block
    tables and expected bytes; `barrier` lines its fetches up with the other decode processes'
    (none when it hosts every rank)."""

    def __init__(self, config: dict[str, Any], barrier: Any = None) -> None:
        from kvxfer.connector import KVConsumer

        self.layout = [Request(**r) for r in config["layout"]]
        src, dst = Geometry(**config["prefill"]), Geometry(**config["decode"])
        self.ranks: list[int] = list(config["ranks"])
        self.barrier = barrier
        self.consumers: list[Any] = []
        self.tables: list[list[np.ndarray]] = []
        self.expected: list[list[list[torch.Tensor]]] = []  # by hosted rank, slot, layer
        kvs = [global_kv(src.spec(0), r) for r in self.layout]
        for rank in self.ranks:
            spec = dst.spec(rank)
            caches = allocate_kv_caches(spec)
            poison(caches)
            ids = [request_blocks(spec, self.layout, i, "dst") for i in range(len(self.layout))]
            self.tables.append(ids)
            self.expected.append(
                [self._expect(dst, rank, r, kvs[i]) for i, r in enumerate(self.layout)]
            )
            self.consumers.append(KVConsumer(spec, caches, "decode", timeout_s=FETCH_TIMEOUT_S))
        self.checks = {
            "fetches": 0,
            "fetches_ok": 0,
            "bytes_checked": 0,
            "bad_blocks": 0,
            "floor_reads_checked": 0,
            "floor_reads_bad": 0,
        }
        self.errors: list[str] = []
        self.strategies: set[str] = set()
        self.floor: _FloorClient | None = None
        self.floor_checked: set[int] = set()

    @staticmethod
    def _expect(dst: Geometry, rank: int, request: Request, kv: torch.Tensor) -> list[torch.Tensor]:
        """What the request's blocks must hold on `rank`, by layer, as raw bytes with the
        block axis first: a cache of just those blocks, poisoned, with the request's cells
        written by `kvxfer.reference`."""
        blocks = dst.blocks_for(request.num_tokens)
        spec = Geometry(**{**asdict(dst), "num_blocks": blocks}).spec(rank)
        caches = allocate_kv_caches(spec)
        poison(caches)
        write_rank_cells(spec, caches, np.arange(blocks), kv, 0, request.num_tokens)
        return [by_block(spec, t.view(torch.uint8)) for t in caches]

    def _start(self, request_id: str, slot: int) -> list[Any]:
        tokens = self.layout[slot].num_tokens
        return [
            c.fetch(request_id, ids[slot], tokens)
            for c, ids in zip(self.consumers, self.tables, strict=True)
        ]

    def _poison(self, slot: int) -> None:
        for c, ids in zip(self.consumers, self.tables, strict=True):
            fill_blocks(c.spec, c.caches, ids[slot], POISON)

    def _check(self, request_id: str, slot: int, results: list[Any]) -> None:
        """Every rank's result ok and its blocks exactly as `kvxfer.reference` says."""
        for i, (consumer, result) in enumerate(zip(self.consumers, results, strict=True)):
            rank = self.ranks[i]
            self.checks["fetches"] += 1
            self.strategies.add(result.strategy)
            if result.ok:
                self.checks["fetches_ok"] += 1
            else:
                self.errors.append(f"{request_id} rank {rank}: {result.errors}")
            index = torch.as_tensor(self.tables[i][slot])
            for layer, want in zip(consumer.caches, self.expected[i][slot], strict=True):
                got = by_block(consumer.spec, layer.view(torch.uint8))[index]
                self.checks["bytes_checked"] += got.numel()
                if not torch.equal(got, want):
                    bad = int((got != want).flatten(1).any(1).sum())
                    self.checks["bad_blocks"] += bad
                    self.errors.append(f"{request_id} rank {rank}: {bad} blocks differ")

    def _line_up(self) -> None:
        """Wait until every decode process got here (no-op in the one decode process)."""
        if self.barrier is not None:
            self.barrier.wait(ROUND_TIMEOUT_S)

    @property
    def hosts_floor(self) -> bool:
        """Whether this process runs the floor (the one hosting decode rank 0)."""
        return 0 in self.ranks

    def kvxfer_once(self, request_id: str, slot: int) -> tuple[float, float]:
        """One request fetched on this process's ranks at once, lined up with the other decode
        processes: `time.monotonic()` (one clock for every process) at the first fetch and at
        the last done. Checked afterwards."""
        self._poison(slot)
        self._line_up()
        began = time.monotonic()
        handles = self._start(request_id, slot)
        results = [h.wait(FETCH_TIMEOUT_S) for h in handles]
        ended = time.monotonic()
        self._line_up()  # every process done before anything else (the floor) runs
        self._check(request_id, slot, results)
        return began, ended

    def kvxfer_concurrent(self, requests: list[tuple[str, int]]) -> tuple[float, float]:
        """Requests fetched at once on this process's ranks, lined up with the other decode
        processes; `kvxfer_once`'s stamps. Checked afterwards."""
        for _, slot in requests:
            self._poison(slot)
        self._line_up()
        began = time.monotonic()
        handles = [self._start(request_id, slot) for request_id, slot in requests]
        results = [[h.wait(FETCH_TIMEOUT_S) for h in hs] for hs in handles]
        ended = time.monotonic()
        self._line_up()
        for (request_id, slot), rs in zip(requests, results, strict=True):
            self._check(request_id, slot, rs)
        return began, ended

    def floor_once(self, nbytes: int) -> float:
        """One floor of `nbytes`; the first of each size is checked against the source."""
        assert self.floor is not None
        first = nbytes not in self.floor_checked
        if first:
            self.floor.dst.zero_()
        seconds = self.floor.once(nbytes)
        if first:
            self.floor_checked.add(nbytes)
            self.checks["floor_reads_checked"] += 1
            if not torch.equal(self.floor.dst[:nbytes], _pattern(nbytes)):
                self.checks["floor_reads_bad"] += 1
                self.errors.append(f"the floor's read of {nbytes} bytes differs")
        return seconds

    def _floor(self, nbytes: int) -> float | None:
        """The floor of `nbytes` in the process that hosts it, while the others wait."""
        seconds = self.floor_once(nbytes) if self.hosts_floor else None
        self._line_up()
        return seconds

    def round(self, command: dict[str, Any]) -> dict[str, Any]:
        """One round: each size through kvxfer and the floor (in the order given, kvxfer
        first or second as told), then the concurrent requests and their serial floors. The
        fetches are `kvxfer_once`'s stamps; floors come from the process that hosts them."""
        kvxfer: dict[int, tuple[float, float]] = {}
        floor: dict[int, float | None] = {}
        for request_id, slot in command["sizes"]:
            tokens = self.layout[slot].num_tokens
            if command["floor_first"]:
                floor[tokens] = self._floor(kv_bytes(tokens))
            kvxfer[tokens] = self.kvxfer_once(request_id, slot)
            if not command["floor_first"]:
                floor[tokens] = self._floor(kv_bytes(tokens))
        concurrent = command["concurrent"]
        result: dict[str, Any] = {"kvxfer": kvxfer, "floor": floor}
        if concurrent:
            nbytes = kv_bytes(self.layout[concurrent[0][1]].num_tokens)
            result["concurrent"] = self.kvxfer_concurrent(concurrent)
            floors = [self._floor(nbytes) for _ in concurrent]
            result["floor_serial"] = sum(f for f in floors if f is not None) or None
        return result

    def floor_open(self, command: dict[str, Any]) -> dict[str, Any]:
        """Connect the floor's reader to the prefill process's buffer; prepare every size."""
        self.floor = _FloorClient(command["info"], command["nbytes"])
        for nbytes in command["sizes"]:
            self.floor.prepare(nbytes)
        return {"opened": True}

    def floor_close(self, command: dict[str, Any]) -> dict[str, Any]:
        """Close the floor's reader (the concurrent and idle rounds run without it)."""
        if self.floor is not None:
            self.floor.close()
            self.floor = None
        return {"closed": True}

    def stop(self) -> dict[str, Any]:
        """Close everything; the run's checks, errors and the strategies the ranks used."""
        report = {
            "checks": self.checks,
            "errors": self.errors,
            "strategies": sorted(self.strategies),
        }
        self.close()
        return report

    def close(self) -> None:
        self.floor_close({})
        for c in self.consumers:
            c.close()
        self.consumers = []


def decode_main(config: dict[str, Any], conn: Any, barrier: Any = None) -> None:
    """A decode process: the consumers of its ranks (`config["ranks"]`), fetching as told."""
    decode: _Decode | None = None
    try:
        torch.set_num_threads(config["torch_threads"])
        decode = _Decode(config, barrier)
        addresses = _command(conn)["addresses"]
        for consumer in decode.consumers:
            consumer.connect(addresses)
        first = decode.consumers[0]  # decode rank 0 in the process that hosts it
        conn.send({"chunking": {str(r): [c.tokens, c.depth] for r, c in first.chunking().items()}})
        handlers = {
            "round": decode.round,
            "floor_open": decode.floor_open,
            "floor_close": decode.floor_close,
        }
        _serve(conn, handlers, decode.stop)
    except Exception:
        _send_traceback(conn)
    finally:
        _close_quietly([decode])


# ---- the parent -----------------------------------------------------------------------------


def measure(
    tokens: list[int],
    repeats: int,
    concurrent: int,
    concurrent_tokens: int,
    idle_seconds: float,
    torch_threads: int = 1,
    rank_processes: bool = False,
) -> dict[str, Any]:
    """Run the processes and measure (see the module docstring); the report's `checks`
    say whether every fetch and floor read was right.

    `rank_processes`: one process per rank (2 prefill, 4 decode) instead of one per engine.

    Raises:
        ChildFailed: a process raised (with its traceback), died or did not answer.
    """
    layout = request_layout(tokens, concurrent, concurrent_tokens)
    src, dst = sized(PREFILL, layout), sized(DECODE, layout)
    config = {
        "layout": [asdict(r) for r in layout],
        "prefill": asdict(src),
        "decode": asdict(dst),
        "torch_threads": torch_threads,
    }
    sizes = [*tokens, *([concurrent_tokens] if concurrent else [])]
    floor_bytes = sorted({kv_bytes(n) for n in sizes})
    ctx = context()
    kvxfer: dict[int, list[float]] = {n: [] for n in tokens}
    floor: dict[int, list[float]] = {n: [] for n in tokens}
    together: list[float] = []
    serial: list[float] = []
    prefills = _hosts(src.ranks, rank_processes)
    decodes = _hosts(dst.ranks, rank_processes)
    barrier = ctx.Barrier(len(decodes)) if len(decodes) > 1 else None
    started: list[_Child] = []
    try:
        for ranks in prefills:
            started.append(_Child.start(ctx, prefill_main, {**config, "ranks": ranks}, "prefill"))
        for ranks in decodes:
            child_config = {**config, "ranks": ranks}
            started.append(_Child.start(ctx, decode_main, child_config, "decode", barrier))
        prefill, decode = started[: len(prefills)], started[len(prefills) :]
        addresses = [a for p in prefill for a in p.receive(SETUP_TIMEOUT_S)["addresses"]]
        for d in decode:
            d.conn.send({"addresses": addresses})
        chunkings = [d.receive(SETUP_TIMEOUT_S)["chunking"] for d in decode]
        chunking = chunkings[0]  # decode rank 0's
        floor_prefill, floor_decode = prefill[0], decode[0]  # the hosts of rank 0
        info = floor_prefill.ask(op="floor_open", nbytes=max(floor_bytes))
        floor_decode.ask(op="floor_open", info=info, nbytes=max(floor_bytes), sizes=floor_bytes)
        slots = {n: i for i, n in enumerate(tokens)}
        for rep in range(repeats + 1):  # round 0 warms up
            order = tokens[rep % len(tokens) :] + tokens[: rep % len(tokens)]
            single = [(f"r{rep}-t{n}", slots[n]) for n in order]
            together_ids = [(f"r{rep}-c{i}", len(tokens) + i) for i in range(concurrent)]
            for p in prefill:
                p.conn.send({"op": "publish", "requests": single + together_ids})
            for p in prefill:
                p.receive(ROUND_TIMEOUT_S)
            command = {
                "op": "round",
                "sizes": single,
                "concurrent": together_ids,
                "floor_first": rep % 2 == 1,
            }
            for d in decode:
                d.conn.send(command)
            rounds = [d.receive(ROUND_TIMEOUT_S) for d in decode]
            if rep == 0:
                continue
            hosted = rounds[0]  # the floors' host
            for n in tokens:
                kvxfer[n].append(_span([r["kvxfer"][n] for r in rounds]))
                floor[n].append(hosted["floor"][n])
            if concurrent:
                together.append(_span([r["concurrent"] for r in rounds]))
                serial.append(hosted["floor_serial"])
        for child in (floor_prefill, floor_decode):
            child.ask(op="floor_close")
        for child in started:
            child.conn.send({"op": "idle", "seconds": idle_seconds})
        idle = [child.receive(ROUND_TIMEOUT_S)["cpu_per_s"] for child in started]
        # Consumers first (their last done notices reach the producers), then producers.
        for d in decode:
            d.conn.send({"op": "stop"})
        decode_reports = [d.receive(ROUND_TIMEOUT_S) for d in decode]
        for d in decode:
            d.proc.join(30)
        for p in prefill:
            p.conn.send({"op": "stop"})
        prefill_reports = [p.receive(ROUND_TIMEOUT_S) for p in prefill]
        for p in prefill:
            p.proc.join(30)
    finally:
        for child in started:
            if child.proc.is_alive():
                child.proc.kill()
                child.proc.join(5)

    rows = []
    for n in tokens:
        k, f = statistics.median(kvxfer[n]), statistics.median(floor[n])
        rows.append(
            {
                "tokens": n,
                "bytes": kv_bytes(n),
                "kvxfer_ms": k * 1e3,
                "floor_ms": f * 1e3,
                "ratio": k / f,
            }
        )
    together_rate = concurrent / statistics.median(together) if concurrent else 0.0
    serial_rate = concurrent / statistics.median(serial) if concurrent else 0.0
    checks = {
        key: sum(r["checks"][key] for r in decode_reports) for key in decode_reports[0]["checks"]
    }
    released_by_rank = [set(ids) for r in prefill_reports for ids in r["released_by_rank"].values()]
    published = prefill_reports[0]["published"]
    checks.update(
        published=published,
        released=len(set.intersection(*released_by_rank)),  # by every prefill rank
        pending_at_stop=len({i for r in prefill_reports for i in r["pending"]}),
    )
    release_calls = sum(r["release_calls"] for r in prefill_reports)
    checks["passed"] = (
        checks["fetches"] > 0
        and checks["fetches_ok"] == checks["fetches"]
        and checks["bad_blocks"] == 0
        and checks["floor_reads_bad"] == 0
        and checks["floor_reads_checked"] == len(floor_bytes)
        and checks["released"] == checks["published"]
        and all(r["published"] == published for r in prefill_reports)
        and release_calls == src.ranks * published
    )
    return {
        "rows": rows,
        "concurrent": {
            "requests": concurrent,
            "tokens": concurrent_tokens,
            "kvxfer_per_s": together_rate,
            "floor_serial_per_s": serial_rate,
            "ratio": together_rate / serial_rate if serial_rate else 0.0,
        },
        "idle_cpu": {
            "prefill": sum(idle[: len(prefills)]),
            "decode": sum(idle[len(prefills) :]),
        },
        "checks": checks,
        "errors": [e for r in decode_reports for e in r["errors"]][:20],
        "config": {
            "prefill": {"tp": PREFILL.tp, "block_size": PREFILL.block_size, "layout": "NHD"},
            "decode": {"tp": DECODE.tp, "block_size": DECODE.block_size, "layout": "HND"},
            "processes": {"prefill": len(prefills), "decode": len(decodes)},
            "layers": PREFILL.layers,
            "kv_heads": PREFILL.heads,
            "head_dim": PREFILL.head_dim,
            "dtype": PREFILL.dtype,
            "protocol": "tcp",
            "tokens": tokens,
            "repeats": repeats,
            "warmup_rounds": 1,
            "concurrent": concurrent,
            "concurrent_tokens": concurrent_tokens,
            "idle_seconds": idle_seconds,
            "torch_threads": torch_threads,
            "strategies": sorted({s for r in decode_reports for s in r["strategies"]}),
            "decode_rank0_chunking": {
                src_rank: {"tokens": t, "depth": d} for src_rank, (t, d) in chunking.items()
            },
        },
    }


def _hosts(ranks: int, rank_processes: bool) -> list[list[int]]:
    """Which ranks each process of an engine hosts: all in one, or one each."""
    return [[r] for r in range(ranks)] if rank_processes else [list(range(ranks))]


def _span(stamps: list[tuple[float, float]]) -> float:
    """Seconds from the first process's first fetch to the last process's last done."""
    return max(end for _, end in stamps) - min(began for began, _ in stamps)


class _Child:
    """A child process and the parent's end of its pipe."""

    def __init__(self, proc: Any, conn: Any, who: str) -> None:
        self.proc, self.conn, self.who = proc, conn, who

    @classmethod
    def start(cls, ctx: Any, target: Callable[..., None], config: dict[str, Any], who: str,
              *extra: Any) -> _Child:  # fmt: skip
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=target, args=(config, child, *extra), daemon=True)
        proc.start()
        return cls(proc, parent, f"{who} {config['ranks']}")

    def receive(self, timeout: float) -> Any:
        """Its next message (`_receive`)."""
        return _receive(self.conn, self.proc, timeout, self.who)

    def ask(self, timeout: float = ROUND_TIMEOUT_S, **command: Any) -> Any:
        """Send a command; its answer."""
        self.conn.send(command)
        return self.receive(timeout)


def format_result(r: dict[str, Any]) -> str:
    """The report as a table."""
    c = r["config"]
    lines = [
        f"prefill TP {c['prefill']['tp']} / {c['prefill']['block_size']} / "
        f"{c['prefill']['layout']} -> decode TP {c['decode']['tp']} / "
        f"{c['decode']['block_size']} / {c['decode']['layout']}, {c['layers']} layers, "
        f"{c['kv_heads']} KV heads x {c['head_dim']}, {c['dtype']}, Mooncake TCP; "
        f"{c['processes']['prefill']} + {c['processes']['decode']} processes; "
        f"median of {c['repeats']} after a warm-up",
        f"{'tokens':>7} {'bytes':>11} {'kvxfer ms':>10} {'floor ms':>9} {'ratio':>6} "
        f"{'quiet floor ms':>15} {'ratio':>6}",
    ]
    for row in r["rows"]:
        lines.append(
            f"{row['tokens']:>7} {row['bytes']:>11,} {row['kvxfer_ms']:10.2f} "
            f"{row['floor_ms']:9.2f} {row['ratio']:6.2f} "
            f"{row.get('quiet_floor_ms', float('nan')):15.3f} "
            f"{row.get('ratio_to_quiet_floor', float('nan')):6.2f}"
        )
    k = r["concurrent"]
    if k["requests"]:
        lines.append(
            f"{k['requests']} requests of {k['tokens']} tokens at once: kvxfer "
            f"{k['kvxfer_per_s']:.1f}/s, floor one after another {k['floor_serial_per_s']:.1f}/s "
            f"(ratio {k['ratio']:.2f}); quiet floor one after another "
            f"{k.get('quiet_floor_serial_per_s', float('nan')):.1f}/s "
            f"(ratio {k.get('ratio_to_quiet_floor', float('nan')):.2f})"
        )
    i = r["idle_cpu"]
    lines.append(
        f"idle: prefill {i['prefill']:.4f}, decode {i['decode']:.4f} CPU seconds per second"
    )
    x = r["checks"]
    lines.append(
        f"checks {'passed' if x['passed'] else 'FAILED'}: {x['fetches_ok']}/{x['fetches']} "
        f"fetches ok, {x['bytes_checked']:,} bytes compared, {x['bad_blocks']} blocks differ, "
        f"{x['released']}/{x['published']} requests released"
    )
    lines.extend(f"  {e}" for e in r["errors"])
    return "\n".join(lines)


def add_quiet_floor(result: dict[str, Any], quiet: dict[str, Any]) -> None:
    """Each row's and the concurrent run's ratio to the quiet floor (`benchmarks/floor.py`);
    a quiet read that failed or differed fails the checks."""
    floors = {row["tokens"]: row["floor_ms"] for row in quiet["rows"]}
    for row in result["rows"]:
        row["quiet_floor_ms"] = floors[row["tokens"]]
        row["ratio_to_quiet_floor"] = row["kvxfer_ms"] / floors[row["tokens"]]
    k = result["concurrent"]
    if k["requests"]:
        k["quiet_floor_serial_per_s"] = 1e3 / floors[k["tokens"]]
        k["ratio_to_quiet_floor"] = k["kvxfer_per_s"] / k["quiet_floor_serial_per_s"]
    result["quiet_floor"] = quiet
    result["checks"]["quiet_floor_reads_bad"] = len(quiet["bad"])
    result["checks"]["passed"] = result["checks"]["passed"] and not quiet["bad"]


def figure(result: dict[str, Any]) -> tuple[str, str]:
    """The page's figure and targets: the smallest and the largest request against the quiet
    floor, and the concurrent run against the floor's serial rate."""
    rows = sorted(result["rows"], key=lambda row: row["tokens"])
    small, large, k = rows[0], rows[-1], result["concurrent"]
    parts = [
        f"{small['tokens']:,} tokens {small['kvxfer_ms']:.2f} ms against a floor of "
        f"{small['quiet_floor_ms']:.3f} ms (**{small['ratio_to_quiet_floor']:.1f}×**)",
        f"{large['tokens']:,} tokens **{large['ratio_to_quiet_floor']:.2f}×**",
    ]
    checks = [
        (
            f"{small['tokens']:,} tokens ≤ {SMALL_TARGET:g}×",
            small["ratio_to_quiet_floor"] <= SMALL_TARGET,
        ),
        (
            f"{large['tokens']:,} tokens ≤ {LARGE_TARGET:g}×",
            large["ratio_to_quiet_floor"] <= LARGE_TARGET,
        ),
    ]
    if k["requests"]:
        parts.append(
            f"{k['requests']} requests of {k['tokens']} tokens at once "
            f"**{k['ratio_to_quiet_floor']:.2f}** of the floor's serial rate"
        )
        checks.append(
            (f"concurrent ≥ {CONCURRENT_TARGET}", k["ratio_to_quiet_floor"] >= CONCURRENT_TARGET)
        )
    targets = "; ".join(f"{name} ({'met' if met else 'not met'})" for name, met in checks)
    return "; ".join(parts), targets


def _ints(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"positive integers, comma-separated: {text!r}")
    return list(dict.fromkeys(values))


def main(argv: list[str] | None = None) -> int:
    """Parse the flags, measure, print; 0 if every check passed, 1 if not, 2 if a process
    failed."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--tokens", type=_ints, default=None, help="request sizes (default 16,128,512,2048)"
    )
    parser.add_argument("--repeats", type=int, default=None, help="rounds measured (default 6)")
    parser.add_argument(
        "--concurrent", type=int, default=None, help="requests fetched at once (default 16)"
    )
    parser.add_argument("--concurrent-tokens", type=int, default=256)
    parser.add_argument(
        "--idle-seconds", type=float, default=None, help="idle CPU window (default 2)"
    )
    parser.add_argument("--torch-threads", type=int, default=1, help="torch threads per process")
    parser.add_argument(
        "--rank-processes",
        action="store_true",
        help="one process per rank (2 prefill, 4 decode), as vLLM runs TP workers",
    )
    parser.add_argument(
        "--quick", action="store_true", help="tokens 16,128, 2 repeats, 4 at once, 0.5 s idle"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    BENCHMARK.add_record_flag(parser)
    args = parser.parse_args(argv)
    defaults: dict[str, Any] = {
        "tokens": DEFAULT_TOKENS,
        "repeats": 6,
        "concurrent": 16,
        "idle_seconds": 2.0,
    }
    if args.quick:
        defaults.update(QUICK)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.repeats < 1 or args.concurrent < 0 or args.idle_seconds <= 0:
        parser.error("--repeats must be >= 1, --concurrent >= 0, --idle-seconds > 0")
    if args.concurrent_tokens < 1 or args.torch_threads < 1:
        parser.error("--concurrent-tokens and --torch-threads must be >= 1")

    from kvxfer.cli.native_logs import filtered_stderr, set_mooncake_log_level

    set_mooncake_log_level(False)
    try:
        with filtered_stderr():
            quiet = quiet_floor.measure(
                sorted({*args.tokens, args.concurrent_tokens}), max(10, 5 * args.repeats)
            )
            result = measure(
                list(args.tokens),
                args.repeats,
                args.concurrent,
                args.concurrent_tokens,
                args.idle_seconds,
                args.torch_threads,
                args.rank_processes,
            )
    except ChildFailed as exc:
        print(f"latency: {exc}", file=sys.stderr)
        return 2
    add_quiet_floor(result, quiet)
    print(json.dumps(result, indent=2) if args.json else format_result(result))
    if not result["checks"]["passed"]:
        print("latency: a check failed (see checks and errors)", file=sys.stderr)
        return 1
    BENCHMARK.record(args.record, argv, result, figure)
    return 0


if __name__ == "__main__":
    sys.exit(main())
