"""kvxfer's core never imports vLLM: only `kvxfer.integrations.vllm` does (extra `kvxfer[vllm]`)."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import importlib, pkgutil, sys
import kvxfer, kvxfer.kernels
names = [m.name for m in pkgutil.walk_packages(kvxfer.__path__, "kvxfer.")]
names += [m.name for m in pkgutil.walk_packages(kvxfer.kernels.__path__, "kvxfer.kernels.")]
assert "kvxfer.integrations.vllm" in names and "kvxfer.kernels.copy_cells" in names, names
for name in names:
    if name != "kvxfer.integrations.vllm":
        importlib.import_module(name)
leaked = sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm."))
print(len(names), leaked)
"""


def test_only_the_integration_module_imports_vllm():
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, check=True
    )
    count, leaked = out.stdout.split(" ", 1)
    assert int(count) > 30
    assert leaked.strip() == "[]"
