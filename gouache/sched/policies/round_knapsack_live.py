"""`round-knapsack` in the live engine: TetriServe's round scheduler on the engine's one device.

The engine asks a step policy for every step; the round policy plans a pool of devices once
per round. This adapter replans with `RoundKnapsackPolicy` over one device whenever a round
ends, then hands out that round's allocation step by step. With one device every degree is 1:
a round runs one request, or one selective batch of same-resolution requests as a single
plain forward, for q = floor(τ / T) steps, chosen by Algorithm 1 to keep the most requests
able to meet their deadlines. Requests without an SLO have an infinite deadline.

A round lasts τ = max(`round_s`, the slowest step among the requests present): a round
shorter than a step would give every request q = 0 steps and the device would never run.
It ends when τ has passed since it was planned (the running request is then preempted if
another needs the device more), or earlier when its allocation has run all its steps:
replanning at once keeps the device busy where the simulator's pool would idle until the
boundary. Late requests keep running best-effort, as in the simulator; nothing is dropped.

Step times come from the engine's cost model: T(shape, 1) is a plain forward of one image,
a batch of b costs a plain forward of b (`BatchCostModel.grouped`, from `gouache profile`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from gouache.config import SchedulerConfig
from gouache.request import RequestState
from gouache.sched.interface import Policy, StepTimePredictor
from gouache.sched.knapsack import plan_round
from gouache.sched.output import StepPlan
from gouache.sched.rounds import RoundRequest, cached

DEVICES = 1  # until multi-device execution exists


class RoundKnapsackLivePolicy(Policy):
    name = "round-knapsack"
    needs_predictor = True
    uses_deadlines = True

    def __init__(self, config: SchedulerConfig, predictor: StepTimePredictor | None = None):
        super().__init__(config, predictor)
        self._step_time = cached(self._one_image)  # T(latent shape, k), memoised for the engine's life
        self._batch_step_time = cached(self._batch)
        self._group: list[str] = []  # this round's ids, host first: they step together
        self._left: dict[str, int] = {}  # id -> steps its allocation still has this round
        self._round_end = -math.inf  # when this round's τ runs out

    def plan(self, waiting: Sequence[RequestState], running: Sequence[RequestState], now: float) -> StepPlan:
        present = {s.request_id for s in (*waiting, *running)}
        group = self._current(present)
        if now >= self._round_end or not group:
            self._replan(waiting, running, now)
            group = self._current(present)
        for rid in group:
            self._left[rid] -= 1
        waiting_ids = {s.request_id for s in waiting}
        return StepPlan(groups=[group] if group else [], admit=[rid for rid in group if rid in waiting_ids])

    def _current(self, present: set[str]) -> list[str]:
        """The members of this round's group that still have steps and were not aborted."""
        return [rid for rid in self._group if rid in present and self._left[rid] > 0]

    def _replan(self, waiting: Sequence[RequestState], running: Sequence[RequestState], now: float) -> None:
        requests = [RoundRequest(s.request_id, s.shape, s.remaining_steps, math.inf if s.deadline is None else s.deadline)
                    for s in (*running, *waiting)]
        if not requests:
            self._group, self._left = [], {}
            return
        tau = max(self.config.round_s, max(self._step_time(r.resolution, 1) for r in requests))
        plan = plan_round(requests, self._step_time, DEVICES, tau, now, batch_step_time=self._batch_step_time,
                          max_batch=self.config.max_batch_size)
        batched = {rid for batch in plan.batches for rid in batch}
        alone = [rid for rid in plan.allocations if rid not in batched]
        self._group = plan.batches[0] if plan.batches else alone  # one device: one allocation or one batch
        self._left = {rid: plan.allocations[rid].steps for rid in self._group}
        self._round_end = now + tau

    def _one_image(self, shape: tuple[int, int], k: int) -> float:
        """T(shape, k): one device, so k is always 1 (a plain forward of one image)."""
        return self.predictor.step_time([shape], patched=False)

    def _batch(self, shape: tuple[int, int], batch: int) -> float:
        return self.predictor.step_time([shape] * batch, patched=False)
