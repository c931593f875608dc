"""Shared test set-up. Its folder is put on sys.path, so tests import `helpers` from here, also
the Triton tests in tests/triton, which run in their own pytest invocation (see Makefile).

`make unit` runs the suite in parallel (pytest-xdist). Tests are isolated from the other
workers: ports are the kernel's (port 0), temporary files under `tmp_path`, rank processes
started by each worker's own forkserver (`kvxfer.testing.processes`). A module- or
session-scoped fixture runs once per worker that runs a test using it; one that costs much and
needs computing once (the benchmark run of tests/triton/test_gpu_benchmark_script.py) shares
its result through a file under the workers' common temporary folder
(`helpers.shared_result`).
"""
