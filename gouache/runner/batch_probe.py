"""How many requests pay to run at once on this device (`gouache serve --max-batch-size auto`).

Batching pays while a step of twice the requests costs less per image: on a CPU or a GPU that
small images leave idle, a step's cost is mostly fixed, and a larger batch spreads it; once the
device is busy, twice the requests take twice as long and a larger batch only makes each of
them slower. At start, before serving, the probe times one denoising step of 1, 2, 4, ...
requests of the model's default size (with its default guidance, CFG rows included) and keeps
doubling while the time per image falls by at least `MIN_GAIN` and a step stays within
`STEP_BUDGET_S` (a longer step delays every request's progress and the admission of new ones).
A batch the device has no memory for runs one request at a time (the runner's retry), which
does not pay, so the probe ends at the last batch that fit.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from gouache.request import ImageRequest
from gouache.sched.plan import Batch

log = logging.getLogger(__name__)

LIMIT = 64  # the most requests the probe tries
MIN_GAIN = 0.10  # the least fall in time per image that makes twice the requests pay
STEP_BUDGET_S = 1.0  # the longest step the probe lets the batch grow to
REPEATS = 3  # timed steps per batch size (the least is kept: other work only adds time)


@dataclass(frozen=True)
class Probe:
    max_batch: int  # requests that pay to run at once
    step_s: dict[int, float]  # requests -> seconds of one step of them, as measured

    def describe(self) -> str:
        steps = ", ".join(f"{n}: {1e3 * s / n:.1f} ms" for n, s in self.step_s.items())
        return f"max batch size {self.max_batch} (step time per image by requests: {steps})"


def probe_max_batch(runner, size: tuple[int, int], guidance: float, limit: int = LIMIT, step_s=None) -> Probe:
    """The largest batch of requests of `size` ((h, w)) whose step costs less per image, by
    MIN_GAIN, than half of it, on `runner`'s device (see the module's docstring). `step_s(runner,
    ids)`: seconds of a step of `ids` (default: timed on the runner)."""
    step_s = step_s or _step_s
    h, w = size
    steps = (REPEATS + 1) * limit.bit_length()  # enough for every batch size the probe may try
    ids: list[str] = []
    times: dict[int, float] = {}
    best, n = 1, 1
    try:
        while n <= limit:
            while len(ids) < n:
                rid = f"probe-{len(ids)}"
                # request i steps in every batch from the first of at least i + 1 requests on
                runner.prepare(ImageRequest(rid, "a probe", w, h, steps, guidance, seed=len(ids)))
                ids.append(rid)
            times[n] = step_s(runner, tuple(ids[:n]))
            if n > 1 and times[n] / n > (1 - MIN_GAIN) * times[n // 2] / (n // 2):
                break
            best = n
            if times[n] > STEP_BUDGET_S:
                break
            n *= 2
    finally:
        for rid in ids:
            runner.release(rid)
    return Probe(best, times)


def _step_s(runner, ids: tuple[str, ...]) -> float:
    """The least seconds of REPEATS steps of `ids` after one untimed step."""
    seconds = []
    for i in range(REPEATS + 1):
        start = time.perf_counter()
        output = runner.execute(Batch(ids))
        if output.failed:
            raise RuntimeError(f"the batch probe's step failed: {next(iter(output.failed.values()))}")
        if i:
            seconds.append(time.perf_counter() - start)
    return min(seconds)
