"""`patched`: every running request, whatever its size, in ONE forward per step (PatchedServe's
"PatchedCache" admission: FCFS up to capacity, no SLO awareness).

The runner cuts each latent into patches of one size and restores the cross-patch context
that convolutions, GroupNorm and self-attention need, so mixed sizes batch without waiting
for a same-size partner.
"""

from __future__ import annotations

from collections.abc import Sequence

from gouache.request import RequestState
from gouache.sched.interface import Devices, Policy
from gouache.sched.plan import Plan, one_step


class PatchedPolicy(Policy):
    name = "patched"
    mixes_resolutions = True

    def plan(self, waiting: Sequence[RequestState], running: Sequence[RequestState], now: float,
             devices: Devices) -> Plan:
        free = max(self.config.max_batch_size - len(running), 0)
        admitted = list(waiting[:free])
        batch = [s.request_id for s in (*running, *admitted)]
        return one_step([batch], [s.request_id for s in admitted], patched=True)
