"""benchmarks/gpu_kernels.py runs end to end (toy sizes, interpreter) and checks before timing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "gpu_kernels.py"


def test_gpu_benchmark_script_runs_at_toy_sizes():
    env = {**os.environ, "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "all kernels bit-exact" in done.stderr
    report = json.loads(done.stdout)
    assert [(r["layers"], r["tokens"]) for r in report["rows"]] == [(2, 32), (2, 64)]
    for row in report["rows"]:
        assert row["bytes"] == row["layers"] * 2 * row["tokens"] * 8 * 128 * 2
        assert {"gather_vs_copy", "scatter_vs_copy", "remap_vs_copy", "gather_vs_torch"} <= set(row)
