"""benchmarks/streaming.py runs end to end: `--quick --json` starts a prefill and a decode
process, fetches every request whole and streamed (the prefill simulated layer by layer), checks
every byte, and prints one JSON object of the documented shape. Its speed is never asserted."""

from __future__ import annotations

import json

from helpers import run_quick_benchmark

QUICK_TOKENS = [256, 1024]


def test_quick_json_checks_every_fetch():
    returncode, stdout, stderr = run_quick_benchmark("streaming.py")
    # 0 only when every fetch, whole and streamed, was ok and matched kvxfer.reference byte for
    # byte (a byte read before its layer was marked ready would not).
    assert returncode == 0, stdout[-4000:] + stderr[-4000:]
    report = json.loads(stdout)
    rows = report["rows"]
    assert [r["tokens"] for r in rows] == QUICK_TOKENS
    for row in rows:
        assert set(row) == {"tokens", "layers", "whole_ms", "tail_ms", "layer_ms"}
        assert row["layers"] == 8
        assert row["whole_ms"] > 0 and row["tail_ms"] > 0
        # Both are rounded to 0.01 ms from one unrounded value: 88.28 / 8 may print as 11.03.
        assert abs(row["layer_ms"] - row["whole_ms"] / 8) <= 0.01
    assert [t["tokens"] for t in report["targets"]] == QUICK_TOKENS
    checks = report["checks"]
    rounds = report["config"]["repeats"] + report["config"]["warmup_rounds"]
    # Per round: the fixed-cost fetch, then each size whole and streamed.
    assert checks["fetches"] == checks["fetches_ok"] == rounds * (1 + 2 * len(QUICK_TOKENS))
    assert checks["bad_blocks"] == 0 and checks["passed"]
    assert report["errors"] == []
