"""A short run of the real-engine soak (`benchmarks/pd_soak.py`): a prefill engine SIGKILLed
and restarted, frozen (SIGSTOP) for 30 s, a decode engine restarted, 8 clients throughout, on
kvxfer's default settings. Every completed output equals one engine's, nothing stays waiting
for remote KV, both engines' KV caches drain to empty, and no load is reported failed outside
a fault's window. The figures of a longer run are in benchmarks/RESULTS.md (the soak's row)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import observe

ROOT = Path(__file__).resolve().parents[2]
MINUTES = 3
# The run, its three faults' recoveries (engines start again: about a minute each here) and
# the final settle; the soak bounds each of its own waits.
TIMEOUT_S = 1500


def test_a_short_soak_with_faults_keeps_every_output_and_leaks_nothing(tmp_path):
    command = [
        sys.executable,
        str(ROOT / "benchmarks" / "pd_soak.py"),
        "--minutes",
        str(MINUTES),
        "--json",
        "--out-dir",
        str(tmp_path),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT)
    lines = done.stdout.strip().splitlines()
    assert lines, f"no output (rc {done.returncode}): {done.stderr[-3000:]}"
    result = json.loads(lines[-1])
    observe(case="soak", **{k: result[k] for k in ("completed", "failed_in_faults", "seconds")})
    assert [f["kind"] for f in result["faults"]] == [
        "prefill_killed",
        "prefill_frozen",
        "decode_restarted",
    ]
    assert result["completed"] > 0 and result["compared"] > 0
    for key in ("wrong_outputs", "stuck", "leaked_blocks", "spurious_dead"):
        assert result[key] == 0, f"{key}: {json.dumps(result)}"  # whole: CI shows the message
    assert result["failed_outside_faults"] == 0, result["errors"]
    assert done.returncode == 0, done.stderr[-3000:]
