"""What a simulated run leaves: a record per request, the devices' accounting, and the numbers
a run is judged by (`SimResult.metrics`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gouache.sched.plan import Plan
from gouache.sim.workloads import SimRequest
from gouache.stats import percentile


@dataclass
class RequestRecord:
    """What happened to one request."""

    request: SimRequest
    first_step: float | None = None  # when its first denoising step began (queueing ends)
    finish: float | None = None  # when its last denoising step ended
    dropped_at: float | None = None  # when its policy dropped it
    refused_at: float | None = None  # when admission refused it (the engine's 429)
    pauses: int = 0  # times a higher tier's request took its slot
    replica: int | None = None  # index of the replica it was routed to

    @property
    def latency(self) -> float | None:
        return None if self.finish is None else self.finish - self.request.arrival

    @property
    def queueing(self) -> float | None:
        return None if self.first_step is None else self.first_step - self.request.arrival

    @property
    def met_slo(self) -> bool | None:
        """None without an SLO; False if dropped, unfinished or late."""
        deadline = self.request.deadline
        if deadline is None:
            return None
        return self.finish is not None and self.finish <= deadline


@dataclass
class SimMetrics:
    """The numbers a run is judged by. Latencies are over finished requests."""

    num_requests: int
    finished: int
    dropped: int  # removed by the policy (e.g. hopeless under an SLO policy)
    refused: int  # refused at arrival by the admission limit (429)
    unfinished: int  # still waiting or running when no event was left
    slo_attainment: float | None  # met / requests with an SLO; None if none has one
    latency_mean_s: float | None
    latency_p50_s: float | None
    latency_p95_s: float | None
    latency_p99_s: float | None
    queueing_mean_s: float | None  # arrival -> first step, over requests that started
    utilization: float  # device busy time / makespan
    makespan_s: float  # first arrival -> last step end
    throughput_rps: float  # finished / makespan
    num_steps: int  # step plans executed


@dataclass
class SimResult:
    """One simulated run: a record per request (trace order) and the devices' accounting."""

    policy: str
    records: list[RequestRecord]
    busy_device_s: float  # device-seconds spent on steps (and stage work), all devices together
    devices: int  # replicas x devices per replica
    start: float  # first arrival
    end: float  # last step end (or last arrival if later)
    num_steps: int  # steps run, counted once per batch step
    num_plans: int  # non-empty plans made
    device_s: dict[str, float] = field(default_factory=dict)  # request id -> device-seconds it used
    plans: list[tuple[float, Plan]] = field(default_factory=list)  # (time, plan), if record_plans

    def metrics(self, tier: str | None = None) -> SimMetrics:
        """The run's numbers, or those of the requests of one service tier (utilization stays the run's)."""
        records = self.records if tier is None else [r for r in self.records if r.request.tier == tier]
        latencies = np.array([r.latency for r in records if r.finish is not None])
        queueing = [r.queueing for r in records if r.first_step is not None]
        slo = [r.met_slo for r in records if r.met_slo is not None]
        makespan = self.end - self.start

        def pct(q: float) -> float | None:
            return percentile(latencies.tolist(), q) if latencies.size else None

        return SimMetrics(
            num_requests=len(records),
            finished=int(latencies.size),
            dropped=sum(r.dropped_at is not None for r in records),
            refused=sum(r.refused_at is not None for r in records),
            unfinished=sum(r.finish is None and r.dropped_at is None and r.refused_at is None for r in records),
            slo_attainment=sum(slo) / len(slo) if slo else None,
            latency_mean_s=float(latencies.mean()) if latencies.size else None,
            latency_p50_s=pct(50), latency_p95_s=pct(95), latency_p99_s=pct(99),
            queueing_mean_s=float(np.mean(queueing)) if queueing else None,
            utilization=self.busy_device_s / (self.devices * makespan) if makespan > 0 else 0.0,
            makespan_s=makespan,
            throughput_rps=latencies.size / makespan if makespan > 0 else 0.0,
            num_steps=self.num_steps,
        )
