"""Timing for the benchmarks and studies: one way to take a median, shared by every script."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_seconds(run: Callable[[], object], repeats: int) -> float:
    """Median wall time of `repeats` calls of `run`, after one untimed warm-up call."""
    run()
    samples = []
    for _ in range(repeats):
        began = time.perf_counter()
        run()
        samples.append(time.perf_counter() - began)
    return statistics.median(samples)
