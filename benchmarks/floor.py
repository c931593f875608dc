"""The floor of a request's fixed cost: Mooncake's own calls between two quiet processes.

    MC_LOG_LEVEL=ERROR .venv/bin/python benchmarks/floor.py [--json] [--repeats 30]
        [--tokens 16 128 512 2048] [--record]

Two processes started for this alone, on 127.0.0.1, running nothing else: a source process
with a registered buffer and a ZeroMQ REP socket, and a reader process. For each size (the
bytes of a request of `tokens` tokens in `benchmarks/latency.py`'s geometry: 8 layers, 8 KV
heads of 128, bf16, K and V), medians over `--repeats` rounds after one warm-up, each:

- `floor_ms`: one ZeroMQ round trip (REQ/REP) to the source process, then one
  `batch_transfer_sync_read` of the whole size, Mooncake's own blocking call: what no
  connector between two processes can beat (a request's ask, then its bytes);
- `mooncake_read_ms`: the `batch_transfer_sync_read` alone;
- `zmq_round_trip_ms`: the round trip alone;
- `kvxfer_read_ms`: the same bytes read through kvxfer's `MooncakeTransport.read` (its
  threaded pump: an async submit, then polls), in the same reader process, from the same
  source buffer; `kvxfer_read_over_mooncake` is its ratio to `mooncake_read_ms`;
- `kvxfer_driven_read_ms`: the same read through a driven `MooncakeTransport`, as a consumer
  runs its transport: `read` then `drive` on one thread until it settles, sleeping between
  polls as a consumer's loop does (`kvxfer.transport.completion`); timed on that thread from
  `read` to settled. `kvxfer_driven_read_over_mooncake` is its ratio.

Every read is checked against the source's pattern (outside the timed region); the script
exits with 1 if one differs or fails. It never asserts a speed. `benchmarks/latency.py` runs
`measure` before its own processes start and reports its requests against this floor.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import queue
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zmq

from kvxfer.testing.results import Benchmark, verdict

BENCHMARK = Benchmark(
    name="floor",
    title="the quiet floor: Mooncake's own read and a ZeroMQ round trip between idle processes",
    command="MC_LOG_LEVEL=ERROR .venv/bin/python benchmarks/floor.py",
    results_dir=Path(__file__).resolve().parent / "results",
)
TRANSPORT_TARGET = 1.5  # kvxfer's transport read within 1.5x of Mooncake's own (issue 38)
READ_RATIOS = (("threaded", "kvxfer_read_over_mooncake"),
               ("driven", "kvxfer_driven_read_over_mooncake"))  # fmt: skip
DEFAULT_TOKENS = (16, 128, 512, 2048)
BYTES_PER_TOKEN = 8 * 2 * 8 * 128 * 2  # latency.py's geometry: layers, K and V, heads, dim, bf16
TIMEOUT_S = 60.0
START_TIMEOUT_S = 300.0  # a child's start (imports, Mooncake) on a loaded machine


def pattern(nbytes: int) -> torch.Tensor:
    """The source bytes (rebuilt by the reader to check a read)."""
    return torch.arange(-(-nbytes // 8), dtype=torch.int64).view(torch.uint8)[:nbytes]


def _engine() -> tuple[Any, str]:
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    code = engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if code != 0:
        raise RuntimeError(f"Mooncake initialize returned {code}")
    return engine, f"127.0.0.1:{engine.get_rpc_port()}"


def source_main(nbytes: int, conn: Any) -> None:
    """The source process: a registered buffer and a REP socket answering at once."""
    engine, endpoint = _engine()
    src = pattern(nbytes).clone()
    if engine.register_memory(src.data_ptr(), src.numel()) != 0:
        raise RuntimeError("Mooncake register_memory failed")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REP)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:*")
    zmq_address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    conn.send({"endpoint": endpoint, "address": src.data_ptr(), "zmq": zmq_address})
    while not conn.poll(0):
        if sock.poll(50):
            sock.send(sock.recv())
    sock.close()
    ctx.term()


def reader_main(source: dict[str, Any], sizes: list[int], repeats: int, conn: Any) -> None:
    """The reader process: every measurement, sent back as one dict."""
    from kvxfer.plan import Segments
    from kvxfer.transport import Peer
    from kvxfer.transport.base import Region
    from kvxfer.transport.mooncake import MooncakeTransport

    engine, _ = _engine()
    top = max(sizes)
    dst = torch.zeros(top, dtype=torch.uint8)
    if engine.register_memory(dst.data_ptr(), top) != 0:
        raise RuntimeError("Mooncake register_memory failed")
    transport = MooncakeTransport()
    kv_dst = torch.zeros(top, dtype=torch.uint8)
    local = transport.register(kv_dst)
    driven = MooncakeTransport(driven=True)
    driven_dst = torch.zeros(top, dtype=torch.uint8)
    driven_local = driven.register(driven_dst)
    remote = Region(0, source["address"], top)
    peer = Peer(source["endpoint"], {0: remote})
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(source["zmq"])
    expected = pattern(top)
    bad: list[str] = []

    def round_trip() -> None:
        sock.send(b"where")
        if not sock.poll(int(TIMEOUT_S * 1000)):
            raise TimeoutError("the source's REP socket did not answer")
        sock.recv()

    def mooncake_read(nbytes: int) -> None:
        code = engine.batch_transfer_sync_read(
            source["endpoint"], [dst.data_ptr()], [source["address"]], [nbytes]
        )
        if code != 0:
            raise RuntimeError(f"batch_transfer_sync_read returned {code}")

    def kvxfer_read(segments: Segments) -> None:
        transport.read(segments, peer).result(TIMEOUT_S)

    asked: queue.SimpleQueue[Segments | None] = queue.SimpleQueue()
    driven_ms: queue.SimpleQueue[float | BaseException] = queue.SimpleQueue()

    def drive_reads() -> None:  # a consumer's loop, reduced to one read at a time
        while (segments := asked.get()) is not None:
            try:
                began = time.perf_counter()
                future = driven.read(segments, peer)
                while (due_in := driven.drive()) is not None:
                    time.sleep(due_in)
                future.result(0)
                driven_ms.put((time.perf_counter() - began) * 1e3)
            except BaseException as exc:  # reported on the reader's thread
                driven_ms.put(exc)

    driver = threading.Thread(target=drive_reads, name="driven-reads", daemon=True)
    driver.start()

    def driven_read(segments: Segments) -> float:
        asked.put(segments)
        result = driven_ms.get(timeout=TIMEOUT_S)
        if isinstance(result, BaseException):
            raise result
        return result

    def segments_of(nbytes: int, region_id: int) -> Segments:
        one = np.zeros(1, dtype=np.int64)
        return Segments(
            one, one.copy(), np.full(1, region_id, dtype=np.int64), one.copy(),
            np.full(1, nbytes, dtype=np.int64),
        )  # fmt: skip

    def timed(fn: Any, *args: Any) -> float:
        began = time.perf_counter()
        fn(*args)
        return (time.perf_counter() - began) * 1e3

    rows = []
    for nbytes in sizes:
        segments = segments_of(nbytes, local.region_id)
        driven_segments = segments_of(nbytes, driven_local.region_id)
        keys = ("floor", "mooncake", "zmq", "kvxfer", "driven")
        samples: dict[str, list[float]] = {k: [] for k in keys}
        for round_ in range(repeats + 1):  # the first is a warm-up
            for buffer in (dst, kv_dst, driven_dst):
                buffer[:nbytes].zero_()
            began = time.perf_counter()
            round_trip()
            mooncake_read(nbytes)
            floor = (time.perf_counter() - began) * 1e3
            moon = timed(mooncake_read, nbytes)
            rtt = timed(round_trip)
            kv = timed(kvxfer_read, segments)
            kv_driven = driven_read(driven_segments)
            for name, buffer in (("Mooncake's", dst), ("kvxfer's", kv_dst),
                                 ("kvxfer's driven", driven_dst)):  # fmt: skip
                if not torch.equal(buffer[:nbytes], expected[:nbytes]):
                    bad.append(f"{nbytes} bytes: {name} read differs")
            if round_:
                for key, value in zip(samples, (floor, moon, rtt, kv, kv_driven), strict=True):
                    samples[key].append(value)
        median = {k: statistics.median(v) for k, v in samples.items()}
        rows.append(
            {
                "bytes": nbytes,
                "floor_ms": round(median["floor"], 3),
                "mooncake_read_ms": round(median["mooncake"], 3),
                "zmq_round_trip_ms": round(median["zmq"], 3),
                "kvxfer_read_ms": round(median["kvxfer"], 3),
                "kvxfer_read_over_mooncake": round(median["kvxfer"] / median["mooncake"], 2),
                "kvxfer_driven_read_ms": round(median["driven"], 3),
                "kvxfer_driven_read_over_mooncake": round(median["driven"] / median["mooncake"], 2),
            }
        )
    asked.put(None)
    driver.join()
    sock.close()
    ctx.term()
    transport.close()
    driven.close()
    conn.send({"rows": rows, "bad": bad})


def measure(tokens: list[int], repeats: int) -> dict[str, Any]:
    """Start both processes, measure every size, stop them; the rows, by token count."""
    sizes = [t * BYTES_PER_TOKEN for t in tokens]
    ctx = multiprocessing.get_context("spawn")
    src_parent, src_child = ctx.Pipe()
    source = ctx.Process(target=source_main, args=(max(sizes), src_child), daemon=True)
    source.start()
    if not src_parent.poll(START_TIMEOUT_S):
        raise TimeoutError("the source process did not start")
    info = src_parent.recv()
    rd_parent, rd_child = ctx.Pipe()
    reader = ctx.Process(target=reader_main, args=(info, sizes, repeats, rd_child), daemon=True)
    reader.start()
    try:
        if not rd_parent.poll(START_TIMEOUT_S + repeats * len(sizes) * TIMEOUT_S):
            raise TimeoutError("the reader process did not finish")
        result = rd_parent.recv()
    finally:
        src_parent.send("stop")
        for proc in (reader, source):
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    for row, n in zip(result["rows"], tokens, strict=True):
        row["tokens"] = n
    return result


def figure(result: dict[str, Any]) -> tuple[str, str]:
    """The page's figure and targets: kvxfer's transport read, threaded and driven, against
    Mooncake's, per size."""
    parts = [
        f"{row['bytes'] / 2**20:g} MiB: Mooncake {row['mooncake_read_ms']} ms, kvxfer's "
        f"`MooncakeTransport.read` {row['kvxfer_read_ms']} ms "
        f"(**{row['kvxfer_read_over_mooncake']}×**), driven {row['kvxfer_driven_read_ms']} ms "
        f"(**{row['kvxfer_driven_read_over_mooncake']}×**)"
        for row in result["rows"]
    ]
    missed = [
        f"{row['bytes'] / 2**20:g} MiB {mode}"
        for row in result["rows"]
        for mode, key in READ_RATIOS
        if row[key] > TRANSPORT_TARGET
    ]
    targets = (
        f"transport, threaded and driven, within {TRANSPORT_TARGET}× of Mooncake at every size "
        f"({verdict(missed)})"
    )
    return "; ".join(parts), targets


def main(argv: list[str] | None = None) -> int:
    """Measure, print a table or one JSON object; 1 if a read failed or differed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=list(DEFAULT_TOKENS))
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json", action="store_true")
    BENCHMARK.add_record_flag(parser)
    args = parser.parse_args(argv)
    result = measure(args.tokens, args.repeats)
    if not result["bad"]:
        BENCHMARK.record(args.record, argv, result, figure)
    if args.json:
        print(json.dumps(result))
    else:
        keys = ["tokens", "bytes", "floor_ms", "mooncake_read_ms", "zmq_round_trip_ms",
                "kvxfer_read_ms", "kvxfer_read_over_mooncake", "kvxfer_driven_read_ms",
                "kvxfer_driven_read_over_mooncake"]  # fmt: skip
        print(" ".join(f"{k:>16}" for k in keys))
        for row in result["rows"]:
            print(" ".join(f"{row[k]:>16}" for k in keys))
        for problem in result["bad"]:
            print("BAD:", problem)
    return 1 if result["bad"] else 0


if __name__ == "__main__":
    sys.exit(main())
