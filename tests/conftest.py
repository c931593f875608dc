"""Shared test set-up. Its folder is put on sys.path, so tests in every subfolder import
`helpers` from here.

The folders mirror the package (`plan/`, `kernels/`, `connector/`, `session/`, `spec/`, ...);
how a test runs is a marker, not a folder:

- `interpreter`: runs the Triton kernels, on CUDA or on CPU under `TRITON_INTERPRET=1`, which
  takes effect only when set before `kvxfer.kernels` is imported: `make unit` runs these
  (`-m "interpreter or cuda"`) in a pytest process of their own, and skips them elsewhere
  without CUDA;
- `cuda`: the GPU correctness checks (`pytest -m cuda`), at toy sizes under the interpreter.

The engine suites keep folders of their own because they need other environments
(`integration_vllm/`, `integration_sglang/`, `e2e/`: `make test-vllm`, `make test-sglang`,
`make test-e2e`), and `faults/` is the fault suite of real processes and signals.

`make unit` runs the suite in parallel (pytest-xdist). Tests are isolated from the other
workers: ports are the kernel's (port 0), temporary files under `tmp_path`, rank processes
started by each worker's own forkserver (`kvxfer.testing.processes`). A module- or
session-scoped fixture runs once per worker that runs a test using it; one that costs much and
needs computing once (the benchmark run of tests/benchmarks/test_gpu_benchmark_script.py)
shares its result through a file under the workers' common temporary folder
(`helpers.shared_result`).
"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the `interpreter` tests where the Triton kernels cannot run (no CUDA, and
    TRITON_INTERPRET=1 not set before kvxfer.kernels was imported)."""
    if not any(item.get_closest_marker("interpreter") for item in items):
        return
    import torch

    from kvxfer.kernels.copy_cells import INTERPRETED

    if INTERPRETED or torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA or TRITON_INTERPRET=1 (make test sets it)")
    for item in items:
        if item.get_closest_marker("interpreter"):
            item.add_marker(skip)
