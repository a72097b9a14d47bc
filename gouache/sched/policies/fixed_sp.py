"""`fixed-sp-k`: xDiT-style serving with a fixed sequence-parallel degree (TetriServe §6.1).

Every request runs on k devices from its first step to its last; requests are admitted first
come, first served whenever an aligned block of k devices is free. Deadlines are ignored:
a late request still runs to the end. With N a multiple of k this is N/k independent workers.
"""

from __future__ import annotations

from collections.abc import Sequence

from gouache.sched.rounds import BatchStepTime, RoundAllocation, RoundPlan, StepTime
from gouache.sched.rounds_interface import Placement, RoundConfig, RoundPolicy, RoundState


class FixedSpPolicy(RoundPolicy):
    preemptive = False

    def __init__(self, step_time: StepTime, config: RoundConfig | None = None,
                 batch_step_time: BatchStepTime | None = None, *, degree: int):
        if degree < 1 or degree & (degree - 1):
            raise ValueError(f"the sequence-parallel degree must be a power of two, got {degree}")
        super().__init__(step_time, config, batch_step_time)
        self.degree = degree
        self.name = f"fixed-sp-{degree}"

    def plan(self, waiting: Sequence[RoundState], running: Sequence[RoundState], now: float,
             num_devices: int, previous_placement: Placement | None = None) -> RoundPlan:
        k = self.degree
        if k > num_devices:
            raise ValueError(f"{self.name} needs {k} devices but the pool has {num_devices}")
        held = previous_placement or {}
        allocations = {s.request_id: RoundAllocation(tuple(held[s.request_id]), s.remaining_steps) for s in running}
        busy = {d for a in allocations.values() for d in a.devices}
        free = [tuple(range(a, a + k)) for a in range(0, num_devices - k + 1, k) if busy.isdisjoint(range(a, a + k))]
        for state, block in zip(sorted(waiting, key=lambda s: s.arrival_time), free):
            allocations[state.request_id] = RoundAllocation(block, state.remaining_steps)
        return RoundPlan(allocations=allocations, batches=[], late=[])
