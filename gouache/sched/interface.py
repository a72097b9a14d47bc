"""The interfaces of scheduling: what a policy is, what it reads, and what it plans with.

A policy is pure: it reads the waiting and running `RequestState`s, the free devices and a cost
model, and returns a `Plan` (plan.py). The `Scheduler` (scheduler.py) owns the states and is
the only thing that changes them, so the live engine and the simulator drive the same policy
objects.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from gouache.config import SchedulerConfig
from gouache.request import RequestState
from gouache.sched.plan import Plan

Resolution = tuple[int, ...]  # (height, width) in pixels, then a clip's frames (`ImageRequest.shape`)


def as_resolution(res: int | Sequence[int]) -> Resolution:
    """`1024` means (1024, 1024); a pair is (height, width), a triple a clip's (height, width, frames)."""
    if isinstance(res, int):
        return (res, res)
    if len(res) not in (2, 3):
        raise ValueError(f"a resolution is (height, width) or (height, width, frames), got {tuple(res)}")
    return tuple(int(side) for side in res)


class StepTimePredictor(Protocol):
    """Predicted seconds of one denoising step of one forward, from its images' resolutions."""

    def step_time(self, resolutions: Sequence[Resolution], patched: bool, degree: int = 1) -> float:
        """One forward over `resolutions` (one patched forward if `patched`, else one plain
        forward per distinct resolution) on `degree` devices of sequence parallelism;
        math.inf where it cannot run (a degree or batch the model does not price)."""

    def sizes(self, patched: bool) -> set[Resolution] | None:
        """The resolutions `step_time` can price; None: any."""


@dataclass(frozen=True)
class Devices:
    """The device pool of one replica as a policy sees it when it plans."""

    count: int  # devices 0..count-1
    free: tuple[int, ...]  # those running nothing now, ascending


class Policy(ABC):
    """Chooses batches for the free devices. Must not mutate the states it is given."""

    name: str
    mixes_resolutions = False  # plans put several resolutions in one (patched) forward
    needs_predictor = False  # SLO-aware policies plan with predicted step times
    uses_deadlines = False  # plans read requests' deadlines (slo_ms); others would ignore them
    rounds = False  # plans are rounds (Plan.until), made only when every device is free
    pauses = False  # plans pause running requests of a lower tier (Plan.pause)
    min_devices = 1  # the smallest pool it can plan
    max_devices: int | None = 1  # the largest pool it can plan; None: any (it places by degree)

    def __init__(self, config: SchedulerConfig, predictor: StepTimePredictor | None = None):
        if self.needs_predictor and predictor is None:
            raise ValueError(f"policy {self.name!r} needs a step-time cost model (see `gouache profile`)")
        self.config = config
        self.predictor = predictor

    def can_plan_on(self, live: Devices) -> bool:
        """Whether it can still plan once the pool is down to `live.free`, every device that is
        not lost for good (a dead worker), as when nothing runs. When it cannot, the engine
        stops rather than let requests wait for devices that never come back. A step policy
        plans every step on device 0 (`one_step`), so by default that one must be live."""
        return 0 in live.free

    def needs(self, num_devices: int) -> str:
        """What `can_plan_on` asks of the live devices of a pool of `num_devices`, in words, for
        the error that stops a pool without it."""
        return "device 0, where it plans every step"

    def degrees(self, num_devices: int) -> set[int]:
        """The sequence-parallel degrees its plans can give a batch on a pool of `num_devices`,
        so a server can refuse, before serving, a degree its model cannot run."""
        return {1}

    @abstractmethod
    def plan(self, waiting: Sequence[RequestState], running: Sequence[RequestState], now: float,
             devices: Devices) -> Plan:
        """`waiting` is in arrival order; `running` (admitted, not in a batch that is still
        running) in admission order; batches may use `devices.free` only."""


def aligned_blocks(devices: Devices, k: int) -> list[tuple[int, ...]]:
    """The aligned blocks of `k` devices (degree k sits on [a*k, (a+1)*k)) all of whose devices
    are in `devices.free`, in order."""
    free = set(devices.free)
    return [block for a in range(0, devices.count - k + 1, k) if free.issuperset(block := tuple(range(a, a + k)))]


def group_by_resolution(states: Sequence[RequestState]) -> list[list[str]]:
    """One group per resolution, in order of first appearance: one plain forward each."""
    groups: dict[Resolution, list[str]] = {}
    for state in states:
        groups.setdefault(state.resolution, []).append(state.request_id)
    return list(groups.values())
