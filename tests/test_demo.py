"""`kvxfer demo`: differently sharded prefill and decode groups, in processes, generate exactly
what one unsharded model generates."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from kvxfer.examples.pd_demo import DemoOptions, _report


def run_demo(*args: str) -> tuple[int, dict]:
    done = subprocess.run(
        [sys.executable, "-m", "kvxfer.cli", "demo", "--json", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    return done.returncode, json.loads(done.stdout)


@pytest.mark.parametrize(
    "args",
    [
        pytest.param([], id="default-P2-D4-bs16-bs32-NHD-HND"),
        pytest.param(
            [
                "--prefill-tp",
                "3",
                "--decode-tp",
                "4",
                "--prefill-block-size",
                "32",
                "--decode-block-size",
                "16",
                "--prefill-placement",
                "kv_inner",
                "--decode-placement",
                "blocks_first",
                "--prompt-tokens",
                "120",
                "--decode-tokens",
                "6",
            ],
            id="P3-D4-bs32-bs16-kv_inner-blocks_first",
        ),
        pytest.param(
            [
                "--model",
                "mla",
                "--prefill-tp",
                "4",
                "--decode-tp",
                "2",
                "--prompt-tokens",
                "90",
                "--decode-tokens",
                "6",
            ],
            id="MLA-P4-D2",
        ),
        pytest.param(
            [
                "--kv-heads",
                "2",
                "--prefill-tp",
                "1",
                "--decode-tp",
                "4",
                "--prompt-tokens",
                "70",
                "--decode-tokens",
                "4",
                "--strategy",
                "pack",
            ],
            id="P1-D4-replicated-pack",
        ),
    ],
)
def test_demo_matches_the_unsharded_model(args):
    code, report = run_demo(*args)
    assert report["match"], report
    assert code == 0
    assert report["tokens"] == report["reference_tokens"]
    assert report["logits_max_abs_diff"] == 0
    assert report["bytes"] > 0 and report["num_ops"] > 0 and report["transfer_seconds"] > 0
    assert report["strategies"]
    assert all(r == ["demo-request"] for r in report["released"])


def test_a_different_last_logit_is_a_mismatch():
    logits = np.zeros(8, dtype=np.float32)
    reports = [
        {
            "rank": 0,
            "result": {"ok": True, "bytes": 1, "num_ops": 1, "seconds": 0.1, "errors": []},
            "plans": [],
            "tokens": [1, 2],
            "logits": logits,
        }
    ]
    import torch

    want = torch.from_numpy(logits.copy())
    assert _report(DemoOptions(), reports, [], [1, 2], want)["match"]
    want[3] = 1e-7
    assert not _report(DemoOptions(), reports, [], [1, 2], want)["match"]
    assert not _report(DemoOptions(), reports, [], [1, 3], torch.from_numpy(logits))["match"]


def test_bad_geometry_is_refused_with_the_field_named():
    done = subprocess.run(
        [sys.executable, "-m", "kvxfer.cli", "demo", "--decode-tp", "5"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "num_kv_heads" in done.stderr
