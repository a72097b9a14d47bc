"""`orca`: step-level continuous batching, one forward per resolution.

Waiting requests join the running set at the next step (FCFS, up to `max_batch_size`); a
finished request leaves at once. Requests of different resolutions run in separate forwards of
the same step, as SGLang and vLLM-Omni's step mode do.
"""

from __future__ import annotations

from collections.abc import Sequence

from gouache.request import RequestState
from gouache.sched.interface import Devices, Policy, group_by_resolution
from gouache.sched.plan import Plan, one_step


class OrcaPolicy(Policy):
    name = "orca"

    def plan(self, waiting: Sequence[RequestState], running: Sequence[RequestState], now: float,
             devices: Devices) -> Plan:
        free = max(self.config.max_batch_size - len(running), 0)
        admitted = list(waiting[:free])
        return one_step(group_by_resolution([*running, *admitted]), [s.request_id for s in admitted])
