"""Service tiers in simulation: 2x overload on 64 devices, 20 % priority, 60 % default and 20 %
flex traffic from three tenants (issue 38's experiment).

The pool: 64 replicas of one device each behind the least-requests router, each running
`patched-slo` (max batch 8) with the engine's queue limit (`Admission`: 16 requests in flight
per replica, flex refused past half of it). The workload: Poisson arrivals at `load` times
the pool's capacity, for `duration_s`, of 512, 768 and 1024 px images of 28 steps. Each
request's tier is drawn 20/60/20 and its tenant 50/30/20 (`alpha`, `beta`, `gamma`, equal
weights). Each tier's SLO is one figure for every size, as `--tier-slo-ms` gives it: 8 s for
priority (1.25x the 1024 px standalone latency, 4x the 512 px one), 60 s for default, none
for flex.

Step costs are a stand-in, `LinearStepCost` (20 ms a forward plus 0.2 s a megapixel: about a
FLUX.1-dev step on an H100, 6.5 s for 28 steps at 1024 px). The policy plans with the same
costs it is charged. Capacity is the pool's devices over the mean standalone latency, so
batching's saving (the forward term) is headroom on top.

Three runs of one trace:
- `tiers`: as served, with tiers (pauses, fair share, flex refused first);
- `tier-blind`: every request `default`, the SLOs unchanged, each tier's numbers then read
  from the requests that had it;
- `priority alone`: only the priority requests, on the idle pool, for the priority p95 the
  target compares with (<= 1.3x).

`tiers_experiment(out_dir)` writes tiers.json and tiers.md.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from gouache.config import SchedulerConfig
from gouache.request import TIERS
from gouache.sched.policies import make_policy
from gouache.sched.router import LeastRequestsRouter
from gouache.sim.costs import LinearStepCost
from gouache.sim.report import markdown_table, write_json
from gouache.sim.results import SimResult
from gouache.sim.simulator import Admission, simulate
from gouache.sim.workloads import PATCHEDSERVE_SIZES, SimRequest, tiered_trace

TENANTS = ("alpha", "beta", "gamma")


@dataclass(frozen=True)
class TiersSetup:
    devices: int = 64  # replicas of one device
    load: float = 2.0  # arrival rate / the pool's capacity
    duration_s: float = 300.0
    steps: int = 28
    tier_shares: tuple[float, float, float] = (0.2, 0.6, 0.2)  # priority, default, flex
    tenant_shares: tuple[float, float, float] = (0.5, 0.3, 0.2)  # alpha, beta, gamma
    tier_slo_s: tuple[float | None, float | None, float | None] = (8.0, 60.0, None)  # per tier, as --tier-slo-ms
    max_batch: int = 8
    max_in_flight: int = 16  # per replica (the engine's max_queue_len)
    policy: str = "patched-slo"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.devices < 1 or self.load <= 0 or self.duration_s <= 0 or self.steps < 1:
            raise ValueError("devices, load, duration_s and steps must be positive")
        for shares in (self.tier_shares, self.tenant_shares):
            if len(shares) != 3 or abs(sum(shares) - 1) > 1e-9 or min(shares) < 0:
                raise ValueError(f"shares must be three fractions summing to 1, got {shares}")


COST = LinearStepCost(per_megapixel_s=0.2, per_forward_s=0.02)


def standalone_s(width: int, height: int, steps: int) -> float:
    return steps * COST.step_time([(height, width)], patched=True)


def capacity_rps(setup: TiersSetup) -> float:
    """The pool's requests per second at its mean standalone latency (uniform sizes)."""
    mean = np.mean([standalone_s(w, h, setup.steps) for w, h in PATCHEDSERVE_SIZES])
    return setup.devices / mean


def trace(setup: TiersSetup) -> list[SimRequest]:
    return tiered_trace(setup.load * capacity_rps(setup), setup.duration_s, PATCHEDSERVE_SIZES, setup.steps,
                        dict(zip(TIERS, setup.tier_shares)), dict(zip(TENANTS, setup.tenant_shares)),
                        dict(zip(TIERS, setup.tier_slo_s)), setup.seed)


def run(setup: TiersSetup, requests: list[SimRequest]) -> SimResult:
    policies = [make_policy(SchedulerConfig(policy=setup.policy, max_batch_size=setup.max_batch), COST)
                for _ in range(setup.devices)]
    router = LeastRequestsRouter() if setup.devices > 1 else None
    return simulate(requests, policies, COST, router, admission=Admission(setup.max_in_flight))


def tiers_experiment(out_dir: str | Path, setup: TiersSetup | None = None) -> dict:
    """Run the three runs of one trace; write tiers.json and tiers.md to `out_dir`; return the JSON."""
    setup = setup or TiersSetup()
    requests = trace(setup)
    tiers = run(setup, requests)
    blind = run(setup, [replace(r, tier="default") for r in requests])
    blind.records = [replace(record, request=original) for record, original in zip(blind.records, requests)]
    alone = run(setup, [r for r in requests if r.tier == "priority"])
    rows = []
    for label, result in (("tiers", tiers), ("tier-blind", blind), ("priority alone", alone)):
        for tier in TIERS:
            if not any(r.request.tier == tier for r in result.records):
                continue
            metrics = result.metrics(tier)
            pauses = sum(r.pauses for r in result.records if r.request.tier == tier)
            rows.append({"run": label, "tier": tier, "requests": metrics.num_requests, "finished": metrics.finished,
                         "refused": metrics.refused, "dropped": metrics.dropped, "pauses": pauses,
                         "slo_attainment": metrics.slo_attainment, "latency_p50_s": metrics.latency_p50_s,
                         "latency_p95_s": metrics.latency_p95_s})
    p95 = {row["run"]: row["latency_p95_s"] for row in rows if row["tier"] == "priority"}
    tenants = {name: sum(r.finish is not None for r in tiers.records if r.request.tenant == name) for name in TENANTS}
    data = {"setup": asdict(setup), "capacity_rps": capacity_rps(setup), "requests": len(requests), "rows": rows,
            "priority_p95_vs_alone": p95["tiers"] / p95["priority alone"],
            "finished_by_tenant": tenants, "utilization": tiers.metrics().utilization}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "tiers.json", data)
    (out / "tiers.md").write_text(report(data))
    return data


def report(data: dict) -> str:
    setup = data["setup"]
    head = (f"{setup['devices']} devices, {setup['load']:g}x capacity ({data['capacity_rps']:.1f} requests/s) for "
            f"{setup['duration_s']:g} s: {data['requests']} requests, {setup['policy']}, simulated.\n\n")
    tail = (f"\nPriority p95 latency, served with tiers / on the idle pool: {data['priority_p95_vs_alone']:.2f}. "
            f"Finished by tenant: {', '.join(f'{k} {v}' for k, v in data['finished_by_tenant'].items())}. "
            f"Utilization {100 * data['utilization']:.0f} %.\n")
    return head + markdown_table(data["rows"]) + tail
