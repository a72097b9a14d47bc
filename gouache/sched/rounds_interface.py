"""Round policies: which requests run on which of N devices, and for how many steps.

A step policy (`interface.Policy`) plans the next step of one device. A round policy plans a
pool of N devices at once and returns a `RoundPlan` (rounds.py): per request an aligned block
of devices and the steps to run there. Two timings exist, told apart by `preemptive`:

- preemptive (`round-knapsack`): planned at every round boundary, τ seconds apart; a plan
  holds for that round only, so a request may move or change degree between rounds.
- run-to-completion (`fixed-sp-k`): planned whenever a request arrives or devices free up; a
  started request keeps its devices until the steps it was given are done, so a plan repeats
  the allocation of every request in flight unchanged.

Policies are pure: they read request states and return a plan; nothing here imports torch.
Pick one by name with `make_round_policy`; `ROUND_POLICY_NAMES` lists them.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Protocol

from gouache.sched.rounds import BatchStepTime, RoundPlan, RoundRequest, StepTime, cached

ROUND_POLICY_NAMES = ("round-knapsack", "fixed-sp-1", "fixed-sp-2", "fixed-sp-4", "fixed-sp-8")

Placement = Mapping[str, Sequence[int]]  # request id -> the devices it ran on (or runs on) last


class RoundState(Protocol):
    """What a round policy reads of a request; `gouache.request.RequestState` is one."""

    request_id: str
    shape: tuple[int, int]  # (latent height, latent width)
    arrival_time: float  # FCFS order
    deadline: float | None  # absolute, on the `now` clock; None = no SLO

    @property
    def remaining_steps(self) -> int: ...


@dataclass
class RoundConfig:
    """Knobs shared by the round policies."""

    tau: float = 0.5  # round length in seconds (preemptive policies only)
    vae_scale: int = 8  # image pixels per latent pixel: a state's resolution is shape x vae_scale
    max_batch: int = 8  # most requests one selective batch may hold
    run_late: bool = True  # give idle devices to requests that will miss their deadline anyway

    def __post_init__(self) -> None:
        if not self.tau > 0:
            raise ValueError(f"tau (round length) must be > 0 seconds, got {self.tau}")
        if self.vae_scale < 1 or self.max_batch < 1:
            raise ValueError("vae_scale and max_batch must be >= 1")


class RoundPolicy(ABC):
    """Plans the devices of one pool. Must not mutate the states it is given."""

    name: str
    preemptive: bool  # True: replanned every τ; False: a started request holds its devices

    def __init__(self, step_time: StepTime, config: RoundConfig | None = None,
                 batch_step_time: BatchStepTime | None = None):
        self.step_time = cached(step_time)  # (resolution (h, w) px, k) -> s per step; memoised across rounds
        self.config = config or RoundConfig()
        self.batch_step_time = batch_step_time  # (resolution, b) -> seconds per step of b on one device; None = no batching
        self._made: dict[str, RoundRequest] = {}  # request id -> its last RoundRequest (see round_requests)

    def resolution(self, state: RoundState) -> tuple[int, int]:
        """The cost model's key of a state: (height, width) in pixels."""
        return (state.shape[0] * self.config.vae_scale, state.shape[1] * self.config.vae_scale)

    def round_requests(self, states: Iterable[RoundState]) -> list[RoundRequest]:
        """Each state as the `RoundRequest` the round planners read.

        A round converts every request, and most are the same as last round (a waiting
        request's steps do not change), so the last one made for each id is kept and reused
        while its remaining steps are unchanged (its resolution and deadline never change).
        That cuts the conversion of a long queue about 3x. When more ids are kept than twice
        this round's, only this round's are kept on."""
        vae, inf, made = self.config.vae_scale, math.inf, self._made
        out = []
        for s in states:
            steps = s.remaining_steps
            r = made.get(s.request_id)
            if r is None or r.remaining_steps != steps:
                r = made[s.request_id] = RoundRequest(s.request_id, (s.shape[0] * vae, s.shape[1] * vae), steps,
                                                      inf if s.deadline is None else s.deadline)
            out.append(r)
        if len(made) > 2 * len(out):
            self._made = {r.request_id: r for r in out}
        return out

    @abstractmethod
    def plan(self, waiting: Sequence[RoundState], running: Sequence[RoundState], now: float,
             num_devices: int, previous_placement: Placement | None = None) -> RoundPlan:
        """`waiting`: not started, in arrival order. `running`: started and not finished (for a
        run-to-completion policy: in flight on the devices `previous_placement` gives).
        `previous_placement`: each request's devices in the last round, or now if in flight."""


def make_round_policy(name: str, step_time: StepTime, config: RoundConfig | None = None,
                      batch_step_time: BatchStepTime | None = None) -> RoundPolicy:
    """A round policy by name, from `round_policy_registry()`."""
    registry = round_policy_registry()
    if name not in registry:
        raise ValueError(f"unknown round policy {name!r}; choose one of {', '.join(registry)}")
    return registry[name](step_time, config, batch_step_time)


def round_policy_registry() -> dict[str, Callable[..., RoundPolicy]]:
    """name -> factory(step_time, config, batch_step_time), separate from the step policies'
    `POLICIES`. Built on call, not at import: the policy modules import this one."""
    from gouache.sched.policies.fixed_sp import FixedSpPolicy
    from gouache.sched.policies.round_knapsack import RoundKnapsackPolicy

    registry: dict[str, Callable[..., RoundPolicy]] = {RoundKnapsackPolicy.name: RoundKnapsackPolicy}
    for k in (1, 2, 4, 8):
        registry[f"fixed-sp-{k}"] = partial(FixedSpPolicy, degree=k)
    return registry
