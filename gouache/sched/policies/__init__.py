"""Scheduling policies, picked by name (`--policy`): one registry for step, run-to-completion
and round policies alike."""

from __future__ import annotations

from gouache.config import SchedulerConfig
from gouache.sched.interface import Policy, StepTimePredictor
from gouache.sched.policies.fcfs_static import FcfsStaticPolicy
from gouache.sched.policies.fixed_sp import DEGREES, fixed_sp
from gouache.sched.policies.orca import OrcaPolicy
from gouache.sched.policies.patched import PatchedPolicy
from gouache.sched.policies.patched_slo import PatchedSloPolicy
from gouache.sched.policies.round_knapsack import RoundKnapsackPolicy

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (FcfsStaticPolicy, OrcaPolicy, PatchedPolicy, PatchedSloPolicy, RoundKnapsackPolicy,
                *(fixed_sp(k) for k in DEGREES))
}


def make_policy(config: SchedulerConfig, predictor: StepTimePredictor | None = None) -> Policy:
    if config.policy not in POLICIES:
        raise ValueError(f"unknown policy {config.policy!r}; choose one of {', '.join(POLICIES)}")
    if config.max_batch_size is None:
        raise ValueError("max_batch_size auto is measured on the model (`build_engine`) before a policy is made")
    return POLICIES[config.policy](config, predictor)
