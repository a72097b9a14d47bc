"""`patched-slo`: PatchedServe Algorithm 1 (§6.2) over patched batching.

Each step, waiting requests are taken in order of least slack,

    slack_i = (deadline_i - now - predicted_remaining_i) / standalone_i,

(requests without an SLO have infinite slack and come last, FCFS). For the most urgent
candidate the predictor gives the step time of the batch with it:

- if the candidate cannot meet its deadline even alone, started now, it is dropped (the
  client gets "deadline unattainable");
- if the batch with it would make a running (or already admitted) request miss a deadline it
  would otherwise meet, admission stops (the schedulability test);
- if batching it in beats running it beside the batch by the benefit threshold, it is
  admitted and the next candidate is tried; otherwise admission stops.

Two readings of the paper are ours. The drop test uses the candidate's standalone step time:
the paper's line 6 tests with the batched time, which would discard requests that could still
meet their deadline in a smaller batch. The benefit of Eq. 1 is taken as the speedup of
batching the candidate in over running it separately, (T(A) + T({c})) / T(A + {c}); the
extracted formula's throughput ratio is garbled, and this is the quantity its text describes
("adding a candidate request improves system throughput"). An empty batch always admits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from gouache.request import RequestState
from gouache.sched.interface import Policy
from gouache.sched.output import StepPlan

BENEFIT_THRESHOLD = 1.0  # admit when batching is at least as fast as separate forwards


class PatchedSloPolicy(Policy):
    name = "patched-slo"
    mixes_shapes = True
    needs_predictor = True

    def plan(self, waiting: Sequence[RequestState], running: Sequence[RequestState], now: float) -> StepPlan:
        batch, admit, drop = list(running), [], []
        alone: dict[tuple[int, int], float] = {}  # shape -> predicted step alone: one predictor call per shape
        for candidate in sorted(waiting, key=lambda s: self.slack(s, now, alone)):
            if len(batch) >= self.config.max_batch_size:
                break
            if self._misses(candidate, self._alone(candidate, alone), now):
                drop.append(candidate.request_id)
                continue
            with_candidate = self._step([*batch, candidate])
            without = self._step(batch) if batch else 0.0
            if any(self._misses(s, with_candidate, now) and not self._misses(s, without, now) for s in batch):
                break  # schedulability test: it would push a batch member past its deadline
            if batch and self.benefit(batch, candidate, with_candidate) < BENEFIT_THRESHOLD:
                break
            batch.append(candidate)
            admit.append(candidate.request_id)
        groups = [[s.request_id for s in batch]] if batch else []
        return StepPlan(groups=groups, admit=admit, patched=True, drop=drop)

    def slack(self, state: RequestState, now: float, alone: dict[tuple[int, int], float] | None = None) -> float:
        if state.deadline is None:
            return math.inf
        step = self._alone(state, {} if alone is None else alone)
        return (state.deadline - now - state.remaining_steps * step) / (state.num_steps * step)

    def benefit(self, batch: list[RequestState], candidate: RequestState, with_candidate: float) -> float:
        return (self._step(batch) + self._step([candidate])) / with_candidate

    def _alone(self, state: RequestState, memo: dict[tuple[int, int], float]) -> float:
        """Predicted step time of `state` alone. A predictor sees only shapes, so within one plan
        `memo` (shape -> seconds) answers for every request of a shape after the first."""
        if state.shape not in memo:
            memo[state.shape] = self._step([state])
        return memo[state.shape]

    def _step(self, states: Sequence[RequestState]) -> float:
        return self.predictor.step_time([s.shape for s in states], patched=True)

    @staticmethod
    def _misses(state: RequestState, step_time: float, now: float) -> bool:
        return state.deadline is not None and now + state.remaining_steps * step_time > state.deadline
