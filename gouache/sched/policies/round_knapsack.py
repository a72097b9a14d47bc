"""`round-knapsack`: TetriServe's deadline-aware round scheduler (§4.2) over a replica's devices.

At every round boundary all unfinished requests, started or not, are replanned by
`plan_classes` (knapsack.py), which reads the scheduler's queue by class as it keeps it
(`sched.waiting`, `round_classes`) and only the requests near a decision: least-device-time
deadline plans, Algorithm 1's group knapsack over the urgent
ones, elastic scale-up of the idle devices, selective batching where the cost model prices
batches, and aligned placement that keeps last round's devices where the degree is unchanged.
Each request (or selective batch) becomes a `Batch` on its devices for its q = floor(τ / T)
steps; the plan ends at now + τ. Late requests keep running best-effort; nothing is dropped.
Requests without an SLO have an infinite deadline.

A round lasts τ = max(`round_s`, the slowest fastest-step among the requests present): a round
shorter than a step would give every request q = 0 steps and no device would ever run. The
scheduler plans the next round when τ has passed and every batch has stopped at a step
boundary, or earlier when all are done, so a pool whose work ended early does not idle.

Step times come from the cost model: T(res, k) is one image on k devices, B(res, b) a plain
forward of b images on one device (math.inf where the model prices no batch: then nothing is
batched).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Sequence

from gouache.config import SchedulerConfig
from gouache.request import RequestState
from gouache.sched.calibration import Calibrated
from gouache.sched.interface import Devices, Policy, Resolution, StepTimePredictor
from gouache.sched.knapsack import plan_classes
from gouache.sched.plan import Batch, Plan
from gouache.sched.round_classes import RequestClass, of_requests
from gouache.sched.rounds import RoundRequest, StepTime, cached, degrees, max_degree


class RoundKnapsackPolicy(Policy):
    name = "round-knapsack"
    needs_predictor = True
    uses_deadlines = True
    rounds = True
    max_devices = None

    def __init__(self, config: SchedulerConfig, predictor: StepTimePredictor | None = None):
        super().__init__(config, predictor)
        self._made: dict[str, RoundRequest] = {}  # the last RoundRequest made for each id
        self._scale = self._calibration()  # the scale the tables below were made at
        self.step_time = cached(self._one_image)  # T(res, k), memoised while the scale stays
        self.batch_step_time = cached(self._batch)  # B(res, b)

    def _calibration(self) -> float:
        """The factor a `Calibrated` cost model puts on every prediction now (1 for another)."""
        return self.predictor.scale if isinstance(self.predictor, Calibrated) else 1.0

    def _memoise(self) -> None:
        """Make the tables again if the calibration has moved since they were made."""
        scale = self._calibration()
        if scale != self._scale:
            self._scale = scale
            self.step_time = cached(self._one_image)
            self.batch_step_time = cached(self._batch)

    def plan(self, waiting: Sequence[RequestState], running: Sequence[RequestState], now: float,
             devices: Devices) -> Plan:
        if not (waiting or running):
            return Plan()
        self._memoise()
        classes = self.round_classes(waiting, running)
        base, count = pool_of(devices)
        tau = max(self.config.round_s, shortest_round(self.step_time, {c.resolution for c in classes}, count))
        # only running requests hold devices: the scheduler clears those of the ones that stop
        previous = {s.request_id: tuple(d - base for d in s.devices) for s in running
                    if s.devices and all(base <= d < base + count for d in s.devices)}
        decision = plan_classes(classes, self.step_time, count, tau, now, previous,
                                batch_step_time=self.batch_step_time, max_batch=self.config.max_batch_size,
                                run_late=self.config.run_late, late=False)
        batched = {rid for group in decision.batches for rid in group}
        groups = [tuple(group) for group in decision.batches]
        groups += [(rid,) for rid in decision.allocations if rid not in batched]
        batches = [
            Batch(group, tuple(base + d for d in decision.allocations[group[0]].devices),
                  max(decision.allocations[r].steps for r in group))
            for group in groups
        ]
        running_ids = {s.request_id for s in running}
        admit = [rid for group in groups for rid in group if rid not in running_ids]
        return Plan(batches=batches, admit=admit, until=now + tau)

    def round_classes(self, waiting: Sequence[RequestState], running: Sequence[RequestState]) -> list[RequestClass]:
        """The round's requests by class (`round_classes`), the running ones before the waiting
        ones on equal (tier, deadline), the waiting ones in queue order. The scheduler's queue
        keeps its requests grouped by shape, each group by deadline (`sched.waiting`): each
        group is a class as it stands, its requests converted only as the planner reads them.
        A plain list of waiting requests is sorted here."""
        shapes = getattr(waiting, "classes", None)
        if shapes is None:
            return of_requests(self.round_requests([*running, *waiting]))
        if len(self._made) > 2 * (len(waiting) + len(running)):  # most of them have left
            self._made = {}
        classes = of_requests(self.round_requests(running))
        for (tier, resolution, steps, done), group in shapes.items():
            classes.append(RequestClass(tier, resolution, steps - done, group.keys, 1,
                                        lambda i, states=group.states: self._round_request(states[i])))
        return classes

    def round_requests(self, states: Sequence[RequestState]) -> list[RoundRequest]:
        """Each state as the `RoundRequest` the round planner reads (`_round_request`)."""
        return [self._round_request(s) for s in states]

    def _round_request(self, s: RequestState) -> RoundRequest:
        """The last one made for this id while its remaining steps are unchanged (its
        resolution and deadline never change; a waiting request's steps do not either), else a
        new one: most requests of a round are the same as last round's."""
        r = self._made.get(s.request_id)
        if r is None or r.remaining_steps != s.remaining_steps:
            r = self._made[s.request_id] = RoundRequest(s.request_id, s.resolution, s.remaining_steps,
                                                        math.inf if s.deadline is None else s.deadline, s.tier)
        return r

    def can_plan_on(self, live: Devices) -> bool:
        """A round plans on the largest aligned block of live devices (`pool_of`), which must
        hold the smallest degree the cost model prices: any one device, unless it prices none."""
        return bool(live.free) and pool_of(live)[1] >= self._least_degree(live.count)

    def needs(self, num_devices: int) -> str:
        least = self._least_degree(num_devices)
        return "one live device" if least == 1 else f"an aligned block of {least} live devices"

    def _least_degree(self, num_devices: int) -> int:
        """The smallest degree the cost model prices for some size (1 when it cannot list its
        sizes: then a degree-1 step is tried like any other)."""
        return min(self.degrees(num_devices), default=1)

    def degrees(self, num_devices: int) -> set[int]:
        """The degrees the cost model prices for some size (a degree it has no time for is never planned)."""
        sizes = self.predictor.sizes(False) or ()
        return {k for k in degrees(max_degree(num_devices))
                if any(math.isfinite(self.step_time(res, k)) for res in sizes)}

    def _one_image(self, resolution: Resolution, k: int) -> float:
        return self.predictor.step_time([resolution], patched=False, degree=k)

    def _batch(self, resolution: Resolution, batch: int) -> float:
        return self.predictor.step_time([resolution] * batch, patched=False)


def pool_of(devices: Devices) -> tuple[int, int]:
    """(first device, count) of the devices a round plans: all of them, or, once some are lost
    for good (a dead worker), the largest aligned power-of-two block of free ones, so every
    block the round places inside it is an aligned block of the whole pool too."""
    if len(devices.free) == devices.count:
        return 0, devices.count
    free, k = set(devices.free), max_degree(devices.count)
    while k:
        for start in range(0, devices.count - k + 1, k):
            if free.issuperset(range(start, start + k)):
                return start, k
        k //= 2
    raise ValueError("no free device to plan a round on")


def shortest_round(step_time: StepTime, resolutions: Iterable[Hashable], num_devices: int, steps: int = 1) -> float:
    """τ = steps x the largest T_min(resolution): the shortest round in which every resolution
    completes `steps` steps at its fastest degree. Any shorter and the largest resolution gets
    q = 0 at every degree, so it never runs. At this length that resolution's steps also end
    exactly on round boundaries, TetriServe's rule of fitting τ to the step times (§4.2.2), for
    the requests that can least afford the idle tail of a round."""
    if steps < 1:
        raise ValueError(f"steps per round must be >= 1, got {steps}")
    table = cached(step_time)
    return steps * max(table.fastest(res, max_degree(num_devices)) for res in resolutions)
