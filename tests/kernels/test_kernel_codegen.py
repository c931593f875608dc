"""The cell-copy kernel's code for sm_90, read without a GPU: 16-byte accesses, no spills and
no 64-bit division in every configuration whose alignment check passes."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers import REPO

SCRIPT = REPO / "benchmarks" / "kernel_codegen.py"


def test_every_aligned_configuration_compiles_to_16_byte_accesses_without_spills():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--json", "--check"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout)["rows"]
    configs = " ".join(r["config"] for r in rows)
    kinds = ("pack", "unpack", "remap", "mirror", "MLA", "fp8", "kv_inner", "heads")
    conversions = ("bfloat16->float8_e4m3fn", "bfloat16->float8_e5m2", "float8_e4m3fn->bfloat16")
    for kind in (*kinds, *conversions):
        assert kind in configs, f"no {kind} configuration compiled"
    aligned = [r for r in rows if r["aligned"]]
    assert len(aligned) >= 15
    for row in aligned:
        assert (row["ld_bits"], row["st_bits"]) == (128, 128), row
        assert row["spill_bytes"] == 0, row
        assert not row["div64"], row
        assert 0 < row["registers"] <= 255, row
    # The narrow variant exists for rows the host could not prove aligned, and is visible.
    narrow = [r for r in rows if not r["aligned"]]
    assert narrow and all(r["ld_bits"] < 128 for r in narrow)
