"""A discrete-event simulator of N devices driven by a round policy (no torch).

The loop reads as the engine's would: `plan = policy.plan(...)`, `execute(plan)` on the
simulated clock, `update` the request states. How often it plans depends on the policy:

- preemptive (round-knapsack): rounds of τ seconds. At each boundary t_r every unfinished
  request is replanned; each allocation runs its steps back to back from t_r at
  T(resolution, k) seconds a step (a batch at B(resolution, b)), so a request finishes
  mid-round when its last step ends, and its devices idle until t_{r+1}. A request that
  arrives mid-round waits for the next boundary. Rounds start at the first arrival and, when
  the pool has nothing left to do, restart at the next arrival instead of idling on.
- run-to-completion (fixed-sp-k): planned whenever requests arrive or devices free up. A new
  allocation holds its devices for steps x T(resolution, k) seconds; the policy must repeat the
  allocations of requests in flight unchanged. A request whose steps end with work left goes
  back to waiting (fixed-sp never does this: it grants every remaining step).

Nothing is silently lost: a request finishes (late ones count as misses) or, if the policy
stops planning it with no arrival left to wake it, is left unfinished, also a miss. Every
plan is checked: devices in range, each used once (batch members share their host's), steps
within what the request has left, and in-flight allocations unchanged.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from gouache.request import RequestState
from gouache.sched.batching import batch_step
from gouache.sched.rounds import BatchStepTime, RoundAllocation, RoundPlan, StepTime, cached
from gouache.sched.rounds_interface import RoundPolicy
from gouache.sim.simulator import RequestRecord, SimResult
from gouache.sim.workloads import SimRequest


@dataclass
class ClusterResult(SimResult):
    """A `SimResult` of N devices. `busy_s` is the busy device-seconds over N, so that the
    shared `metrics()` reports utilization = busy device-seconds / (N x makespan);
    `num_steps` counts plans (rounds, or planning events)."""

    num_devices: int = 1
    busy_device_s: float = 0.0  # device-seconds spent running steps, all devices together
    device_s: dict[str, float] = field(default_factory=dict)  # request id -> device-seconds it used
    plans: list[tuple[float, RoundPlan]] = field(default_factory=list)  # (time, plan), if record_plans


class ClusterSimulator:
    """Runs a trace through one pool of `num_devices` devices under a round policy."""

    def __init__(self, policy: RoundPolicy, num_devices: int, step_time: StepTime,
                 batch_step_time: BatchStepTime | None = None, record_plans: bool = False):
        if num_devices < 1:
            raise ValueError(f"num_devices must be >= 1, got {num_devices}")
        self.policy = policy
        self.num_devices = num_devices
        self.step_time = cached(step_time)  # true (resolution (h, w) px, k) -> s; the policy may predict another
        self.batch_step_time = batch_step_time  # needed only if the policy batches
        self.record_plans = record_plans  # keep every plan in the result, for tests and traces

    def run(self, requests: Sequence[SimRequest]) -> ClusterResult:
        self._reset(requests)
        if self.policy.preemptive:
            self._run_rounds(requests)
        else:
            self._run_events(requests)
        finishes = [r.finish for r in self.records.values() if r.finish is not None]
        start = min((r.arrival for r in requests), default=0.0)
        end = max([start, *finishes, *(r.arrival for r in requests)])
        return ClusterResult(
            policy=self.policy.name, records=list(self.records.values()),
            busy_s=self.busy_device_s / self.num_devices, start=start, end=end, num_steps=self.num_plans,
            num_devices=self.num_devices, busy_device_s=self.busy_device_s, device_s=self.device_s,
            plans=self.plans,
        )

    # -- the two timings ---------------------------------------------------------------------

    def _run_rounds(self, requests: Sequence[SimRequest]) -> None:
        arrivals = sorted(requests, key=lambda r: r.arrival)
        tau, nxt, placement = self.policy.config.tau, 0, {}
        anchor, r = (arrivals[0].arrival if arrivals else 0.0), 0
        while nxt < len(arrivals) or self.waiting or self.running:
            now = anchor + r * tau
            while nxt < len(arrivals) and arrivals[nxt].arrival <= now:
                self._arrive(arrivals[nxt])
                nxt += 1
            if not (self.waiting or self.running):  # idle pool: the next round starts with the next arrival
                anchor, r = arrivals[nxt].arrival, 0
                continue
            plan = self._plan(now, placement)
            if not plan.allocations and nxt == len(arrivals):
                break  # the policy gives up on what is left and nothing new will come
            self._execute(plan, now)
            placement = {rid: a.devices for rid, a in plan.allocations.items()}
            r += 1

    def _run_events(self, requests: Sequence[SimRequest]) -> None:
        # (time, kind, seq, payload): kind 0 = a segment ends (payload: its state), 1 = an arrival
        events = [(r.arrival, 1, i, r) for i, r in enumerate(requests)]
        heapq.heapify(events)
        seq = len(events)
        in_flight: dict[str, RoundAllocation] = {}
        while events:
            now = events[0][0]
            while events and events[0][0] == now:  # everything at one instant lands before planning
                _, kind, _, payload = heapq.heappop(events)
                if kind == 1:
                    self._arrive(payload)
                else:
                    self._segment_done(payload, in_flight.pop(payload.request_id), now)
            if not self.waiting:
                continue
            plan = self._plan(now, {rid: a.devices for rid, a in in_flight.items()})
            if missing := in_flight.keys() - plan.allocations.keys():
                raise ValueError(f"{self.policy.name} left out {sorted(missing)}, which run to completion")
            if plan.batches:
                raise ValueError("batches are simulated for preemptive (round) policies only")
            for rid, allocation in plan.allocations.items():
                if rid in in_flight:
                    if allocation.devices != in_flight[rid].devices:
                        raise ValueError(f"{self.policy.name} moved {rid}, which holds {in_flight[rid].devices} to the end")
                    continue
                state = self.waiting.pop(rid)
                self.running[rid] = state
                in_flight[rid] = allocation
                end = now + allocation.steps * self._step_s(state, len(allocation.devices))
                self._charge(rid, len(allocation.devices), end - now)
                self._started(state, now)
                heapq.heappush(events, (end, 0, seq, state))
                seq += 1

    # -- plan, execute, update ---------------------------------------------------------------

    def _plan(self, now: float, placement: dict) -> RoundPlan:
        plan = self.policy.plan(list(self.waiting.values()), list(self.running.values()), now,
                                self.num_devices, placement)
        self._check(plan)
        self.num_plans += 1
        if self.record_plans:
            self.plans.append((now, plan))
        return plan

    def _execute(self, plan: RoundPlan, now: float) -> None:
        """Run one round's plan from `now`: each allocation's steps back to back."""
        batched = {rid for group in plan.batches for rid in group}
        for rid, allocation in plan.allocations.items():
            state = self.waiting.pop(rid, None) or self.running.pop(rid)
            self.running[rid] = state
            self._started(state, now)
            if rid not in batched:
                step_s = self._step_s(state, len(allocation.devices))
                self._charge(rid, len(allocation.devices), allocation.steps * step_s)
                self._segment_done(state, allocation, now + allocation.steps * step_s)
        for group in plan.batches:
            self._execute_batch(group, plan, now)

    def _execute_batch(self, group: list[str], plan: RoundPlan, now: float) -> None:
        """A batch shares its host's devices until its longest member is done; they split the cost."""
        states = [self.running[rid] for rid in group]
        step_s = batch_step(self.policy.resolution(states[0]), len(group), self.step_time, self._batch_time)
        busy = max(plan.allocations[rid].steps for rid in group) * step_s
        k = len(plan.allocations[group[0]].devices)
        for state in states:
            allocation = plan.allocations[state.request_id]
            self._charge(state.request_id, k / len(group), busy)
            self._segment_done(state, allocation, now + allocation.steps * step_s)

    def _segment_done(self, state: RequestState, allocation: RoundAllocation, end: float) -> None:
        state.steps_done += allocation.steps
        if state.done:
            del self.running[state.request_id]
            self.records[state.request_id].finish = end
        elif not self.policy.preemptive:  # it gave up its devices with work left: back in the queue
            del self.running[state.request_id]
            self.waiting[state.request_id] = state

    # -- bookkeeping -------------------------------------------------------------------------

    def _reset(self, requests: Sequence[SimRequest]) -> None:
        self.records = {r.request_id: RequestRecord(r) for r in requests}
        if len(self.records) != len(requests):
            raise ValueError("request ids in a trace must be unique")
        self.waiting: dict[str, RequestState] = {}  # not running now; insertion = arrival order
        self.running: dict[str, RequestState] = {}  # started and unfinished (round mode) or in flight (events)
        self.busy_device_s, self.num_plans = 0.0, 0
        self.device_s: dict[str, float] = {}
        self.plans: list[tuple[float, RoundPlan]] = []

    def _arrive(self, request: SimRequest) -> None:
        vae = self.policy.config.vae_scale
        state = RequestState(request.request_id, (request.height // vae, request.width // vae), request.steps,
                             request.arrival, request.deadline)
        self.waiting[request.request_id] = state

    def _started(self, state: RequestState, now: float) -> None:
        if state.first_step_time is None:
            state.first_step_time = now
            self.records[state.request_id].first_step = now

    def _charge(self, rid: str, devices: float, seconds: float) -> None:
        self.busy_device_s += devices * seconds
        self.device_s[rid] = self.device_s.get(rid, 0.0) + devices * seconds

    def _step_s(self, state: RequestState, k: int) -> float:
        return self.step_time(self.policy.resolution(state), k)

    def _batch_time(self, resolution, size: int) -> float:
        if self.batch_step_time is None:
            raise ValueError(f"{self.policy.name} planned a batch but the simulator has no batch_step_time")
        return self.batch_step_time(resolution, size)

    def _check(self, plan: RoundPlan) -> None:
        members = {rid for group in plan.batches for rid in group[1:]}
        used: list[int] = []
        for rid, allocation in plan.allocations.items():
            state = self.waiting.get(rid) or self.running.get(rid)
            if state is None:
                raise ValueError(f"{self.policy.name} planned {rid}, which is not waiting or running")
            if not 1 <= allocation.steps <= state.remaining_steps:
                raise ValueError(f"{rid}: {allocation.steps} steps planned, {state.remaining_steps} left")
            if rid not in members:
                used.extend(allocation.devices)
        for group in plan.batches:
            if any(plan.allocations[rid].devices != plan.allocations[group[0]].devices for rid in group):
                raise ValueError(f"batch {group} does not share its host's devices")
        if len(used) != len(set(used)) or not all(0 <= d < self.num_devices for d in used):
            raise ValueError(f"{self.policy.name} planned devices {sorted(used)} on a pool of {self.num_devices}")


def simulate_cluster(requests: Sequence[SimRequest], policy: RoundPolicy, num_devices: int, step_time: StepTime,
                     batch_step_time: BatchStepTime | None = None, record_plans: bool = False) -> ClusterResult:
    return ClusterSimulator(policy, num_devices, step_time, batch_step_time, record_plans).run(requests)
