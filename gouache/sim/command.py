"""`gouache simulate`: any step policy on a generated or recorded workload, on a simulated clock."""

from __future__ import annotations

import sys

from gouache.config import SchedulerConfig
from gouache.sched.policies import POLICIES, make_policy
from gouache.sim.report import markdown_table, result_to_dict, summary_row, write_json
from gouache.sim.simulator import linear_step_cost, simulate, standalone_latency
from gouache.sim.workloads import MIXES, WorkloadSpec, make_workload, read_trace

_COLUMNS = ["policy", "slo_attainment", "latency_p50_s", "latency_p95_s", "latency_p99_s", "queueing_mean_s",
            "utilization", "dropped", "finished"]


def add_arguments(p) -> None:
    p.add_argument("--policies", default="fcfs-static,orca", help=f"comma-separated, from {', '.join(POLICIES)}")
    p.add_argument("--trace", default=None, help="replay a CSV/JSONL trace instead of generating arrivals")
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--rate", type=float, default=0.2, help="mean arrivals per second")
    p.add_argument("--cv", type=float, default=1.0, help="inter-arrival variation: 1 = Poisson, > 1 bursty")
    p.add_argument("--sizes", default="512,768,1024", help="square sizes in pixels")
    p.add_argument("--mix", default="uniform", choices=MIXES)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--slo-scale", type=float, default=5.0, help="SLO = scale x standalone latency")
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--per-forward-ms", type=float, default=20.0, help="stand-in cost: fixed cost per forward")
    p.add_argument("--per-megapixel-ms", type=float, default=80.0, help="stand-in cost: per megapixel in a forward")
    p.add_argument("--out", default=None, help="write the results (with per-request times) as JSON")


def run(args) -> int:
    cost = linear_step_cost(per_forward_s=args.per_forward_ms / 1e3, per_megapixel_s=args.per_megapixel_ms / 1e3)
    if args.trace:
        requests = read_trace(args.trace)
    else:
        sizes = [(int(s), int(s)) for s in args.sizes.split(",")]
        spec = WorkloadSpec(args.requests, args.rate, cv=args.cv, sizes=sizes, mix=args.mix, steps=args.steps,
                            slo_scale=args.slo_scale, seed=args.seed)
        requests = make_workload(spec, standalone_latency(cost))
    results = []
    for name in args.policies.split(","):
        policy = make_policy(SchedulerConfig(policy=name, max_batch_size=args.max_batch_size), predictor=cost)
        results.append(simulate(requests, policy, cost))
    print(markdown_table([summary_row(r) for r in results], _COLUMNS))
    if args.out:
        write_json(args.out, {"command": "gouache simulate " + " ".join(sys.argv[2:]),
                              "results": [result_to_dict(r) for r in results]})
        print(f"wrote {args.out}")
    return 0
