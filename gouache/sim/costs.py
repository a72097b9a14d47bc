"""What the simulator charges: the step cost of a batch, the stage work of a request, the
hand-off of a request that changes devices, and the stand-ins and adapters that price them.
Pixels throughout; nothing here imports torch."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from gouache.request import RequestState, Tier
from gouache.sched.interface import Resolution, StepTimePredictor
from gouache.sched.plan import Batch
from gouache.sched.router import RouteRequest
from gouache.sim.workloads import SimRequest

# seconds of one step of a batch (its members now) on its devices
StepCost = Callable[[Batch, dict[str, RequestState]], float]
# seconds of device work a request costs outside its steps: (preparation on arrival, post-processing when done)
StageCost = Callable[[RequestState], tuple[float, float]]
# seconds to bring a started request's latents and embeddings to the devices of its next batch
HandoffCost = Callable[[RequestState], float]

@dataclass(frozen=True)
class LinearStepCost:
    """cost of a forward = per_forward_s + megapixels in it x per_megapixel_s, on one device.

    A stand-in for tests and examples until the profiled cost models (`gouache.sched.costmodel`)
    plug in: a forward has a fixed launch cost and work grows with pixels, nothing else (no
    batching saturation, no patching overhead, no masks, no parallelism). It is also a
    `StepTimePredictor`, so SLO-aware policies can plan with exactly the cost the simulator
    charges.
    """

    per_megapixel_s: float = 0.0  # per million image pixels in a forward
    per_forward_s: float = 0.0  # per forward pass (one per batch of a plan)

    def __call__(self, batch: Batch, states: dict[str, RequestState]) -> float:
        if batch.degree != 1:
            raise ValueError("the linear stand-in prices one device; give a parallel cost model for degrees > 1")
        return self._forward([states[rid].resolution for rid in batch.request_ids])

    def step_time(self, resolutions: Sequence[Resolution], patched: bool, degree: int = 1) -> float:
        """The same cost: one forward if patched, else one per distinct resolution."""
        if degree != 1:
            return math.inf
        if patched:
            return self._forward(resolutions)
        by_resolution: dict[tuple[int, int], list[Resolution]] = {}
        for res in resolutions:
            by_resolution.setdefault(tuple(res), []).append(res)
        return sum(self._forward(group) for group in by_resolution.values())

    def sizes(self, patched: bool) -> None:
        return None

    def batch_step_time(self, batch: Sequence[RouteRequest]) -> float:
        """The same cost of one forward over the router's view of requests, an edit counting
        its masked pixels only: the mask-aware router's cost model."""
        pixels = sum(r.pixels * r.mask_ratio for r in batch)
        return self.per_forward_s + pixels / 1e6 * self.per_megapixel_s

    def _forward(self, resolutions: Sequence[Resolution]) -> float:
        pixels = sum(h * w for h, w in resolutions)
        return self.per_forward_s + pixels / 1e6 * self.per_megapixel_s


def linear_step_cost(per_megapixel_s: float = 0.0, per_forward_s: float = 0.0) -> LinearStepCost:
    """The default step cost for tests and examples; see `LinearStepCost`."""
    return LinearStepCost(per_megapixel_s, per_forward_s)


@dataclass(frozen=True)
class PredictedStepCost:
    """A `StepCost` from a `StepTimePredictor` (a `BatchCostModel` from `gouache profile`, a
    `ParallelCostModel`): the batch's forward at its degree, times `scale` (a device that runs
    faster or slower than when it was profiled)."""

    predictor: StepTimePredictor
    scale: float = 1.0

    def __call__(self, batch: Batch, states: dict[str, RequestState]) -> float:
        resolutions = [states[rid].resolution for rid in batch.request_ids]
        return self.scale * self.predictor.step_time(resolutions, batch.patched, batch.degree)


@dataclass(frozen=True)
class LinearHandoff:
    """`HandoffCost`: a fixed latency plus a time per megapixel of the request's image (its
    latents grow with pixels; its text embeddings are in the fixed part)."""

    fixed_s: float
    per_megapixel_s: float
    source: str = ""  # where the two numbers come from

    def __call__(self, state: RequestState) -> float:
        return self.fixed_s + state.pixels / 1e6 * self.per_megapixel_s


def load_handoff(path: str | Path) -> LinearHandoff | None:
    """The hand-off a parallel cost model's JSON carries (`gouache profile --devices`), if any."""
    entry = json.loads(Path(path).read_text()).get("handoff")
    if entry is None:
        return None
    return LinearHandoff(entry["fixed_s"], entry["per_megapixel_s"], entry.get("source", str(path)))


def standalone_latency(step_cost: StepCost) -> Callable[..., float]:
    """(width, height, steps[, frames]) -> seconds for one request (or clip) alone on one device
    under `step_cost`.

    Pass it to `make_workload` to set SLOs as a multiple of the standalone latency.
    """
    def latency(width: int, height: int, steps: int, frames: int = 1) -> float:
        state = state_of(SimRequest("solo", 0.0, width, height, steps, frames=frames))
        return steps * step_cost(Batch(("solo",)), {"solo": state})
    return latency


def state_of(request: SimRequest) -> RequestState:
    return RequestState(
        request_id=request.request_id,
        resolution=request.resolution,
        num_steps=request.steps,
        arrival_time=request.arrival,
        deadline=request.deadline,
        tier=Tier.named(request.tier),
        tenant=request.tenant,
        weight=request.weight,
    )
