"""A discrete-event simulator that drives the live scheduler and policies on a simulated clock.

The engine loop is `plan = scheduler.schedule(now)`, then each ready run of the plan steps on
its devices and `scheduler.advance(run, ...)` follows it. Here a run's steps cost
`step_cost(batch, states)` seconds each on a clock that jumps from event to event (arrivals,
the ends of runs' segments, in a heap); the `Scheduler` and `Policy` objects are the very
ones the engine runs, step policies, run-to-completion and round policies alike.

A segment is as many steps of a run as keep its members unchanged: up to the first member's
last step, the run's own step count, or the step that crosses its round's end. The run's
first segment also waits for the replica's stage backlog and, for a member that moved from
other devices, for its latents (`handoff`).

Conventions (they fix the exact times the tests compute by hand):
- All events at one instant are applied before anyone schedules: a request that arrives
  exactly when a step ends can join the next step.
- Then the replicas where something happened decide (and those that may plan with nothing
  happening to them, `Replica.may_plan`); any other replica's decision would be empty, so it
  is not asked. The router's view of a replica (`Replica.load`) is rebuilt only after it changed.
- A request finishes when the step that does its last denoising step ends (post-processing,
  VAE decode, is not simulated).
- Nothing is lost: a request is finished, dropped by its policy, refused at arrival (an
  `Admission` limit: the engine's 429), or left unfinished (the policy stopped planning with
  work left and no event came to wake it). Dropped, refused and unfinished requests count as
  SLO misses. Late requests keep running and count as misses.
- Service tiers and tenants (`SimRequest.tier`, `tenant`, `weight`) reach the scheduler as they
  do live: the same tier order, fair queuing and pauses (`gouache.sched.tiers`).
- Stage work (optional `stage_cost`): a request's preparation (text encoding, initial latents)
  and post-processing (VAE decode, image encoding) share the devices with the steps. Each adds
  its seconds to the replica's backlog when the request arrives or finishes; while no run
  steps, the replica works the backlog off as time passes, and the next run to start takes
  whatever is left on top of its first step. The request itself is not delayed by its own
  stages.

R replicas of `num_devices` devices each: every replica is a `Replica` (its own `Scheduler`
and policy instance); each arrival goes to the replica a router (`gouache.sched.router`)
picks from the replicas' `ReplicaLoad`s at that instant, built from their queues and batches.
One replica needs no router. A replica that is idle at an arrival admits its queue at that
same instant, so its load reports the queued requests that fit its batch as running (this
also keeps the mask-aware router's slot-wait estimate defined: it divides by the running
count).

Step, stage and hand-off costs are in `costs.py`. A step cost sees only the batch and its
`RequestState`s (resolution, steps). A cost that needs more of a request, such as an edit's mask
ratio, holds a mapping from request id built from the trace (e.g. `MaskStepCost.for_trace` in
`gouache.sim.exp_instgenie`).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from gouache.config import DEFAULT_QUEUE_SHARES
from gouache.request import RequestState, Tier
from gouache.sched.interface import Policy
from gouache.sched.plan import Plan
from gouache.sched.router import ReplicaLoad, Router, RouteRequest
from gouache.sched.scheduler import Run, Scheduler
from gouache.sched.tiers import queue_limit, refusal
from gouache.sim.costs import HandoffCost, StageCost, StepCost, state_of
from gouache.sim.results import RequestRecord, SimResult
from gouache.sim.workloads import SimRequest

_SLACK = 1e-9  # float slack when counting the steps that start before a round's end


@dataclass(frozen=True)
class Admission:
    """The engine's queue limit per replica (`EngineConfig.max_queue_len`, `tier_queue_share`):
    an arrival that would put more than its tier's share of `max_in_flight` requests of its tier
    or a higher one in its replica (waiting or running) is refused (429): flex first, and a
    lower tier's queue never keeps a higher tier out. So is one whose tenant holds its share of
    its tier's places while other tenants have requests of the tier (`tiers.tenant_limit`)."""

    max_in_flight: int
    shares: tuple[tuple[str, float], ...] = DEFAULT_QUEUE_SHARES

    def admits(self, request: SimRequest, replica: Replica) -> bool:
        held = (*replica.scheduler.waiting.values(), *replica.scheduler.running.values())
        return refusal(Tier.named(request.tier), request.tenant, request.weight, 1,
                       ((s.tier, s.tenant, s.weight) for s in held),
                       queue_limit(request.tier, self.max_in_flight, self.shares)) is None


@dataclass
class _Segment:
    """Steps of one run in flight: `steps` of them by `members`, ending at `end`."""

    run: Run
    members: list[str]
    steps: int
    end: float


class Replica:
    """The engine loop of one replica, its steps replaced by `step_cost` on a simulated clock."""

    def __init__(self, policy: Policy, step_cost: StepCost, records: dict[str, RequestRecord],
                 stage_cost: StageCost | None = None, num_devices: int = 1, handoff: HandoffCost | None = None,
                 plans: list[tuple[float, Plan]] | None = None):
        self.scheduler = Scheduler(policy, num_devices)
        self.step_cost = step_cost
        self.stage_cost = stage_cost
        self.handoff = handoff
        self.records = records  # shared with the simulator; this replica fills in its requests' times
        self.plans = plans  # where to keep every plan, or None
        self.busy_device_s = 0.0
        self.device_s: dict[str, float] = {}
        self.num_steps = self.num_plans = 0
        self.segments: dict[int, _Segment] = {}  # id(run) -> its segment in flight
        self._backlog_s = 0.0  # stage work not yet done
        self._idle_since = 0.0  # while idle: since when the backlog has been worked off
        self._load: ReplicaLoad | None = None  # what the router sees, kept until the replica changes

    @property
    def idle(self) -> bool:
        return not self.segments

    def add(self, state: RequestState, now: float) -> None:
        self._load = None
        self.scheduler.add(state)
        if self.stage_cost is not None:
            self._work_off(now)
            self._backlog_s += self.stage_cost(state)[0]

    def decide(self, now: float) -> list[_Segment]:
        """Plan if it is time to, and start every ready run not yet stepping; the segments started."""
        self._load = None
        self._work_off(now)
        plan = self._schedule(now)
        while plan.drop and not plan.batches and self.scheduler.waiting:
            plan = self._schedule(now)  # as the engine loop does: plan again at once
        started = []
        for run in self.scheduler.ready():
            if id(run) not in self.segments and (segment := self._start(run, now)) is not None:
                started.append(segment)
        return started

    def segment_done(self, segment: _Segment, now: float) -> list[_Segment]:
        """A segment ended at `now`: advance its run; start its next segment if the run goes on."""
        self._load = None
        del self.segments[id(segment.run)]
        if not self.segments:
            self._idle_since = now
        advance = self.scheduler.advance(segment.run, segment.members, now, segment.steps)
        for state in advance.finished:
            self._close(state, finish=now)
            if self.stage_cost is not None:
                self._backlog_s += self.stage_cost(state)[1]
        if advance.ended:
            return []
        segment = self._start(segment.run, now)
        return [] if segment is None else [segment]

    def may_plan(self) -> bool:
        """Whether `decide` could start anything with nothing happening to this replica: a ready
        run not stepping, or work to place and a free device (a policy that declined may not
        later). Otherwise deciding is a no-op until an arrival or a segment's end here."""
        scheduler = self.scheduler
        if any(id(run) not in self.segments for run in scheduler.ready()):
            return True
        if not (scheduler.waiting or scheduler.running) or not scheduler.free_devices():
            return False
        in_runs = {rid for run in scheduler.runs for rid in run.batch.request_ids}
        return bool(scheduler.waiting) or any(rid not in in_runs for rid in scheduler.running)

    def _schedule(self, now: float) -> Plan:
        plan = self.scheduler.schedule(now)
        for rid in plan.drop:  # the Scheduler has forgotten them; the records keep them
            self.records[rid].dropped_at = now
        if plan:
            self.num_plans += 1
            if self.plans is not None:
                self.plans.append((now, plan))
        return plan

    def _start(self, run: Run, now: float) -> _Segment | None:
        """The next segment of `run` from `now`: as many steps as keep its members the same."""
        members = self.scheduler.members(run, now)
        until = self.scheduler.until
        if not members or (until is not None and now >= until - _SLACK):
            self.scheduler.end(run)
            return None
        states = {rid: self.scheduler.running[rid] for rid in members}
        step_s = self.step_cost(replace(run.batch, request_ids=tuple(members)), states)
        if not (math.isfinite(step_s) and step_s > 0):
            raise ValueError(f"step_cost must return finite seconds > 0, got {step_s} for {run.batch}")
        wait = 0.0
        if run.steps_run == 0:
            wait, self._backlog_s = self._backlog_s, 0.0
            moved = [self.scheduler.running[rid] for rid in run.moved if rid in states]
            if moved and self.handoff is not None:
                wait += max(self.handoff(state) for state in moved)  # they move at the same time
        steps = min(run.left, min(s.remaining_steps for s in states.values()))
        if until is not None:
            steps = min(steps, max(1, math.ceil((until - now - wait) / step_s - _SLACK)))
        seconds = wait + steps * step_s
        self.busy_device_s += seconds * run.batch.degree
        for rid in members:
            self.device_s[rid] = self.device_s.get(rid, 0.0) + seconds * run.batch.degree / len(members)
        self.num_steps += steps
        segment = self.segments[id(run)] = _Segment(run, members, steps, now + seconds)
        return segment

    def _work_off(self, now: float) -> None:
        """An idle replica spends the time since it went idle on the stage backlog."""
        if self.idle:
            self._backlog_s = max(0.0, self._backlog_s - (now - self._idle_since))
            self._idle_since = now

    def close(self) -> None:
        """At the end of a run: record when the requests still held had started, if they had."""
        for state in [*self.scheduler.waiting.values(), *self.scheduler.running.values()]:
            self._close(state)

    def _close(self, state: RequestState, finish: float | None = None) -> None:
        record = self.records[state.request_id]
        record.first_step = state.first_step_time  # the Scheduler stamps it when the first step starts
        record.finish = finish
        record.pauses = state.pauses

    def load(self) -> ReplicaLoad:
        """What a router sees of this replica: its batch and its queue, as plain values (built
        again only after the replica changed)."""
        if self._load is None:
            self._load = self._build_load()
        return self._load

    def _build_load(self) -> ReplicaLoad:
        running = [self._route_request(s) for s in self.scheduler.running.values()]
        waiting = [self._route_request(s) for s in self.scheduler.waiting.values()]
        max_batch = self.scheduler.policy.config.max_batch_size
        if self.idle:  # it plans before any time passes: its queue joins the batch that starts now
            free = max(max_batch - len(running), 0)
            running, waiting = running + waiting[:free], waiting[free:]
        return ReplicaLoad(running=running, waiting=waiting, max_batch=max_batch)

    def _route_request(self, state: RequestState) -> RouteRequest:
        return route_request(self.records[state.request_id].request, state.remaining_steps)


_SEGMENT_DONE, _ARRIVAL = 0, 1  # event kinds; at one instant, all are applied before scheduling


class Simulator:
    """Runs a trace through one replica per policy instance, each with `num_devices` devices.

    `policy` is one policy (one replica) or a sequence of distinct instances, one per replica;
    with more than one, `router` picks each arrival's replica.
    """

    def __init__(self, policy: Policy | Sequence[Policy], step_cost: StepCost, router: Router | None = None,
                 stage_cost: StageCost | None = None, num_devices: int = 1, handoff: HandoffCost | None = None,
                 record_plans: bool = False, admission: Admission | None = None):
        self.policies = [policy] if isinstance(policy, Policy) else list(policy)
        if not self.policies:
            raise ValueError("a simulation needs at least one replica: pass a policy")
        if len({id(p) for p in self.policies}) != len(self.policies):
            raise ValueError("each replica needs its own policy instance: make one per replica")
        if len(self.policies) > 1 and router is None:
            raise ValueError(f"{len(self.policies)} replicas need a router (see gouache.sched.router.ROUTERS)")
        if num_devices < 1:
            raise ValueError(f"num_devices must be >= 1, got {num_devices}")
        self.policy = self.policies[0]
        self.step_cost = step_cost
        self.router = router  # picks each arrival's replica; None with one replica
        self.stage_cost = stage_cost  # per request (prep, post) seconds on its replica's devices; None = free
        self.num_devices = num_devices  # per replica
        self.handoff = handoff  # seconds to move a started request between device groups; None = free
        self.record_plans = record_plans  # keep every plan in the result, for tests and traces
        self.admission = admission  # each replica's queue limit; None: every arrival is admitted
        self.replicas: list[Replica] = []  # those of the current (or last) run

    def run(self, requests: Sequence[SimRequest]) -> SimResult:
        records = {r.request_id: RequestRecord(r) for r in requests}
        if len(records) != len(requests):
            raise ValueError("request ids in a trace must be unique")
        plans: list[tuple[float, Plan]] | None = [] if self.record_plans else None
        self.replicas = [Replica(policy, self.step_cost, records, self.stage_cost, self.num_devices,
                                 self.handoff, plans)
                         for policy in self.policies]
        index = {id(replica): i for i, replica in enumerate(self.replicas)}
        events = [(r.arrival, _ARRIVAL, i, r) for i, r in enumerate(requests)]
        heapq.heapify(events)
        seq = len(events)  # tie-breaker: events of one kind at one instant keep their order
        now = min((r.arrival for r in requests), default=0.0)
        start, end = now, now
        pending: set[int] = set()  # replicas that may plan with no event of theirs (`Replica.may_plan`)
        while events:
            now = events[0][0]
            touched = set(pending)  # only these can plan now: deciding any other one is a no-op
            while events and events[0][0] == now:
                _, kind, _, payload = heapq.heappop(events)
                if kind == _SEGMENT_DONE:
                    replica, segment = payload
                    started = [(replica, s) for s in replica.segment_done(segment, now)]
                else:
                    record = records[payload.request_id]
                    replica = self._route(payload, record)
                    if self.admission is None or self.admission.admits(payload, replica):
                        replica.add(state_of(payload), now)
                    else:
                        record.refused_at = now
                    started = []
                touched.add(index[id(replica)])
                for item in started:
                    heapq.heappush(events, (item[1].end, _SEGMENT_DONE, seq, item))
                    seq += 1
            end = now  # events leave the heap in time order
            for i in sorted(touched):
                replica = self.replicas[i]
                for segment in replica.decide(now):
                    heapq.heappush(events, (segment.end, _SEGMENT_DONE, seq, (replica, segment)))
                    seq += 1
                (pending.add if replica.may_plan() else pending.discard)(i)
        for replica in self.replicas:
            replica.close()
        return SimResult(
            policy=self.policy.name, records=list(records.values()),
            busy_device_s=sum(r.busy_device_s for r in self.replicas), devices=len(self.replicas) * self.num_devices,
            start=start, end=end, num_steps=sum(r.num_steps for r in self.replicas),
            num_plans=sum(r.num_plans for r in self.replicas),
            device_s={rid: s for r in self.replicas for rid, s in r.device_s.items()}, plans=plans or [],
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
    """The router's view of a request: pixels, steps still to run, mask ratio (1 = generation), tier."""
    return RouteRequest(
        request_id=request.request_id,
        pixels=request.pixels,
        steps=request.steps if steps is None else steps,
        mask_ratio=1.0 if request.mask_ratio is None else request.mask_ratio,
        tier=Tier.named(request.tier),
    )


def simulate(requests: Sequence[SimRequest], policy: Policy | Sequence[Policy], step_cost: StepCost,
             router: Router | None = None, stage_cost: StageCost | None = None, num_devices: int = 1,
             handoff: HandoffCost | None = None, record_plans: bool = False,
             admission: Admission | None = None) -> SimResult:
    return Simulator(policy, step_cost, router, stage_cost, num_devices, handoff, record_plans,
                     admission).run(requests)
