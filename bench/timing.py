"""Timing shared by the benchmarks: the median of repeated calls after one warm-up."""

from __future__ import annotations

import statistics
import time


def median_ms(fn, repeats: int, *, clock=time.perf_counter, pick=statistics.median) -> float:
    """Milliseconds of `fn()` on `clock` (wall by default; time.thread_time for this thread's
    CPU), `pick` of `repeats` calls after one warm-up call (statistics.median, or
    median_high for the upper middle of an even count)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return 1000 * pick(times)
