"""`fcfs-static`: what diffusers-based servers do (the baseline).

The oldest waiting request picks the resolution; up to `max_batch_size` waiting requests of
that resolution form one static batch, which runs until every member is done. Nobody joins a running
batch, so a short request that arrives during a long one waits for all of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice

from gouache.request import RequestState
from gouache.sched.interface import Devices, Policy
from gouache.sched.plan import Plan, one_step


class FcfsStaticPolicy(Policy):
    name = "fcfs-static"

    def plan(self, waiting: Sequence[RequestState], running: Sequence[RequestState], now: float,
             devices: Devices) -> Plan:
        if running:
            return one_step([[s.request_id for s in running]], [])
        if not waiting:
            return Plan()
        resolution = waiting[0].resolution
        same = (s.request_id for s in waiting if s.resolution == resolution)
        batch = list(islice(same, self.config.max_batch_size))  # reads the queue only up to a full batch
        return one_step([batch], batch)
