"""Scheduling policies, picked by name (`--policy`)."""

from __future__ import annotations

from gouache.config import SchedulerConfig
from gouache.sched.interface import Policy
from gouache.sched.policies.fcfs_static import FcfsStaticPolicy
from gouache.sched.policies.orca import OrcaPolicy
from gouache.sched.policies.patched import PatchedPolicy

POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in (FcfsStaticPolicy, OrcaPolicy, PatchedPolicy)}


def make_policy(config: SchedulerConfig) -> Policy:
    if config.policy not in POLICIES:
        raise ValueError(f"unknown policy {config.policy!r}; choose one of {', '.join(POLICIES)}")
    return POLICIES[config.policy](config)
