"""Summary statistics and timing shared by the benchmarks, profilers and the simulator, in plain
Python (no numpy, no torch), so that every table in gouache computes a percentile the same way."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterable


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) by linear interpolation between the two nearest ranks.

    This is numpy's default (`np.percentile(values, q)`, method "linear", Hyndman and Fan's
    type 7), reproduced to the last bit so that results computed with numpy before stay
    identical: the position is (n - 1) * q / 100 in the sorted values, and the weight is
    applied from the nearer end, as numpy does.
    """
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be between 0 and 100, got {q}")
    position = (len(ordered) - 1) * (q / 100)
    if position >= len(ordered) - 1:
        return ordered[-1]
    below = math.floor(position)
    low, high = ordered[below], ordered[below + 1]
    weight = position - below
    if weight >= 0.5:
        return high - (high - low) * (1 - weight)
    return low + (high - low) * weight


def median_s(fn, repeats: int, sync) -> float:
    """The median wall time of `fn` over `repeats` calls after one warm-up, each followed by
    `sync` (a device synchronisation, or nothing on a CPU)."""
    fn()  # warm-up
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
