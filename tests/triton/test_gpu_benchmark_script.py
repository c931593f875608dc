"""benchmarks/gpu_kernels.py runs end to end at toy sizes (the interpreter, or CUDA): every
kernel check and the reshard end-to-end check pass, and they run before any timing."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvxfer import STRATEGIES

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "gpu_kernels.py"
IMPLS = {"new", "previous", "index_select", "per_block"}
DEVICE_TIMINGS = {"copy", "new", "previous", "index_select", "per_block"}
E2E_TIMINGS = {"new", "previous", "torch"}
KV_OPS = {"pack", "unpack", "remap_nhd_to_hnd", "remap_hnd_to_nhd"}


@pytest.fixture(scope="module")
def tiny_report() -> dict:
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


def test_every_kernel_check_passes_before_any_timing(tiny_report):
    checks, rows = tiny_report["checks"], tiny_report["rows"]
    assert checks and rows
    assert all(c["passed"] is True for c in checks), [c for c in checks if not c["passed"]]
    geometries = {(r["head_dim"], r["dtype"], r["heads_moved"], r["mla"]) for r in rows}
    for head_dim, dtype, heads_moved, mla in geometries:
        checked = {
            (c["op"], c["impl"])
            for c in checks
            if (c["head_dim"], c["dtype"], c["heads_moved"], c["mla"])
            == (head_dim, dtype, heads_moved, mla)
        }
        ops = {"pack", "unpack"} if mla else KV_OPS
        assert {(op, impl) for op in ops for impl in IMPLS} <= checked
    if tiny_report["new_device_timing"].startswith("prepare_cell_copy"):
        assert any(c["impl"] == "new_prepared" for c in checks)
    first_timing = min(r["seq"] for r in rows)
    assert max(e["seq"] for e in checks + tiny_report["reshard"]) < first_timing


def test_reshard_end_to_end_ran_for_every_strategy(tiny_report):
    entries = tiny_report["reshard"]
    for e in entries:
        assert e["backend"] == "triton"
        if e["passed"] is None:  # only an fp8 case, only while the spec rejects the dtype
            assert e["dtype"].startswith("float8") and "KVCacheSpec rejects dtype" in e["skipped"]
        else:
            assert e["passed"] is True, e
    for strategy in STRATEGIES:
        cases = {e["case"] for e in entries if e["strategy"] == strategy and e["passed"]}
        assert {"demo", "demo MLA"} <= cases, strategy
        assert any(c.endswith("tokens") for c in cases), strategy


def test_rows_carry_device_and_end_to_end_times(tiny_report):
    rows = tiny_report["rows"]
    assert {r["op"] for r in rows if not r["mla"]} == KV_OPS
    assert {r["op"] for r in rows if r["mla"]} == {"pack", "unpack"}
    assert {r["dtype"] for r in rows} == {"bfloat16", "float8_e4m3fn"}
    for r in rows:
        itemsize = 1 if r["dtype"].startswith("float8") else 2
        planes = 1 if r["mla"] else 2
        cells = r["layers"] * planes * r["tokens"] * r["heads_moved"] * r["head_dim"]
        assert r["bytes_moved"] == cells * itemsize
        assert set(r["device"]) == DEVICE_TIMINGS and set(r["e2e"]) == E2E_TIMINGS
        for stats in (*r["device"].values(), *r["e2e"].values()):
            assert stats["p10_ms"] <= stats["median_ms"] <= stats["p90_ms"], stats
            assert stats["reps"] == tiny_report["reps"]
        for stats in r["device"].values():
            assert stats["gbps"] > 0 and stats["vs_copy"] > 0
        assert r["device"]["copy"]["vs_copy"] == 1.0
    assert tiny_report["stopped"] is None


@pytest.fixture(scope="module")
def script_module():
    """The script imported as a module (it prepends its folder to sys.path; undone after)."""
    saved_path = list(sys.path)
    spec = importlib.util.spec_from_file_location("gpu_kernels", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_kernels"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    sys.path[:] = saved_path
    for name in ("gpu_kernels", "previous_kernel"):
        sys.modules.pop(name, None)


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
    assert "x copy" in out and "kernel checks:" in out
    lines = out.splitlines()
    for op in ("pack", "unpack"):
        assert sum(line.split()[0] == op for line in lines if line) == sum(
            r["op"] == op for r in tiny_report["rows"]
        )
