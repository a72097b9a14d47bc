"""`orca`: step-level continuous batching, one forward per resolution.

Waiting requests join the running set at the next step (by tier, then fair share and arrival,
up to `max_batch_size`); a finished request leaves at once, and a running request of a lower
tier gives its slot to a waiting one of a higher tier (`tiers.make_room`). Requests of different
resolutions run in separate forwards of the same step, as SGLang and vLLM-Omni's step mode do.
"""

from __future__ import annotations

from collections.abc import Sequence

from gouache.request import RequestState
from gouache.sched.interface import Devices, Policy, group_by_resolution
from gouache.sched.plan import Plan, one_step
from gouache.sched.tiers import make_room


class OrcaPolicy(Policy):
    name = "orca"
    pauses = True

    def plan(self, waiting: Sequence[RequestState], running: Sequence[RequestState], now: float,
             devices: Devices) -> Plan:
        kept, admitted, paused = make_room(waiting, running, self.config.max_batch_size)
        return one_step(group_by_resolution([*kept, *admitted]), [s.request_id for s in admitted], pause=paused)
