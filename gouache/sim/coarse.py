"""Coarser time for step policies: each plan runs for up to k steps instead of one.

A step policy (orca, patched-slo, ...) is asked for a plan after every step, and at fleet scale
those decisions are most of the simulator's time (a 28-step request alone on its replica is 28
plans). `CoarseSteps(policy, k)` runs each batch of the policy's plan for up to k steps, and never
past the step where its first member finishes, so a freed slot is refilled at once. What it
changes: a request that arrives at a busy replica joins at the end of the current k steps
instead of the next step (up to k - 1 steps later), a plan's forwards of different sizes take
turns every k steps instead of every step, and a deadline policy's drops and pauses are decided
every k steps. A replica that is idle admits at the arrival, as before. k = 1 is the policy
itself. `exp_fleet_day_error` measures what k moves against k = 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from gouache.request import RequestState
from gouache.sched.interface import Devices, Policy
from gouache.sched.plan import Plan

_TRAITS = ("name", "mixes_resolutions", "needs_predictor", "uses_deadlines", "rounds", "pauses", "min_devices",
           "max_devices")


class CoarseSteps(Policy):
    """`policy`'s plans, each batch run for up to `steps` steps (its first member's last one at most)."""

    def __init__(self, policy: Policy, steps: int):
        if policy.rounds or policy.max_devices != 1:
            raise ValueError(f"{policy.name} is not a step policy: its plans already run many steps")
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        for trait in _TRAITS:
            setattr(self, trait, getattr(policy, trait))
        super().__init__(policy.config, policy.predictor)
        self.policy = policy
        self.steps = steps

    def plan(self, waiting: Sequence[RequestState], running: Sequence[RequestState], now: float,
             devices: Devices) -> Plan:
        plan = self.policy.plan(waiting, running, now, devices)
        if self.steps == 1 or not plan.batches:
            return plan
        admitted = set(plan.admit)
        left = {s.request_id: s.remaining_steps for s in running}
        left |= {s.request_id: s.remaining_steps for s in waiting if s.request_id in admitted}
        return replace(plan, batches=[replace(b, steps=min(self.steps, *(left[r] for r in b.request_ids)))
                                      for b in plan.batches])
