"""`fixed-sp-k`: xDiT-style serving with a fixed sequence-parallel degree (TetriServe §6.1).

Every request runs on k devices from its first step to its last; requests are admitted first
come, first served whenever an aligned block of k devices is free. Deadlines are ignored:
a late request still runs to the end. With N a multiple of k this is N/k independent workers.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from gouache.request import RequestState
from gouache.sched.interface import Devices, Policy, aligned_blocks
from gouache.sched.plan import Batch, Plan

DEGREES = (1, 2, 4, 8)


class FixedSpPolicy(Policy):
    degree: int
    max_devices = None

    def degrees(self, num_devices: int) -> set[int]:
        return {self.degree}

    def can_plan_on(self, live: Devices) -> bool:
        """Every request needs k devices of one aligned block: a lost device takes its block
        out for good, and with no whole block left no request can ever run again."""
        return bool(aligned_blocks(live, self.degree))

    def needs(self, num_devices: int) -> str:
        k = self.degree
        if k == 1:
            return "one live device"
        blocks = [f"{a}-{a + k - 1}" for a in range(0, num_devices - k + 1, k)]
        return f"an aligned block of {k} live devices ({' or '.join(blocks)})"

    def plan(self, waiting: Sequence[RequestState], running: Sequence[RequestState], now: float,
             devices: Devices) -> Plan:
        blocks = aligned_blocks(devices, self.degree)
        # the running first, then the waiting by tier, fair share and arrival (`tiers.queue_order`):
        # only as many as there are free blocks are read
        queue = itertools.chain(running, waiting)
        batches = [Batch((s.request_id,), block, s.remaining_steps) for s, block in zip(queue, blocks)]
        return Plan(batches=batches, admit=[b.request_ids[0] for b in batches[len(running):]])


def fixed_sp(degree: int) -> type[FixedSpPolicy]:
    """The policy class `fixed-sp-<degree>`."""
    return type(f"FixedSp{degree}Policy", (FixedSpPolicy,), {"name": f"fixed-sp-{degree}", "degree": degree,
                                                             "min_devices": degree})
