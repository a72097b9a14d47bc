"""`patched-slo`: PatchedServe Algorithm 1 (§6.2) over patched batching.

Each step, waiting requests are taken in order of least slack,

    slack_i = (deadline_i - now - predicted_remaining_i) / standalone_i,

(requests without an SLO have infinite slack and come last, FCFS; ties keep arrival order),
a higher service tier first (`gouache.sched.tiers`). For the most urgent candidate the
predictor gives the step time of the batch with it:

- if the candidate cannot meet its deadline even alone, started now, it is dropped (the
  client gets "deadline unattainable");
- if the batch with it would make a running (or already admitted) request miss a deadline it
  would otherwise meet, admission stops (the schedulability test);
- if batching it in beats running it beside the batch by the benefit threshold, it is
  admitted and the next candidate is tried; otherwise admission stops.

Tiers: a batch member of a lower tier than the candidate neither blocks it (its deadline does
not count in the schedulability test, and the benefit test is skipped) nor keeps its slot in a
full batch: the lowest-tier, latest-admitted running member is paused instead. And once the
batch is chosen, a member that would miss its deadline beside lower tiers' members has them
paused (the lowest tier and latest first) until it meets it, or, late whatever they do, until
none is left: a priority request's deadline outranks a default one's.

Two readings of the paper are ours. The drop test uses the candidate's standalone step time:
the paper's line 6 tests with the batched time, which would discard requests that could still
meet their deadline in a smaller batch. The benefit of Eq. 1 is taken as the speedup of
batching the candidate in over running it separately, (T(A) + T({c})) / T(A + {c}); the
extracted formula's throughput ratio is garbled, and this is the quantity its text describes
("adding a candidate request improves system throughput"). An empty batch always admits.

Candidates are read in slack order only as far as the plan goes: the scheduler keeps its
waiting requests grouped by tier and shape, each group by deadline (`sched.waiting`), and the
groups' heads are merged, so a decision at 10,000 waiting requests computes a few slacks, not
10,000. The predictor is asked once per resolution present (a predictor sees only resolutions).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterator, Sequence

from gouache.request import RequestState
from gouache.sched.interface import Devices, Policy, Resolution, StepTimePredictor
from gouache.sched.plan import Plan, one_step

BENEFIT_THRESHOLD = 1.0  # admit when batching is at least as fast as separate forwards


class PatchedSloPolicy(Policy):
    name = "patched-slo"
    pauses = True
    mixes_resolutions = True
    needs_predictor = True
    uses_deadlines = True

    def plan(self, waiting: Sequence[RequestState], running: Sequence[RequestState], now: float,
             devices: Devices) -> Plan:
        batch, admit, drop, pause = list(running), [], [], []
        alone = StepAlone(self.predictor)
        batch_step = self._step(batch) if batch else 0.0  # T(batch); after an admission, its T(batch + {c})
        for candidate in self.by_slack(waiting, now, alone):
            full = len(batch) >= self.config.max_batch_size
            lower = [s for s in batch if s.tier > candidate.tier and s.request_id not in admit] if full else []
            if full and not lower:
                break
            if self._misses(candidate, alone[candidate.resolution], now):
                drop.append(candidate.request_id)
                continue
            kept, kept_step, victim = batch, batch_step, None
            if full:
                victim = max(reversed(lower), key=lambda s: s.tier)  # the lowest tier, admitted last
                kept = [s for s in batch if s is not victim]
                kept_step = self._step(kept) if kept else 0.0
            peers = [s for s in kept if s.tier <= candidate.tier]  # whose deadlines may stop it
            with_candidate = self._step([*kept, candidate])
            if any(self._misses(s, with_candidate, now) and not self._misses(s, kept_step, now) for s in peers):
                break  # schedulability test: it would push a batch member past its deadline
            if len(peers) == len(kept) and kept and \
                    self.benefit(kept_step, alone[candidate.resolution], with_candidate) < BENEFIT_THRESHOLD:
                break
            if victim is not None:
                pause.append(victim.request_id)
            batch = [*kept, candidate]
            admit.append(candidate.request_id)
            batch_step = with_candidate
        if len({s.tier for s in batch}) > 1:
            batch = self._protect(batch, now, admit, pause)
        return one_step([[s.request_id for s in batch]], admit, patched=True, drop=drop, pause=pause)

    def _protect(self, batch: list[RequestState], now: float, admit: list[str], pause: list[str]) -> list[RequestState]:
        """Higher tiers first, each member that would miss its deadline in `batch` has the
        lower tiers' members taken out, the lowest tier and latest first, until it meets it or
        none is left (a late one then finishes as early as its own tier allows): a running one
        is paused, one admitted now stays waiting."""
        for member in sorted(batch, key=lambda s: s.tier):
            if member.deadline is None or member not in batch:
                continue
            while self._misses(member, self._step(batch), now):
                lower = [s for s in batch if s.tier > member.tier]
                if not lower:
                    break
                victim = max(reversed(lower), key=lambda s: s.tier)
                batch = [s for s in batch if s is not victim]
                (admit.remove if victim.request_id in admit else pause.append)(victim.request_id)
        return batch

    def by_slack(
        self, waiting: Sequence[RequestState], now: float, alone: StepAlone | None = None
    ) -> Iterator[RequestState]:
        """`waiting` by tier, then slack; ties keep their order in `waiting`. The scheduler's
        queue (`waiting.classes`: its requests grouped by tier and shape, each group by deadline)
        is merged group head by group head, as far as the caller reads: no sort of everyone."""
        slack = self.slack_key(now, StepAlone(self.predictor) if alone is None else alone)
        classes = getattr(waiting, "classes", None)
        if classes is None:
            yield from sorted(waiting, key=lambda s: (s.tier, slack(s)))
            return
        # within a group slack grows with the deadline; between groups, ties go by queue order
        heads = [(group.states[0].tier, slack(group.states[0]), group.keys[0][1:], 0, group)
                 for group in classes.values()]
        heapq.heapify(heads)
        while heads:
            _, _, _, i, group = heads[0]
            yield group.states[i]
            if i + 1 < len(group.states):
                state = group.states[i + 1]
                heapq.heapreplace(heads, (state.tier, slack(state), group.keys[i + 1][1:], i + 1, group))
            else:
                heapq.heappop(heads)

    def slack(self, state: RequestState, now: float) -> float:
        """slack_i at `now` (inf without an SLO)."""
        return self.slack_key(now, StepAlone(self.predictor))(state)

    @staticmethod
    def slack_key(now: float, alone: StepAlone) -> Callable[[RequestState], float]:
        """slack_i as a sort key at `now`; `alone` answers T({i}) per resolution. It runs for every
        waiting request every step, so `remaining_steps` is inlined."""
        def slack(state: RequestState) -> float:
            if state.deadline is None:
                return math.inf
            step = alone[state.resolution]
            return (state.deadline - now - (state.num_steps - state.steps_done) * step) / (state.num_steps * step)
        return slack

    @staticmethod
    def benefit(batch_step: float, candidate_step: float, with_candidate: float) -> float:
        """Eq. 1 as we read it: (T(A) + T({c})) / T(A + {c})."""
        return (batch_step + candidate_step) / with_candidate

    def _step(self, states: Sequence[RequestState]) -> float:
        return self.predictor.step_time([s.resolution for s in states], patched=True)

    @staticmethod
    def _misses(state: RequestState, step_time: float, now: float) -> bool:
        return state.deadline is not None and now + state.remaining_steps * step_time > state.deadline


class StepAlone(dict[Resolution, float]):
    """resolution -> predicted seconds of one step of a request of that resolution alone. Filled on first
    use: within one plan the predictor is asked once per resolution, not once per request."""

    def __init__(self, predictor: StepTimePredictor):
        super().__init__()
        self.predictor = predictor

    def __missing__(self, resolution: Resolution) -> float:
        step = self[resolution] = self.predictor.step_time([resolution], patched=True)
        return step
