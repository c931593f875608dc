"""benchmarks/gpu_kernels.py runs end to end at toy sizes (the interpreter, or CUDA): every op
of every geometry of its grid gets a row with each implementation's times. What it times is
checked bit for bit by tests/kernels/test_cuda_kernels.py (`pytest -m cuda`; at toy sizes under the
interpreter too)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import load_benchmark, shared_result

# Runs the Triton kernels: on CUDA, or on CPU under TRITON_INTERPRET=1 (tests/conftest.py).
pytestmark = pytest.mark.interpreter

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "gpu_kernels.py"
DEVICE_TIMINGS = {"copy", "new", "index_select", "per_block"}
E2E_TIMINGS = {"new", "torch"}
KV_OPS = {"pack", "unpack", "remap_nhd_to_hnd", "remap_hnd_to_nhd"}


def _run_tiny() -> dict:
    env = {
        **os.environ,
        "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1"),
        "MC_LOG_LEVEL": "ERROR",
    }
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory) -> dict:
    """One `--tiny --json` run of the script for the whole test run (xdist workers share it)."""
    return shared_result(tmp_path_factory, "gpu-kernels-tiny", _run_tiny)


def test_rows_carry_device_and_end_to_end_times(tiny_report, script_module):
    rows = tiny_report["rows"]
    assert {r["op"] for r in rows if not r["mla"]} == KV_OPS
    assert {r["op"] for r in rows if r["mla"]} == {"pack", "unpack"}
    assert {r["dtype"] for r in rows} == {"bfloat16", "float8_e4m3fn"}
    conversions = {r["conversion"] for r in rows} - {None}
    assert conversions == {"bfloat16->float8_e4m3fn", "float8_e4m3fn->bfloat16"}
    for r in rows:
        # The destination's bytes: of a conversion, the dtype it converts to.
        written = r["conversion"].split("->")[1] if r["conversion"] else r["dtype"]
        itemsize = 1 if written.startswith("float8") else 2
        planes = 1 if r["mla"] else 2
        cells = r["layers"] * planes * r["tokens"] * r["heads_moved"] * r["head_dim"]
        assert r["bytes_moved"] == cells * itemsize
        assert set(r["device"]) == DEVICE_TIMINGS and set(r["e2e"]) == E2E_TIMINGS
        # Only kvxfer's kernel (and its torch twin) convert; the other implementations copy bits.
        bits_only = {"index_select", "per_block"} if r["conversion"] else set()
        for stats in (*(v for k, v in r["device"].items() if k not in bits_only),
                      *(v for k, v in r["e2e"].items() if k not in bits_only)):  # fmt: skip
            assert stats["p10_ms"] <= stats["median_ms"] <= stats["p90_ms"], stats
            assert stats["reps"] == tiny_report["reps"]
        for name in bits_only:
            for stats in (r["device"][name], r["e2e"].get(name, {"skipped": "does not convert"})):
                assert "does not convert" in stats["skipped"], (name, stats)
        for name, stats in r["device"].items():
            if name not in bits_only:
                assert stats["gbps"] > 0 and stats["vs_copy"] > 0
        assert r["device"]["copy"]["vs_copy"] == 1.0
    assert tiny_report["stopped"] is None
    ops = {g.kernel_variant(): set(g.ops) for g in script_module.tiny_grid()}
    timed: dict[tuple, set[str]] = {}
    for r in rows:
        variant = (r["head_dim"], r["dtype"], r["heads_moved"], r["mla"], r["wire_dtype"])
        timed.setdefault(variant, set()).add(r["op"])
    assert timed == ops


@pytest.fixture(scope="module")
def script_module():
    """The script imported as a module."""
    return load_benchmark("gpu_kernels")


def test_full_grid_covers_the_sizes_and_the_default_is_a_subset(script_module):
    full = script_module.full_grid()
    kv = [g for g in full if not g.mla]
    assert {g.layers for g in full} == {32, 80}
    assert {g.tokens for g in full} == {1024, 4096, 16384, 32768, 65536, 131072}
    assert {g.heads_moved for g in kv} == {8, 4, 2, 1}
    assert {g.head_dim for g in kv} == {64, 128, 256}
    assert {g.dtype for g in full} == {"bfloat16", "float8_e4m3fn"}
    assert {(g.head_dim, g.heads_moved) for g in full if g.mla} == {(576, 1)}
    default = script_module.default_grid()
    assert set(default) < set(full)
    assert {g.mla for g in default} == {False, True}
    assert {g.dtype for g in default} == {"bfloat16", "float8_e4m3fn"}


def test_table_prints_every_row(tiny_report, script_module, capsys):
    script_module.print_table(tiny_report)
    out = capsys.readouterr().out
    assert "x copy" in out and "new kernel device time:" in out
    lines = out.splitlines()
    for op in ("pack", "unpack"):
        assert sum(line.split()[0] == op for line in lines if line) == sum(
            r["op"] == op for r in tiny_report["rows"]
        )
