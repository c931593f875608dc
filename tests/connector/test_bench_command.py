"""`kvxfer bench --json` runs end to end at toy sizes and reports what it promises."""

from __future__ import annotations

import json

from kvxfer.cli import main


def test_bench_json_rows(capsys):
    code = main(
        [
            "bench",
            "--pairs",
            "2:4",
            "--tokens",
            "64",
            "--layers",
            "2",
            "--kv-heads",
            "4",
            "--head-dim",
            "16",
            "--repeat",
            "1",
            "--json",
        ]
    )
    assert code == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    (row,) = rows
    assert row["pair"] == "2->4"
    assert row["bytes"] == 2 * 2 * 64 * 4 * 16 * 2  # layers, K/V, tokens, heads, dim, bf16
    assert row["naive_ops"] == 4 * 2 * 2 * 64  # pairs x layers x K/V x tokens
    for key in ("kvxfer_gbps", "contiguous_gbps", "naive_gbps"):
        assert row[key] > 0
