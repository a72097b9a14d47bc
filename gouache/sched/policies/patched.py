"""`patched`: every running request, whatever its size, in ONE forward per step (PatchedServe's
"PatchedCache" admission: FCFS up to capacity, no SLO awareness), by tier first
(`tiers.make_room`: a lower tier's running request gives its slot to a higher tier's).

The runner cuts each latent into patches of one size and restores the cross-patch context
that convolutions, GroupNorm and self-attention need, so mixed sizes batch without waiting
for a same-size partner.
"""

from __future__ import annotations

from collections.abc import Sequence

from gouache.request import RequestState
from gouache.sched.interface import Devices, Policy
from gouache.sched.plan import Plan, one_step
from gouache.sched.tiers import make_room


class PatchedPolicy(Policy):
    name = "patched"
    pauses = True
    mixes_resolutions = True

    def plan(self, waiting: Sequence[RequestState], running: Sequence[RequestState], now: float,
             devices: Devices) -> Plan:
        kept, admitted, paused = make_room(waiting, running, self.config.max_batch_size)
        batch = [s.request_id for s in (*kept, *admitted)]
        return one_step([batch], [s.request_id for s in admitted], patched=True, pause=paused)
