"""A cost model corrected online by the steps it prices.

A cost model is measured on an idle device (`gouache profile`). A serving engine's steps take
longer than that: the stages (prompt encoding, VAE decode, image codecs) and the loop share the
host with the forward, and under load they run all the time. On the 2-core CPU the live tiers
run's steps took 1.29x their predictions at 2x load and 0.9-1.0x idle (docs/tiers.md), and a
deadline policy that plans with the idle figures packs too much beside a priority request.

`Calibrated` prices every step at the cost model's prediction times `scale`, an exponentially
weighted mean of measured over predicted seconds of the steps that ran. The engine loop, which
plans and observes in one thread, feeds it each step's wall time (launch to result). It scales
every prediction by one factor: contention slows every step alike, and the cost model keeps the
shape (which sizes and batches cost more).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from gouache.sched.interface import Resolution, StepTimePredictor

# one step's ratio moves the scale by this share of its distance: about the last 20 steps count
WEIGHT = 0.05
# a step this far from its prediction (a stall, a first-call warm-up) moves the scale no further
BOUNDS = (0.25, 4.0)


class Calibrated:
    """A `StepTimePredictor`: `base`'s step times times `scale`, the recent measured/predicted ratio."""

    def __init__(self, base: StepTimePredictor, weight: float = WEIGHT, scale: float = 1.0):
        """`scale` is where it starts (the simulator, whose steps all cost one known multiple of
        the prediction, starts it there and observes nothing)."""
        if not 0 < weight <= 1:
            raise ValueError(f"the calibration weight must be in (0, 1], got {weight}")
        if not scale > 0:
            raise ValueError(f"the starting scale must be positive, got {scale}")
        self.base = base
        self.weight = weight
        self.scale = scale
        self.observed = 0  # steps measured

    def step_time(self, resolutions: Sequence[Resolution], patched: bool, degree: int = 1) -> float:
        return self.base.step_time(resolutions, patched, degree) * self.scale

    def sizes(self, patched: bool) -> set[Resolution] | None:
        return self.base.sizes(patched)

    def observe(self, resolutions: Sequence[Resolution], patched: bool, degree: int, seconds: float) -> None:
        """A step over `resolutions` took `seconds` of wall time. Steps the cost model cannot
        price (a size it never saw) leave the scale as it is."""
        try:
            predicted = self.base.step_time(resolutions, patched, degree)
        except ValueError:
            return
        if not (math.isfinite(predicted) and predicted > 0 and math.isfinite(seconds) and seconds > 0):
            return
        ratio = min(max(seconds / predicted, BOUNDS[0]), BOUNDS[1])
        self.scale += self.weight * (ratio - self.scale)
        self.observed += 1
