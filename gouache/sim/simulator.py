"""A discrete-event simulator that drives the live scheduler and policies on a simulated clock.

The engine loop is `plan = scheduler.schedule(now); output = runner.execute(plan);
scheduler.update(plan, output)`. Here `execute` becomes `step_cost(plan, states)` seconds
on a clock that jumps from event to event (arrivals, step completions, in a heap); the
`Scheduler` and `Policy` objects are the very ones the engine runs.

Conventions (they fix the exact times the tests compute by hand):
- All events at one instant are applied before anyone schedules: a request that arrives
  exactly when a step ends can join the next step.
- A request finishes when the step that does its last denoising step ends (post-processing,
  VAE decode, is not simulated).
- Nothing is lost: a request is finished, dropped by its policy, or left unfinished (the
  policy stopped planning with work left and no event came to wake it). Dropped and
  unfinished requests count as SLO misses. Late requests keep running and count as misses.
- Stage work (optional `stage_cost`): a request's preparation (text encoding, initial latents)
  and post-processing (VAE decode, image encoding) share the device with the steps. Each adds
  its seconds to the replica's backlog when the request arrives or finishes; an idle device
  works the backlog off as time passes, and the next step takes whatever is left on top of
  its own cost. The request itself is not delayed by its own stages.

R replicas, one device each: every replica is a `Replica` (its own `Scheduler` and policy
instance); each arrival goes to the replica a router (`gouache.sched.router`) picks from the
replicas' `ReplicaLoad`s at that instant, built from their queues and batches. One replica
needs no router. A replica that is idle at an arrival admits its queue at that same instant,
so its load reports the queued requests that fit its batch as running (this also keeps the
mask-aware router's slot-wait estimate defined: it divides by the running count).

A step cost sees only `RequestState`s (shape, steps). A cost that needs more of a request,
such as an edit's mask ratio, holds a mapping from request id built from the trace (e.g.
`MaskStepCost.for_trace` in `gouache.sim.exp_instgenie`); the simulator's interface to step
costs does not change.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from gouache.outputs import StepOutput
from gouache.request import RequestState
from gouache.sched.interface import Policy, Scheduler, StepTimePredictor
from gouache.sched.output import StepPlan
from gouache.sched.router import ReplicaLoad, Router, RouteRequest
from gouache.sim.workloads import SimRequest, latent_tokens
from gouache.stats import percentile

# seconds one step plan takes on the device, given the states of the requests in it
StepCost = Callable[[StepPlan, dict[str, RequestState]], float]
# seconds of device work a request costs outside its steps: (preparation on arrival, post-processing when done)
StageCost = Callable[[RequestState], tuple[float, float]]

VAE_SCALE = 8  # pixels per latent pixel of the SD/SDXL/SD3/FLUX VAEs


@dataclass(frozen=True)
class LinearStepCost:
    """cost = base_s + Σ over the plan's forwards (per_forward_s + megapixels in it × per_megapixel_s).

    A stand-in for tests and examples until the profiled cost models (`gouache.sched.costmodel`)
    plug in: a forward has a fixed launch cost and work grows with pixels, nothing else (no
    batching saturation, no patching overhead, no masks). It is also a `StepTimePredictor`,
    so SLO-aware policies can plan with exactly the cost the simulator charges.
    """

    base_s: float = 0.0  # per step, whatever it holds (sampler, scheduling, launch)
    per_megapixel_s: float = 0.0  # per million image pixels in a forward
    per_forward_s: float = 0.0  # per forward pass (one per group of the plan)
    vae_scale: int = VAE_SCALE  # image pixels per latent pixel, a side

    def __call__(self, plan: StepPlan, states: dict[str, RequestState]) -> float:
        total = self.base_s
        for group in plan.groups:
            latent_pixels = 0
            for rid in group:
                height, width = states[rid].shape
                latent_pixels += height * width
            total += self.per_forward_s + latent_pixels * self.vae_scale**2 / 1e6 * self.per_megapixel_s
        return total

    def step_time(self, shapes: Sequence[tuple[int, int]], patched: bool) -> float:
        """The same cost from latent shapes: one forward if patched, else one per distinct shape."""
        if patched:
            return self.base_s + self._forward(shapes)
        by_shape: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for shape in shapes:
            by_shape.setdefault(tuple(shape), []).append(shape)
        return self.base_s + sum(self._forward(group) for group in by_shape.values())

    def batch_step_time(self, batch: Sequence[RouteRequest]) -> float:
        """The same cost of one forward over the router's view of requests (16 pixels a token
        side, `latent_tokens`), an edit counting its masked pixels only: the mask-aware
        router's cost model."""
        pixels = sum(r.tokens * r.mask_ratio for r in batch) * 16**2
        return self.base_s + self.per_forward_s + pixels / 1e6 * self.per_megapixel_s

    def _forward(self, shapes: Sequence[tuple[int, int]]) -> float:
        latent_pixels = sum(h * w for h, w in shapes)
        return self.per_forward_s + latent_pixels * self.vae_scale**2 / 1e6 * self.per_megapixel_s


def linear_step_cost(base_s: float = 0.0, per_megapixel_s: float = 0.0, per_forward_s: float = 0.0,
                     vae_scale: int = VAE_SCALE) -> LinearStepCost:
    """The default step cost for tests and examples; see `LinearStepCost`."""
    return LinearStepCost(base_s, per_megapixel_s, per_forward_s, vae_scale)


@dataclass(frozen=True)
class PredictedStepCost:
    """A `StepCost` from a `StepTimePredictor`, such as a `BatchCostModel` from `gouache
    profile`: one patched forward over the whole plan, or one plain forward per group, times
    `scale` (a device that runs faster or slower than when it was profiled)."""

    predictor: StepTimePredictor
    scale: float = 1.0

    def __call__(self, plan: StepPlan, states: dict[str, RequestState]) -> float:
        shapes = [[states[rid].shape for rid in group] for group in plan.groups]
        if plan.patched:
            return self.scale * self.predictor.step_time([s for group in shapes for s in group], patched=True)
        return self.scale * sum(self.predictor.step_time(group, patched=False) for group in shapes)


def standalone_latency(step_cost: StepCost, vae_scale: int = VAE_SCALE) -> Callable[[int, int, int], float]:
    """(width, height, steps) -> seconds for one request alone on the device under `step_cost`.

    Pass it to `make_workload` to set SLOs as a multiple of the standalone latency.
    """
    def latency(width: int, height: int, steps: int) -> float:
        state = _state(SimRequest("solo", 0.0, width, height, steps), vae_scale)
        return steps * step_cost(StepPlan(groups=[["solo"]], admit=["solo"]), {"solo": state})
    return latency


def _state(request: SimRequest, vae_scale: int) -> RequestState:
    return RequestState(
        request_id=request.request_id,
        shape=(request.height // vae_scale, request.width // vae_scale),
        num_steps=request.steps,
        arrival_time=request.arrival,
        deadline=request.deadline,
    )


@dataclass
class RequestRecord:
    """What happened to one request."""

    request: SimRequest
    first_step: float | None = None  # when its first denoising step began (queueing ends)
    finish: float | None = None  # when its last denoising step ended
    dropped_at: float | None = None  # when its policy dropped it
    replica: int | None = None  # index of the replica it was routed to

    @property
    def latency(self) -> float | None:
        return None if self.finish is None else self.finish - self.request.arrival

    @property
    def queueing(self) -> float | None:
        return None if self.first_step is None else self.first_step - self.request.arrival

    @property
    def met_slo(self) -> bool | None:
        """None without an SLO; False if dropped, unfinished or late."""
        deadline = self.request.deadline
        if deadline is None:
            return None
        return self.finish is not None and self.finish <= deadline


@dataclass
class SimMetrics:
    """The numbers a run is judged by. Latencies are over finished requests."""

    num_requests: int
    finished: int
    dropped: int  # removed by the policy (e.g. hopeless under an SLO policy)
    unfinished: int  # still waiting or running when no event was left
    slo_attainment: float | None  # met / requests with an SLO; None if none has one
    latency_mean_s: float | None
    latency_p50_s: float | None
    latency_p95_s: float | None
    latency_p99_s: float | None
    queueing_mean_s: float | None  # arrival -> first step, over requests that started
    utilization: float  # device busy time / makespan
    makespan_s: float  # first arrival -> last step end
    throughput_rps: float  # finished / makespan
    num_steps: int  # step plans executed


@dataclass
class SimResult:
    """One simulated run: a record per request (trace order) and the device's accounting."""

    policy: str
    records: list[RequestRecord]
    busy_s: float  # time a device spent executing steps; with R replicas the mean over them
    start: float  # first arrival
    end: float  # last step end (or last arrival if later)
    num_steps: int

    def metrics(self) -> SimMetrics:
        latencies = np.array([r.latency for r in self.records if r.finish is not None])
        queueing = [r.queueing for r in self.records if r.first_step is not None]
        slo = [r.met_slo for r in self.records if r.met_slo is not None]
        makespan = self.end - self.start

        def pct(q: float) -> float | None:
            return percentile(latencies.tolist(), q) if latencies.size else None

        return SimMetrics(
            num_requests=len(self.records),
            finished=int(latencies.size),
            dropped=sum(r.dropped_at is not None for r in self.records),
            unfinished=sum(r.finish is None and r.dropped_at is None for r in self.records),
            slo_attainment=sum(slo) / len(slo) if slo else None,
            latency_mean_s=float(latencies.mean()) if latencies.size else None,
            latency_p50_s=pct(50), latency_p95_s=pct(95), latency_p99_s=pct(99),
            queueing_mean_s=float(np.mean(queueing)) if queueing else None,
            utilization=self.busy_s / makespan if makespan > 0 else 0.0,
            makespan_s=makespan,
            throughput_rps=latencies.size / makespan if makespan > 0 else 0.0,
            num_steps=self.num_steps,
        )


class Replica:
    """The engine loop of one replica, with `execute` replaced by `step_cost` on a simulated clock."""

    def __init__(self, policy: Policy, step_cost: StepCost, records: dict[str, RequestRecord],
                 stage_cost: StageCost | None = None):
        self.scheduler = Scheduler(policy)
        self.step_cost = step_cost
        self.stage_cost = stage_cost
        self.records = records  # shared with the simulator; this replica fills in its requests' times
        self.busy_s = 0.0
        self.num_steps = 0
        self._in_flight: tuple[StepPlan, StepOutput] | None = None  # the running step and what it will report
        self._backlog_s = 0.0  # stage work not yet done
        self._idle_since = 0.0  # while idle: since when the backlog has been worked off

    @property
    def idle(self) -> bool:
        return self._in_flight is None

    def add(self, state: RequestState, now: float) -> None:
        self.scheduler.add(state)
        if self.stage_cost is not None:
            self._work_off(now)
            self._backlog_s += self.stage_cost(state)[0]

    def start_step(self, now: float) -> float | None:
        """Plan and launch one step; its end time, or None if the policy planned no forward."""
        self._work_off(now)
        plan = self.scheduler.schedule(now)
        self._record_drops(plan, now)
        while plan.drop and not plan.groups and self.scheduler.waiting:
            plan = self.scheduler.schedule(now)  # as the engine loop does: plan again at once
            self._record_drops(plan, now)
        if not plan.groups:
            return None
        ids = plan.request_ids
        running = self.scheduler.running
        cost = self.step_cost(plan, {rid: running[rid] for rid in ids})
        if not (math.isfinite(cost) and cost >= 0):
            raise ValueError(f"step_cost must return finite seconds >= 0, got {cost} for {plan}")
        cost, self._backlog_s = cost + self._backlog_s, 0.0
        self._in_flight = (plan, StepOutput(request_ids=ids, forward_s=cost))
        self.busy_s += cost
        self.num_steps += 1
        return now + cost

    def finish_step(self, now: float) -> None:
        plan, output = self._in_flight
        self._in_flight, self._idle_since = None, now
        for state in self.scheduler.update(plan, output):
            self._close(state, finish=now)
            if self.stage_cost is not None:
                self._backlog_s += self.stage_cost(state)[1]

    def _work_off(self, now: float) -> None:
        """An idle device spends the time since it went idle on the stage backlog."""
        if self.idle:
            self._backlog_s = max(0.0, self._backlog_s - (now - self._idle_since))
            self._idle_since = now

    def close(self) -> None:
        """At the end of a run: record when the requests still held had started, if they had."""
        for state in [*self.scheduler.waiting.values(), *self.scheduler.running.values()]:
            self._close(state)

    def _close(self, state: RequestState, finish: float | None = None) -> None:
        record = self.records[state.request_id]
        record.first_step = state.first_step_time  # the Scheduler stamps it when the first step is planned
        record.finish = finish

    def _record_drops(self, plan: StepPlan, now: float) -> None:
        """The Scheduler has forgotten the waiting requests in `plan.drop`; the records keep them."""
        for rid in plan.drop:
            self.records[rid].dropped_at = now

    def load(self) -> ReplicaLoad:
        """What a router sees of this replica: its batch and its queue, as plain values."""
        running = [self._route_request(s) for s in self.scheduler.running.values()]
        waiting = [self._route_request(s) for s in self.scheduler.waiting.values()]
        max_batch = self.scheduler.policy.config.max_batch_size
        if self.idle:  # it plans before any time passes: its queue joins the batch that starts now
            free = max(max_batch - len(running), 0)
            running, waiting = running + waiting[:free], waiting[free:]
        return ReplicaLoad(running=running, waiting=waiting, max_batch=max_batch)

    def _route_request(self, state: RequestState) -> RouteRequest:
        return route_request(self.records[state.request_id].request, state.remaining_steps)


_STEP_DONE, _ARRIVAL = 0, 1  # event kinds; at one instant, all are applied before scheduling


class Simulator:
    """Runs a trace through one replica per policy instance (one device each).

    `policy` is one policy (one replica) or a sequence of distinct instances, one per replica;
    with more than one, `router` picks each arrival's replica.
    """

    def __init__(self, policy: Policy | Sequence[Policy], step_cost: StepCost, vae_scale: int = VAE_SCALE,
                 router: Router | None = None, stage_cost: StageCost | None = None):
        self.policies = [policy] if isinstance(policy, Policy) else list(policy)
        if not self.policies:
            raise ValueError("a simulation needs at least one replica: pass a policy")
        if len({id(p) for p in self.policies}) != len(self.policies):
            raise ValueError("each replica needs its own policy instance: make one per replica")
        if len(self.policies) > 1 and router is None:
            raise ValueError(f"{len(self.policies)} replicas need a router (see gouache.sched.router.ROUTERS)")
        self.policy = self.policies[0]
        self.step_cost = step_cost
        self.vae_scale = vae_scale  # pixels per latent pixel: RequestState.shape = (height, width) // vae_scale
        self.router = router  # picks each arrival's replica; None with one replica
        self.stage_cost = stage_cost  # per request (prep, post) seconds on its replica's device; None = free
        self.replicas: list[Replica] = []  # those of the current (or last) run

    def run(self, requests: Sequence[SimRequest]) -> SimResult:
        records = {r.request_id: RequestRecord(r) for r in requests}
        if len(records) != len(requests):
            raise ValueError("request ids in a trace must be unique")
        self.replicas = [Replica(policy, self.step_cost, records, self.stage_cost) for policy in self.policies]
        events = [(r.arrival, _ARRIVAL, i, r) for i, r in enumerate(requests)]
        heapq.heapify(events)
        seq = len(events)  # tie-breaker: events of one kind at one instant keep their order
        now = min((r.arrival for r in requests), default=0.0)
        start, end = now, now
        while events:
            now = events[0][0]
            while events and events[0][0] == now:
                _, kind, _, payload = heapq.heappop(events)
                if kind == _STEP_DONE:
                    payload.finish_step(now)
                else:
                    self._route(payload, records[payload.request_id]).add(_state(payload, self.vae_scale), now)
            end = now  # events leave the heap in time order
            for replica in self.replicas:
                if replica.idle and (step_end := replica.start_step(now)) is not None:
                    heapq.heappush(events, (step_end, _STEP_DONE, seq, replica))
                    seq += 1
        for replica in self.replicas:
            replica.close()
        return SimResult(
            policy=self.policy.name, records=list(records.values()),
            busy_s=sum(r.busy_s for r in self.replicas) / len(self.replicas), start=start, end=end,
            num_steps=sum(r.num_steps for r in self.replicas),
        )

    def _route(self, request: SimRequest, record: RequestRecord) -> Replica:
        """The replica the router picks from the replicas' loads now (the only one without a router)."""
        index = 0
        if self.router is not None:
            index = self.router.route(route_request(request), [replica.load() for replica in self.replicas])
            if not 0 <= index < len(self.replicas):
                raise ValueError(f"router {self.router.name!r} picked replica {index} of {len(self.replicas)}")
        record.replica = index
        return self.replicas[index]


def route_request(request: SimRequest, steps: int | None = None) -> RouteRequest:
    """The router's view of a request: latent tokens, steps still to run, mask ratio (1 = generation)."""
    return RouteRequest(
        request_id=request.request_id,
        tokens=latent_tokens(request.width, request.height),
        steps=request.steps if steps is None else steps,
        mask_ratio=1.0 if request.mask_ratio is None else request.mask_ratio,
    )


def simulate(requests: Sequence[SimRequest], policy: Policy | Sequence[Policy], step_cost: StepCost,
             vae_scale: int = VAE_SCALE, router: Router | None = None, stage_cost: StageCost | None = None) -> SimResult:
    return Simulator(policy, step_cost, vae_scale, router, stage_cost).run(requests)
