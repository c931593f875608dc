"""kvxfer's core never imports vLLM: only the `kvxfer.integrations.vllm` package does (extra
`kvxfer[vllm]`); nor SGLang: only `kvxfer.integrations.sglang.conn` and `.manager` do (extra
`kvxfer[sglang]`; this environment has no SGLang)."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import importlib, os, pkgutil, sys
import kvxfer, kvxfer.kernels

def walk(path, prefix):
    # pkgutil.walk_packages imports every package to descend into it: vLLM's included.
    for m in pkgutil.iter_modules([path]):
        yield prefix + m.name
        if m.ispkg:
            yield from walk(os.path.join(path, m.name), prefix + m.name + ".")

names = list(walk(kvxfer.__path__[0], "kvxfer."))
names += list(walk(kvxfer.kernels.__path__[0], "kvxfer.kernels."))
assert "kvxfer.integrations.vllm.worker" in names and "kvxfer.kernels.copy_cells" in names, names
needs_an_engine = (
    "kvxfer.integrations.vllm",
    "kvxfer.integrations.sglang.conn",
    "kvxfer.integrations.sglang.manager",  # and its modules
)
for name in names:
    if not name.startswith(needs_an_engine):
        importlib.import_module(name)
engines = ("vllm", "sglang")
leaked = sorted(m for m in sys.modules if m.split(".")[0] in engines)
print(len(names), leaked)
"""


def test_only_the_integration_packages_import_their_engines():
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, check=True
    )
    count, leaked = out.stdout.split(" ", 1)
    assert int(count) > 30
    assert leaked.strip() == "[]"
