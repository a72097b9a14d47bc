"""The scheduler: holds request states, asks the policy for plans, and follows their execution.

Drivers (the engine loop, the simulator) call `schedule(now)` whenever something may have
changed (an arrival, a batch that ended, a round that ran out) and get a `Plan` (empty when
there is nothing to decide); they run each of its `Run`s that is `ready` step by step (or, the
simulator, several steps at a time) and report each with `advance`. One contract for every
policy:

- a step policy plans one step on device 0; it is asked again once that step has run;
- a run-to-completion policy (fixed-sp-k) is asked whenever devices are free and requests
  wait; batches still running keep their devices;
- a round policy (round-knapsack) is asked only when every device is free; its plan's batches
  stop at their first step boundary past `Plan.until`, and the next round is planned when the
  last one has stopped (or all are done).

Policies see the waiting requests in `tiers.queue_order` (tier, then fair share among
tenants, then arrival: the order `sched.waiting` keeps as they come and go, with no sort per
decision) and the running ones by tier; a plan may pause running requests (step
policies, for a higher tier's waiting request: `tiers.make_room`), which go back to waiting with
their progress and latents kept.

A request remembers its devices in the last plan it was offered to (`RequestState.devices`,
() if that plan left it out), for placement preservation (TetriServe keeps last round's
devices); the scheduler also remembers where its latents are, however long ago it ran, so a
driver can charge moving them (`Run.moved`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gouache.request import RequestState, RequestStatus
from gouache.sched.interface import Devices, Policy
from gouache.sched.plan import Batch, Plan
from gouache.sched.tiers import FairQueue
from gouache.sched.waiting import WaitingQueue

_UNTIL_SLACK = 1e-9  # a step that ends exactly at a round's end counts as ending it


@dataclass
class Run:
    """A batch of the current plan that has not ended."""

    batch: Batch
    left: int  # steps it may still run
    moved: tuple[str, ...] = ()  # started members whose latents come from other devices
    steps_run: int = 0

    @property
    def devices(self) -> tuple[int, ...]:
        return self.batch.devices


@dataclass
class Advance:
    """What `Scheduler.advance` did."""

    finished: list[RequestState] = field(default_factory=list)  # done denoising, forgotten by the scheduler
    ended: bool = False  # the run is over: its devices are free


def check_devices(policy: Policy | type[Policy], num_devices: int) -> None:
    """Refuse a pool size the policy cannot plan (a step policy plans one device, fixed-sp-k k or more)."""
    least, most = policy.min_devices, policy.max_devices
    if num_devices < least or (most is not None and num_devices > most):
        if least == most:
            allowed = f"exactly {least} device{'s' * (least > 1)}"
        else:
            allowed = f"{least} or more devices" if most is None else f"{least} to {most} devices"
        raise ValueError(f"policy {policy.name!r} plans {allowed}, not {num_devices}")


class Scheduler:
    """Owns the waiting and running states of one replica's pool of `num_devices` devices."""

    def __init__(self, policy: Policy, num_devices: int = 1):
        check_devices(policy, num_devices)
        self.policy = policy
        self.num_devices = num_devices
        self.waiting = WaitingQueue()  # id -> state in arrival order, with its orders kept (`sched.waiting`)
        self.running: dict[str, RequestState] = {}  # insertion order = admission order
        self.runs: list[Run] = []  # the current plans' batches that have not ended, in plan order
        self.until: float | None = None  # the current round's end, while its batches run
        self.lost: set[int] = set()  # devices whose workers died: never free again
        self.latents_on: dict[str, tuple[int, ...]] = {}  # started request -> devices holding its latents
        self.fair = FairQueue()  # each tier's share among its tenants

    def add(self, state: RequestState) -> None:
        state.status = RequestStatus.WAITING
        self.fair.tag(state)
        self.waiting[state.request_id] = state

    def abort(self, request_id: str) -> RequestState | None:
        """Forget a request wherever it is; returns its state if it was known. A run it was in
        goes on without it."""
        self.latents_on.pop(request_id, None)
        return self.waiting.pop(request_id, None) or self.running.pop(request_id, None)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def request_ids(self) -> list[str]:
        return [*self.waiting, *self.running]

    def free_devices(self) -> tuple[int, ...]:
        busy = {d for run in self.runs for d in run.devices} | self.lost
        return tuple(d for d in range(self.num_devices) if d not in busy)

    def lose(self, devices: set[int]) -> list[RequestState]:
        """Devices are gone for good: their runs end, and the requests in those runs or whose
        latents were there are forgotten and returned (the caller fails them)."""
        self.lost |= devices
        for run in [r for r in self.runs if devices & set(r.devices)]:
            self.end(run)
        gone = [rid for rid, where in self.latents_on.items() if devices & set(where)]
        return [state for rid in gone if (state := self.abort(rid)) is not None]

    def live(self) -> Devices:
        """The pool as its policy would find it with nothing running: every device not lost."""
        return Devices(self.num_devices, tuple(d for d in range(self.num_devices) if d not in self.lost))

    def can_serve(self) -> bool:
        """Whether the policy can still plan on the devices not lost (else requests would wait forever)."""
        return self.policy.can_plan_on(self.live())

    def ready(self) -> list[Run]:
        """The runs that may step now: the first of the runs on each device group."""
        taken: set[int] = set()
        ready = []
        for run in self.runs:
            if taken.isdisjoint(run.devices):
                ready.append(run)
            taken.update(run.devices)
        return ready

    def unplannable(self, now: float) -> dict[str, str]:
        """The requests the policy fails to plan even alone, with the error each raised: for
        the engine to blame a failed plan on the requests that caused it."""
        blamed = {}
        devices = Devices(self.num_devices, tuple(range(self.num_devices)))
        for state in [*self.waiting.values(), *self.running.values()]:
            alone = ([state], []) if state.request_id in self.waiting else ([], [state])
            try:
                self.policy.plan(*alone, now, devices)
            except Exception as error:
                blamed[state.request_id] = f"{type(error).__name__}: {error}"
        return blamed

    def schedule(self, now: float) -> Plan:
        """Ask the policy if this is a moment to decide, and apply its plan: dropped requests
        are forgotten (the caller reports them), admitted ones start running, batches become
        runs. An empty plan when there is nothing to decide."""
        free = self.free_devices()
        if not free or (self.runs and self.policy.rounds):
            return Plan()
        in_runs = {rid for run in self.runs for rid in run.batch.request_ids}
        running = sorted((s for rid, s in self.running.items() if rid not in in_runs), key=lambda s: s.tier)
        if not (self.waiting or running):
            return Plan()
        plan = self.policy.plan(self.waiting.ordered, running, now, Devices(self.num_devices, free))
        self._check(plan, free, {s.request_id for s in running})
        for rid in plan.drop:
            del self.waiting[rid]
        for rid in plan.pause:
            state = self.running.pop(rid)
            state.status = RequestStatus.WAITING
            state.pauses += 1
            self.waiting[rid] = state
        for rid in plan.admit:
            state = self.waiting.pop(rid)
            state.status = RequestStatus.RUNNING
            self.fair.admitted(state)
            self.running[rid] = state
        for state in running:
            state.devices = ()  # unless the plan places it again
        for batch in plan.batches:
            moved = []
            for rid in batch.request_ids:
                if self.latents_on.get(rid, batch.devices) != batch.devices:
                    moved.append(rid)
                self.running[rid].devices = batch.devices
            self.runs.append(Run(batch, batch.steps, tuple(moved)))
        self.until = plan.until if plan.batches else None
        return plan

    def members(self, run: Run, now: float) -> list[str]:
        """The ids of `run` that step next (those not finished, failed or aborted); stamps
        their first step's time."""
        ids = []
        for rid in run.batch.request_ids:
            state = self.running.get(rid)
            if state is not None and not state.done:
                if state.first_step_time is None:
                    state.first_step_time = now
                ids.append(rid)
        return ids

    def advance(self, run: Run, stepped: list[str], now: float, steps: int = 1) -> Advance:
        """`stepped` ran `steps` more steps of `run`, ending at `now`. Finished requests are
        forgotten and returned; the run ends when it has no steps or members left, or its
        round ran out."""
        result = Advance()
        for rid in stepped:
            state = self.running.get(rid)
            if state is None:  # aborted while its step ran
                continue
            state.steps_done += steps
            self.latents_on[rid] = run.devices
            if state.done:
                state.status = RequestStatus.POSTPROCESSING
                self.latents_on.pop(rid, None)
                result.finished.append(self.running.pop(rid))
        run.left -= steps
        run.steps_run += steps
        out_of_time = self.until is not None and now >= self.until - _UNTIL_SLACK
        if run.left <= 0 or out_of_time or not self.members(run, now):
            self.end(run)
            result.ended = True
        return result

    def end(self, run: Run) -> None:
        """Retire a run (done, stopped, or failed as a whole)."""
        self.runs.remove(run)
        if not self.runs:
            self.until = None

    def _check(self, plan: Plan, free: tuple[int, ...], running: set[str]) -> None:
        """A plan must use free devices and known requests, each in one batch at most."""
        name = self.policy.name
        ids = plan.request_ids
        if len(ids) != len(set(ids)):
            raise ValueError(f"{name} put a request in two batches: {ids}")
        for rid in ids:
            if rid not in running and rid not in plan.admit:
                raise ValueError(f"{name} planned {rid}, which is neither running nor admitted")
        for rid in (*plan.admit, *plan.drop):
            if rid not in self.waiting:
                raise ValueError(f"{name} admitted or dropped {rid}, which is not waiting")
        if not set(plan.admit) <= set(ids) or set(plan.drop) & set(ids):
            raise ValueError(f"{name} admitted a request it runs in no batch, or ran one it dropped")
        if not set(plan.pause) <= running or set(plan.pause) & set(ids):
            raise ValueError(f"{name} paused a request that is not running, or ran one it paused")
        if not all(d in free for batch in plan.batches for d in batch.devices):
            raise ValueError(f"{name} planned devices outside the free ones {free}")
        if plan.until is not None and not self.policy.rounds:
            raise ValueError(f"{name} is not a round policy but its plan ends at a time")
