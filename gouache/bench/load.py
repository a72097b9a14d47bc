"""An open-loop load on an in-process engine: requests submitted at given gaps (Poisson
arrivals), each timed from its submission to its last image."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable

import numpy as np

from gouache.request import ImageRequest


async def run_load(engine, arrivals: list[tuple[float, Callable[[], list[ImageRequest]]]]) -> dict:
    """Submit `make()` after each `gap` seconds; wait for every image. Returns the wall time,
    requests per second and the mean and p90 latency."""
    latencies = []

    async def one(make) -> None:
        job = make()
        submitted = time.monotonic()
        await (await engine.submit(job)).images()
        latencies.append(time.monotonic() - submitted)

    start, tasks = time.monotonic(), []
    for gap, make in arrivals:
        await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(one(make)))
    await asyncio.gather(*tasks)
    elapsed = time.monotonic() - start
    return {"seconds": elapsed, "per_s": len(arrivals) / elapsed, "mean_latency_s": statistics.mean(latencies),
            "p90_latency_s": float(np.percentile(latencies, 90))}
