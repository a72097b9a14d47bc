"""The data and per-round arithmetic of TetriServe's round-based scheduler (§4.2).

Shared by the group-knapsack DP (`knapsack.py`), GPU placement (`placement.py`), elastic
scale-up (`elastic.py`) and selective batching (`batching.py`). Pure Python: no torch.

Time is in seconds on one clock, the caller's `now`; deadlines are absolute on that clock.
Devices are numbered 0..N-1 and a request runs on a power-of-two number of them, its
sequence-parallel degree k. A round lasts τ seconds from `now`; its end is t_{r+1} = now + τ.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from functools import cache
from typing import Any

StepTime = Callable[[Any, int], float]  # (resolution, degree k) -> seconds per denoising step on k devices
BatchStepTime = Callable[[Any, int], float]  # (resolution, batch size b) -> s per step of b requests on one device

_FLOOR_SLACK = 1e-9  # τ / T is floored; this keeps 0.3 / 0.1 = 2.9999999999999996 at 3 steps


@dataclass(slots=True)
class RoundRequest:
    """The scheduler's view of one request at a round boundary (no `now`-relative fields).

    Treat as immutable; it is not frozen because a round policy builds one per request every
    round, and a frozen dataclass takes three times as long to build. For the same reason it
    checks nothing itself: `plan_round` rejects remaining_steps < 1 as it reads each request."""

    request_id: str
    resolution: Hashable  # cost-model key, e.g. (height, width); only equal resolutions batch
    remaining_steps: int  # denoising steps still to run, >= 1 (finished requests leave the round)
    deadline: float = math.inf  # absolute seconds on the caller's clock; inf = no SLO
    # its service tier's rank (`gouache.sched.tiers`): a lower rank's deadline outranks any number of others'
    tier: int = 1


@dataclass(frozen=True)
class Allocation:
    """One part (s^m, A^m) of a request's deadline-aware plan: `steps` steps on `degree` devices."""

    steps: int
    degree: int


@dataclass(frozen=True)
class RoundOption:
    """One choice o in O_i for a request this round: an item of its knapsack group."""

    degree: int  # devices it takes this round, w_i(o); 0 = "none" (it does not run)
    steps: int  # steps it completes this round, q_i^m; 0 for none
    survives: bool  # sv_i(o): still able to meet its deadline after this round (not definitely late)

    @property
    def width(self) -> int:
        return self.degree

    @property
    def value(self) -> int:
        return int(self.survives)


@dataclass(frozen=True)
class RoundAllocation:
    """Where and how much one request runs in this round."""

    devices: tuple[int, ...]  # [degree] device ids, ascending, an aligned block; batch-mates share it
    steps: int  # denoising steps to run this round, >= 1


@dataclass
class RoundDecision:
    """What the round planner decided for one round of τ seconds (a policy turns it into a `Plan`)."""

    allocations: dict[str, RoundAllocation]  # request id -> devices and steps; absent = idles this round
    batches: list[list[str]]  # [groups][members] ids sharing one forward on the same devices, host first; each >= 2
    late: list[str]  # ids definitely late at t_{r+1} under this plan: even the fastest degree then misses D


def max_degree(num_devices: int) -> int:
    """The largest power of two that fits in `num_devices`."""
    return 1 << (num_devices.bit_length() - 1)


@cache
def degrees(top: int) -> tuple[int, ...]:
    """The degrees K = {1, 2, 4, ..., top}."""
    return tuple(1 << i for i in range(top.bit_length()) if 1 << i <= top)


def steps_in_round(step_s: float, tau: float, cap: int) -> int:
    """q = min(cap, floor(τ / T)): the steps a request completes in one round at T seconds each."""
    return min(cap, math.floor(tau / step_s + _FLOOR_SLACK))


def fastest_step(request: RoundRequest, step_time: StepTime, top: int) -> float:
    """T_i^min: the request's step time at its fastest degree in K."""
    return cached(step_time).fastest(request.resolution, top)


def survives(request: RoundRequest, done: int, step_s: float, t_min: float, tau: float, now: float) -> bool:
    """sv: can `request` still meet its deadline after running `done` steps of `step_s` s this round?

    The paper's test is t_{r+1} + LB <= D with LB = (steps left) x T_min. A request that finishes
    inside the round completes at now + done x step_s, so that is what it is held to instead.
    """
    left = request.remaining_steps - done
    if left <= 0:
        return now + done * step_s <= request.deadline
    return now + tau + left * t_min <= request.deadline


@dataclass(frozen=True)
class DegreeRow:
    """T(res, k) over the degrees K for one resolution, and what round planning reads of it."""

    times: tuple[tuple[int, float], ...]  # [|K|] (k, T(res, k)), ascending k
    faster: tuple[tuple[tuple[int, float], ...], ...]  # [|K|] per entry of times, the (k', T') with T' < T, in order
    cheapest: tuple[int, float]  # the (k, T) of least device-time k x T per step, the smaller k on a tie
    fastest: float  # T_min: the least T over K


class StepTable:
    """A cost function T(res, k), memoised and checked to be positive (inf = cannot run), with
    its row over K per resolution: one round asks for the same few values thousands of times."""

    def __init__(self, step_time: StepTime):
        self._step_time = step_time
        self._times: dict[Any, dict[int, float]] = {}
        self._rows: dict[tuple[Any, int], DegreeRow] = {}

    def __call__(self, resolution: Any, k: int) -> float:
        row = self._times.setdefault(resolution, {})
        t = row.get(k)
        if t is None:
            t = self._step_time(resolution, k)
            if not t > 0:
                raise ValueError(f"step_time({resolution!r}, {k}) = {t}; step times must be > 0 seconds")
            row[k] = t
        return t

    def row(self, resolution: Any, top: int) -> DegreeRow:
        """The row of `resolution` over K = degrees(top)."""
        row = self._rows.get((resolution, top))
        if row is None:
            times = tuple((k, self(resolution, k)) for k in degrees(top))
            row = self._rows[(resolution, top)] = DegreeRow(
                times=times,
                faster=tuple(tuple((k, t) for k, t in times if t < t_slow) for _, t_slow in times),
                cheapest=min(times, key=lambda kt: (kt[0] * kt[1], kt[0])),
                fastest=min(t for _, t in times),
            )
        return row

    def fastest(self, resolution: Any, top: int) -> float:
        """T_min: the least T(res, k) over K."""
        return self.row(resolution, top).fastest


def cached(step_time: StepTime) -> StepTable:
    """`step_time` as a `StepTable` (itself if it already is one)."""
    return step_time if isinstance(step_time, StepTable) else StepTable(step_time)
