"""benchmarks/latency.py runs end to end: `--quick --json` starts the prefill and decode
processes (one per engine, or with `--rank-processes` one per rank), fetches every request on
all four decode ranks, checks every byte, stops by itself, and prints one JSON object of the
documented shape. Its speed is never asserted."""

from __future__ import annotations

import json

import pytest
from helpers import run_quick_benchmark

QUICK_TOKENS = [16, 128]
QUIET_FLOOR_TIMES = ("mooncake_read_ms", "zmq_round_trip_ms", "kvxfer_read_ms",
                     "kvxfer_driven_read_ms")  # fmt: skip


@pytest.mark.parametrize(
    "flags,processes",
    [((), {"prefill": 1, "decode": 1}), (("--rank-processes",), {"prefill": 2, "decode": 4})],
)
def test_quick_json_checks_every_fetch(flags, processes):
    returncode, stdout, stderr = run_quick_benchmark("latency.py", *flags)
    # 0 only when every fetch was ok, every fetched byte matched kvxfer.reference, every
    # floor read matched and every published request was released.
    assert returncode == 0, stdout[-4000:] + stderr[-4000:]
    report = json.loads(stdout)
    assert set(report) >= {"rows", "concurrent", "idle_cpu", "config", "checks"}

    rows = report["rows"]
    assert [r["tokens"] for r in rows] == QUICK_TOKENS
    for row in rows:
        assert set(row) == {
            "tokens", "bytes", "kvxfer_ms", "floor_ms", "ratio", "quiet_floor_ms",
            "ratio_to_quiet_floor",
        }  # fmt: skip
        assert row["bytes"] == 8 * 2 * 8 * 128 * 2 * row["tokens"]
        assert row["kvxfer_ms"] > 0 and row["floor_ms"] > 0 and row["ratio"] > 0
        assert row["quiet_floor_ms"] > 0
        assert row["ratio_to_quiet_floor"] == row["kvxfer_ms"] / row["quiet_floor_ms"]

    concurrent = report["concurrent"]
    assert set(concurrent) == {
        "requests", "tokens", "kvxfer_per_s", "floor_serial_per_s", "ratio",
        "quiet_floor_serial_per_s", "ratio_to_quiet_floor",
    }  # fmt: skip
    assert concurrent["requests"] == 4 and concurrent["tokens"] == 256
    assert concurrent["kvxfer_per_s"] > 0 and concurrent["floor_serial_per_s"] > 0

    assert set(report["idle_cpu"]) == {"prefill", "decode"}
    assert all(v >= 0 for v in report["idle_cpu"].values())

    # The quiet floor (benchmarks/floor.py): its own two processes, every read checked, and
    # kvxfer's transport reading the same bytes beside Mooncake's own call.
    quiet = report["quiet_floor"]
    assert quiet["bad"] == []
    assert [r["tokens"] for r in quiet["rows"]] == sorted({*QUICK_TOKENS, 256})
    for row in quiet["rows"]:
        assert row["bytes"] == 8 * 2 * 8 * 128 * 2 * row["tokens"]
        assert min(row[key] for key in QUIET_FLOOR_TIMES) > 0

    checks = report["checks"]
    assert checks["passed"], checks
    assert checks["quiet_floor_reads_bad"] == 0
    rounds = report["config"]["repeats"] + report["config"]["warmup_rounds"]
    requests = rounds * (len(QUICK_TOKENS) + concurrent["requests"])
    assert checks["fetches"] == checks["fetches_ok"] == 4 * requests  # four decode ranks each
    assert checks["bad_blocks"] == 0 and checks["bytes_checked"] > 0
    assert checks["published"] == checks["released"] == requests
    assert report["errors"] == []
    assert report["config"]["prefill"] == {"tp": 2, "block_size": 16, "layout": "NHD"}
    assert report["config"]["decode"] == {"tp": 4, "block_size": 32, "layout": "HND"}
    assert report["config"]["processes"] == processes
