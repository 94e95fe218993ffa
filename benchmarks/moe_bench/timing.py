"""The timing loop of every row and of the device's rates."""

from __future__ import annotations

import statistics
import time


def time_calls(fn, args, sync, samples, inner):
    """Median per-call ms over `samples` syncs of `inner` back-to-back calls, after warm-up."""
    for _ in range(3):
        sync(fn(*args))
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        for _ in range(inner):
            out = fn(*args)
        sync(out)
        times.append((time.perf_counter() - start) * 1e3 / inner)
    return statistics.median(times), min(times)
