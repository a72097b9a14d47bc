"""Why the mask-aware router gains less here than InstGenIE reports: one simulated experiment per
hypothesis (docs/routing.md).

Every setup is `exp_instgenie`'s (1024 px FLUX.1-dev edits, 28 steps, Poisson arrivals, `orca`
with max batch 8 on each replica, the arrival rate a fraction of the replicas' saturation
throughput) with one thing changed: the mask distribution, the replicas' batching, the cost
model, the load, the number of replicas, or the router's view of the replicas. Each runs the
same traces through every router of `ROUTERS` and reports P95 latency per router (mean over
seeds) and the reduction of mask-aware against each of the others, with its range over seeds.

`python -m gouache.sim.exp_routing [HYPOTHESIS ...] [--out DIR]` runs them (`HYPOTHESES` names
them) and writes routing_<hypothesis>.{json,md} for each.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from gouache.config import SchedulerConfig
from gouache.sched.policies import make_policy
from gouache.sched.router import (
    LeastRequestsRouter,
    LeastTokensRouter,
    MaskAwareRouter,
    ReplicaLoad,
    RoundRobinRouter,
    Router,
    RouteRequest,
)
from gouache.sim.exp_instgenie import COST_MODELS, SIZE, STEPS, MaskStepCost, capacity_rps, edit_trace
from gouache.sim.report import markdown_table, write_json
from gouache.sim.results import RequestRecord
from gouache.sim.simulator import Replica, Simulator, route_request
from gouache.sim.workloads import SimRequest

ROUTERS = ("round-robin", "assigned-tokens", "least-requests", "least-tokens", "mask-aware")
WEIGHT_FLOOR_S = 0.00896  # FLUX.1-dev's weights streamed once a step on an H100 (docs/costmodels.md)


@dataclass(frozen=True)
class Setup:
    """One point of an experiment: what changes against `exp_instgenie`'s setting."""

    hypothesis: str  # which question it belongs to (a key of `HYPOTHESES`)
    cost_model: str = "3-term"  # a key of `exp_instgenie.COST_MODELS`, or "compute-only" (`cost`)
    mask_mean: float = 0.11  # mean mask ratio (InstGenIE: 0.11 their traces, 0.19 the public one)
    masks: str = "beta"  # beta: Beta(mask_shape, b); full-X: a share X of whole images, the rest Beta
    mask_shape: float = 2.0  # Beta's a (smaller: a wider spread at the same mean)
    load: float = 0.9  # arrival rate / saturation throughput
    replicas: int = 8
    view_every_s: float = 0.0  # the router sees the replicas as they were up to this long ago (0: now)
    policy: str = "orca"  # each replica's: orca batches per step, fcfs-static runs a batch to its end
    estimate: str = "admitted"  # mask-aware's view of a queue: admitted into free slots, or "queued" (before the fix)


def cost(name: str) -> MaskStepCost:
    """The step cost of `name`: `exp_instgenie`'s two, or "compute-only", a bound where a step
    is the masked tokens' compute and the weight floor, nothing else (2-term's FLOP/s)."""
    if name == "compute-only":
        return replace(COST_MODELS["2-term"].cost(), per_forward_s=WEIGHT_FLOOR_S, per_request_s=0.0)
    return COST_MODELS[name].cost()


def trace(setup: Setup, num_requests: int, seed: int) -> list[SimRequest]:
    """The setup's edits (`exp_instgenie.edit_trace`), arriving at `load` x saturation."""
    rate = setup.load * capacity_rps(cost(setup.cost_model), setup.mask_mean, setup.replicas, 8)
    return edit_trace(num_requests, rate, setup.mask_mean, setup.masks, seed, setup.mask_shape)


class AssignedTokensRouter(Router):
    """The replica that has been sent the fewest masked pixels so far, finished or not: InstGenIE
    §6.5's token-granularity baseline read literally ("balance the number of masked tokens
    assigned to each worker"), as round-robin is its request-granularity one read literally."""

    name = "assigned-tokens"
    reads_masks = True

    def __init__(self) -> None:
        self.sent: list[float] = []

    def route(self, request: RouteRequest, replicas: Sequence[ReplicaLoad]) -> int:
        self.sent += [0.0] * (len(replicas) - len(self.sent))
        index = min(range(len(replicas)), key=lambda i: (self.sent[i], i))
        self.sent[index] += request.pixels * request.mask_ratio
        return index


class QueuedMaskAwareRouter(MaskAwareRouter):
    """Mask-aware as it was before `ReplicaLoad.admitted`: a request routed to a replica with free
    slots, queued there until the next step, counts as waiting for a slot."""

    def cost(self, request: RouteRequest, replica: ReplicaLoad) -> float:
        return self.latency(request, replica)


def make_router(name: str, step_cost: MaskStepCost, estimate: str = "admitted") -> Router:
    if name == "mask-aware":
        return (QueuedMaskAwareRouter if estimate == "queued" else MaskAwareRouter)(step_cost.batch_step_time)
    return {"round-robin": RoundRobinRouter, "assigned-tokens": AssignedTokensRouter,
            "least-requests": LeastRequestsRouter, "least-tokens": LeastTokensRouter}[name]()


class StaleViewSimulator(Simulator):
    """The router sees each replica as it was when it last looked, at most `every_s` ago, plus
    the requests it has routed there since (a front knows what it sent, not what finished)."""

    def __init__(self, *args, every_s: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.every_s = every_s
        self._view: list = []
        self._looked = -math.inf

    def _route(self, request: SimRequest, record: RequestRecord) -> Replica:
        now = request.arrival  # an arrival is routed at its arrival time
        if now - self._looked >= self.every_s:  # copies: the view grows as it routes, the replicas' loads must not
            loads = [replica.load() for replica in self.replicas]
            self._view = [ReplicaLoad(list(load.running), list(load.waiting), load.max_batch) for load in loads]
            self._looked = now
        index = self.router.route(route_request(request), self._view)
        self._view[index].waiting.append(route_request(request))
        record.replica = index
        return self.replicas[index]


def run_setup(job: tuple[Setup, int, int]) -> list[dict]:
    """One seed of one setup through every router: a row per router."""
    setup, num_requests, seed = job
    step_cost = cost(setup.cost_model)
    requests = trace(setup, num_requests, seed)
    charged = step_cost.for_trace(requests)
    rows = []
    for name in ROUTERS:
        policies = [make_policy(SchedulerConfig(policy=setup.policy, max_batch_size=8)) for _ in range(setup.replicas)]
        router = make_router(name, step_cost, setup.estimate)
        if setup.view_every_s > 0:
            sim = StaleViewSimulator(policies, charged, router, every_s=setup.view_every_s)
        else:
            sim = Simulator(policies, charged, router)
        metrics = sim.run(requests).metrics()
        rows.append({**asdict(setup), "seed": seed, "router": name, "latency_p95_s": metrics.latency_p95_s,
                     "latency_p50_s": metrics.latency_p50_s, "queueing_mean_s": metrics.queueing_mean_s,
                     "utilization": metrics.utilization})
    return rows


def reductions(runs: Sequence[dict]) -> list[dict]:
    """Per setup: mean P95 per router over the seeds, and 1 - P95(mask-aware) / P95(other),
    mean and [min, max] over the seeds."""
    groups: dict[Setup, dict[int, dict[str, float]]] = {}
    for run in runs:
        setup = Setup(**{k: run[k] for k in Setup.__dataclass_fields__})
        groups.setdefault(setup, {}).setdefault(run["seed"], {})[run["router"]] = run["latency_p95_s"]
    rows = []
    for setup, by_seed in groups.items():
        p95 = {name: float(np.mean([s[name] for s in by_seed.values()])) for name in ROUTERS}
        row = {**asdict(setup), **{f"p95 {name}": p95[name] for name in ROUTERS}}
        for name in ROUTERS[:-1]:
            per_seed = [1 - s["mask-aware"] / s[name] for s in by_seed.values()]
            row[f"vs {name}"] = 1 - p95["mask-aware"] / p95[name]
            row[f"vs {name} range"] = f"{min(per_seed):+.3f}..{max(per_seed):+.3f}"
        rows.append(row)
    return rows


def _masks(mean: float) -> list[dict]:
    full = 0.05 if mean < 0.15 else 0.10
    return [dict(mask_mean=mean), dict(mask_mean=mean, mask_shape=0.5),
            dict(mask_mean=mean, masks=f"full-{full}"), dict(mask_mean=mean, masks=f"full-{full}", mask_shape=0.5)]


# hypothesis -> its setups (`Setup` fields besides `hypothesis`)
HYPOTHESES: dict[str, list[dict]] = {
    "masks": [dict(load=load, cost_model=model, **m) for model in ("3-term", "2-term") for load in (0.7, 0.9)
              for mean in (0.11, 0.19) for m in _masks(mean)],
    "batching": [dict(policy=policy, load=load, masks=masks) for policy in ("orca", "fcfs-static")
                 for masks in ("beta", "full-0.05") for load in (0.5, 0.7, 0.9)],
    "cost": [dict(cost_model=model, load=load, masks=masks) for model in ("3-term", "2-term", "compute-only")
             for load in (0.7, 0.9) for masks in ("beta", "full-0.05")],
    "load": [dict(cost_model=model, load=load, masks=masks) for model in ("3-term", "2-term")
             for masks in ("beta", "full-0.05") for load in (0.3, 0.5, 0.7, 0.8, 0.9, 0.95)],
    "replicas": [dict(replicas=n, masks=masks) for masks in ("beta", "full-0.05") for n in (2, 4, 8, 16)],
    "view": [dict(view_every_s=s, masks=masks, estimate=estimate) for masks in ("beta", "full-0.05")
             for estimate in ("admitted", "queued") for s in (0.0, 0.5, 2.0)],
}


def routing_experiment(out_dir: str | Path, hypotheses: Sequence[str] = tuple(HYPOTHESES), num_requests: int = 1200,
                       seeds: Sequence[int] = (0, 1, 2), workers: int = 2) -> dict[str, dict]:
    """Run the hypotheses' setups (in `workers` processes); write routing_<hypothesis>.{json,md}
    into `out_dir` for each, and return their data by hypothesis."""
    unknown = [h for h in hypotheses if h not in HYPOTHESES]
    if unknown:
        raise ValueError(f"unknown hypotheses {', '.join(unknown)}; choose from {', '.join(HYPOTHESES)}")
    setups = list(dict.fromkeys(Setup(h, **fields) for h in hypotheses for fields in HYPOTHESES[h]))
    jobs = [(setup, num_requests, seed) for setup in setups for seed in seeds]
    if workers > 1:
        with ProcessPoolExecutor(workers) as pool:
            runs = [row for rows in pool.map(run_setup, jobs) for row in rows]
    else:
        runs = [row for job in jobs for row in run_setup(job)]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    for h in hypotheses:
        ours = [run for run in runs if run["hypothesis"] == h]
        data = written[h] = {
            "experiment": f"why mask-aware routing gains less than in InstGenIE: {h} (simulated, docs/routing.md)",
            "command": f"python -m gouache.sim.exp_routing {h} --requests {num_requests} --seeds {len(seeds)}",
            "setup": {"size": list(SIZE), "steps": STEPS, "max_batch": 8, "num_requests": num_requests,
                      "seeds": list(seeds)},
            "reductions": reductions(ours), "runs": ours}
        write_json(out / f"routing_{h}.json", data)
        (out / f"routing_{h}.md").write_text(f"# {data['experiment']}\n\n`{data['command']}`\n\n"
                                             f"{markdown_table(_compact(data['reductions']), digits=3)}")
    return written


def _compact(rows: Sequence[dict]) -> list[dict]:
    """The rows with the setup fields that vary among them, P95 per router (s, 2 digits) and the
    reductions, the one against least-requests with its range over the seeds."""
    varying = [k for k in Setup.__dataclass_fields__ if len({row[k] for row in rows}) > 1]
    return [{**{k: row[k] for k in varying}, **{f"p95 {n}": f"{row['p95 ' + n]:.2f}" for n in ROUTERS},
             **{f"vs {n}": row[f"vs {n}"] for n in ROUTERS[:-1]},
             "range vs least-requests": row["vs least-requests range"]}
            for row in rows]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gouache.sim.exp_routing", description=__doc__.split("\n\n")[0])
    parser.add_argument("hypotheses", nargs="*", default=list(HYPOTHESES), help=f"from {', '.join(HYPOTHESES)}")
    parser.add_argument("--out", default="benchmarks/results/routing",
                        help="folder of routing_<hypothesis>.{json,md} (default: %(default)s)")
    parser.add_argument("--requests", type=int, default=1200, help="requests per trace (default: %(default)s)")
    parser.add_argument("--seeds", type=int, default=3, help="traces per setup, seeds 0.. (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=2, help="processes (default: %(default)s)")
    args = parser.parse_args(argv)
    routing_experiment(args.out, args.hypotheses, args.requests, range(args.seeds), args.workers)
    for h in args.hypotheses:
        print((Path(args.out) / f"routing_{h}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
