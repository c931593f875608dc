"""benchmarks/torch_copy.py runs end to end: `--quick --json` checks the CPU backend's pack and
unpack bit for bit against plain indexing (a mismatch exits non-zero), then times them alone
and from threads at once, and prints one JSON object of the documented shape. Its speed is
never asserted."""

from __future__ import annotations

import json

from helpers import run_quick_benchmark


def test_quick_json_checks_both_copies():
    returncode, stdout, stderr = run_quick_benchmark("torch_copy.py")
    assert returncode == 0, stdout[-4000:] + stderr[-4000:]
    report = json.loads(stdout)
    assert report["config"]["checked"] is True
    rows = report["rows"]
    assert [(r["tokens"], r["direction"]) for r in rows] == [(16, "pack"), (16, "unpack")]
    for row in rows:
        assert row["bytes"] == 8 * 2 * 16 * 2 * 128 * 2  # layers, K/V, tokens, heads, dim, bf16
        assert row["threads"] == 2
        assert min(row["alone_us"], row["threads_wall_us"], row["threads_cpu_us"]) > 0
