"""`kvxfer plan` prints the plan, as a table or as JSON."""

from __future__ import annotations

import json
import subprocess
import sys

from kvxfer.cli import main

ARGS = [
    "plan",
    "--prefill-tp",
    "3",
    "--decode-tp",
    "4",
    "--kv-heads",
    "12",
    "--prefill-block-size",
    "16",
    "--decode-block-size",
    "48",
    "--decode-layout",
    "HND",
    "--num-layers",
    "4",
    "--head-dim",
    "64",
    "--tokens",
    "300",
]


def test_plan_json(capsys):
    assert main([*ARGS, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    pairs = report["pairs"]
    assert [(p["src_rank"], p["dst_rank"], p["heads"]) for p in pairs] == [
        (0, 0, [0, 3]),
        (0, 1, [3, 4]),
        (1, 1, [4, 6]),
        (1, 2, [6, 8]),
        (2, 2, [8, 9]),
        (2, 3, [9, 12]),
    ]
    for p in pairs:
        heads = p["heads"][1] - p["heads"][0]
        assert p["bytes"] == 4 * 2 * 300 * heads * 64 * 2
        assert set(p["estimates"]) == {"direct", "pack", "unpack", "pack+unpack"}
        best = min(p["estimates"].values(), key=lambda e: e["estimated_seconds"])
        assert p["estimated_seconds"] == best["estimated_seconds"]
    assert report["total"]["bytes"] == 4 * 2 * 300 * 12 * 64 * 2


def test_plan_forced_strategy(capsys):
    assert main([*ARGS, "--json", "--strategy", "direct"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {p["strategy"] for p in report["pairs"]} == {"direct"}


def test_plan_table_runs_as_a_command():
    out = subprocess.run(
        [sys.executable, "-m", "kvxfer.cli", *ARGS], capture_output=True, text=True, check=True
    ).stdout
    assert "prefill TP 3 bs 16 NHD/kv_first  ->  decode TP 4 bs 48 HND/kv_first" in out
    assert "0->1" in out and "[3,4)" in out
    assert "total: 6 pairs" in out


def test_plan_reports_bad_geometry(capsys):
    assert main(["plan", "--kv-heads", "6", "--decode-tp", "4"]) == 2
    assert (
        "num_kv_heads: 6 KV heads cannot be split evenly over tp_size 4" in capsys.readouterr().err
    )
