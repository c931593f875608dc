"""benchmarks/torch_copy.py runs end to end: `--quick --json` checks the CPU backend's pack and
unpack bit for bit against plain indexing (a mismatch exits non-zero), then times them alone
and from threads at once, and prints one JSON object of the documented shape (and records it
with `--record`). Its speed is never asserted."""

from __future__ import annotations

import json

from helpers import run_quick_benchmark

from kvxfer.testing.results import read_results


def test_quick_json_checks_both_copies(tmp_path):
    returncode, stdout, stderr = run_quick_benchmark("torch_copy.py", "--record", str(tmp_path))
    assert returncode == 0, stdout[-4000:] + stderr[-4000:]
    report = json.loads(stdout)
    assert report["config"]["checked"] is True
    rows = report["rows"]
    assert [(r["tokens"], r["direction"]) for r in rows] == [(16, "pack"), (16, "unpack")]
    for row in rows:
        assert row["bytes"] == 8 * 2 * 16 * 2 * 128 * 2  # layers, K/V, tokens, heads, dim, bf16
        assert row["threads"] == 2
        assert min(row["alone_us"], row["threads_wall_us"], row["threads_cpu_us"]) > 0

    # `--record DIR`: the run's result file, with what it printed and the figure made of it.
    (result,) = read_results(tmp_path).values()
    assert result.benchmark == "torch_copy" and result.rows == report
    assert result.command.endswith("torch_copy.py --quick --json --record")
    alone = {r["direction"]: r["alone_us"] for r in rows}
    assert (
        result.figure
        == f"16 tokens: pack {alone['pack']:.0f} µs, unpack {alone['unpack']:.0f} µs alone"
    )
