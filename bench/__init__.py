"""Benchmarks: each script compares ours with a naive baseline in the same run and ends with a `result:` line."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def timed(fn: Callable[[], Any], repeats: int) -> float:
    """Median milliseconds of ``repeats`` calls of ``fn``, after one warm-up call."""
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1000
