"""`gouache simulate`: any policy on a generated or recorded workload, on a simulated clock.

Two kinds of policy, one kind per run so that all share one trace and its SLOs:

- step policies (orca, patched, patched-slo, ...) on `--replicas` replicas of one device
  each, an arrival going where `--router` sends it. Steps cost what `--cost-model` (a batch
  model from `gouache profile`) predicts, or a linear stand-in; with `--mask-mean` every
  request is an edit and steps cost what InstGenIE's FLUX edit model says
  (`exp_instgenie.COST_MODELS["3-term"]`), which the mask-aware router also plans with.
- round policies (round-knapsack, fixed-sp-1/2/4/8) over one pool of `--devices` devices,
  costed by T(resolution, k) from `--cost-model` (a parallel model) or the documented H100
  FLUX.1-dev default. With one device, round-knapsack is the engine's own one-device form,
  a step policy.

SLOs are `--slo-scale` x each request's standalone latency under the run's cost.
"""

from __future__ import annotations

import sys

from gouache.config import SchedulerConfig
from gouache.sched.costmodel import BatchCostModel, ParallelCostModel, load
from gouache.sched.policies import POLICIES, make_policy
from gouache.sched.router import ROUTERS
from gouache.sched.policies.round_knapsack import shortest_round
from gouache.sched.rounds_interface import ROUND_POLICY_NAMES, RoundConfig, make_round_policy
from gouache.sim.cluster import simulate_cluster
from gouache.sim.report import markdown_table, result_to_dict, summary_row, write_json
from gouache.sim.simulator import PredictedStepCost, SimResult, linear_step_cost, simulate, standalone_latency
from gouache.sim.workloads import MIXES, SimRequest, WorkloadSpec, make_workload, read_trace

_COLUMNS = ["policy", "slo_attainment", "latency_p50_s", "latency_p95_s", "latency_p99_s", "queueing_mean_s",
            "utilization", "dropped", "finished"]


def add_arguments(p) -> None:
    names = sorted({*POLICIES, *ROUND_POLICY_NAMES})
    p.add_argument("--policies", default="fcfs-static,orca", help=f"comma-separated, from {', '.join(names)}")
    p.add_argument("--trace", default=None, help="replay a CSV/JSONL trace instead of generating arrivals")
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--rate", type=float, default=0.2, help="mean arrivals per second")
    p.add_argument("--cv", type=float, default=1.0, help="inter-arrival variation: 1 = Poisson, > 1 bursty")
    p.add_argument("--sizes", default="512,768,1024", help="square sizes in pixels")
    p.add_argument("--mix", default="uniform", choices=MIXES)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--slo-scale", type=float, default=5.0, help="SLO = scale x standalone latency")
    p.add_argument("--mask-mean", type=float, default=None,
                   help="every request is an edit with a Beta mask ratio of this mean (InstGenIE: 0.11, 0.19)")
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--replicas", type=int, default=1, help="replicas of one device each, for step policies")
    p.add_argument("--router", default="least-requests", choices=sorted(ROUTERS), help="with --replicas > 1")
    p.add_argument("--devices", type=int, default=1, help="devices in the pool of the round policies")
    p.add_argument("--round-s", type=float, default=None,
                   help="round length of round policies (default: one step of the largest size on all devices)")
    p.add_argument("--cost-model", default=None,
                   help="JSON from `gouache profile` (step policies) or a parallel T(res, k) model (round policies)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--per-forward-ms", type=float, default=20.0, help="stand-in cost: fixed cost per forward")
    p.add_argument("--per-megapixel-ms", type=float, default=80.0, help="stand-in cost: per megapixel in a forward")
    p.add_argument("--out", default=None, help="write the results (with per-request times) as JSON")


def run(args) -> int:
    names, known = args.policies.split(","), sorted({*POLICIES, *ROUND_POLICY_NAMES})
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown policies {', '.join(unknown)}; choose from {', '.join(known)}")
    pool = [_in_pool(n, args.devices) for n in names]
    if len(set(pool)) > 1:
        raise ValueError("run step policies and round policies (fixed-sp-k, round-knapsack with --devices > 1) "
                         "in separate commands: they need different cost models")
    results = _run_pool(args, names) if pool[0] else _run_replicas(args, names)
    print(markdown_table([summary_row(r) for r in results], _COLUMNS))
    if args.out:
        write_json(args.out, {"command": "gouache simulate " + " ".join(sys.argv[2:]),
                              "results": [result_to_dict(r) for r in results]})
        print(f"wrote {args.out}")
    return 0


def _in_pool(name: str, devices: int) -> bool:
    """Whether `name` runs as a round policy over the device pool."""
    return name not in POLICIES or (name in ROUND_POLICY_NAMES and devices > 1)


def _workload(args, latency) -> list[SimRequest]:
    if args.trace:
        return read_trace(args.trace)
    sizes = [(int(s), int(s)) for s in args.sizes.split(",")]
    spec = WorkloadSpec(args.requests, args.rate, cv=args.cv, sizes=sizes, mix=args.mix, steps=args.steps,
                        slo_scale=args.slo_scale, mask_mean=args.mask_mean, seed=args.seed)
    return make_workload(spec, latency)


def _run_replicas(args, names: list[str]) -> list[SimResult]:
    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    if args.mask_mean is not None:
        from gouache.sim.exp_instgenie import COST_MODELS

        if args.cost_model:
            raise ValueError("--mask-mean prices edits with InstGenIE's FLUX edit model; drop --cost-model")
        edit_cost = COST_MODELS["3-term"].cost()
        requests = _workload(args, standalone_latency(edit_cost))  # SLOs from an unmasked request's latency
        cost = edit_cost.for_trace(requests)
    else:
        cost = _step_cost(args)
        requests = _workload(args, standalone_latency(cost))
    predictor = _predictor(cost)
    results = []
    for name in names:
        if predictor is None and POLICIES[name].needs_predictor:
            raise ValueError(f"{name} plans with predicted step times, which the edit cost model has not; "
                             "run it without --mask-mean")
        config = SchedulerConfig(policy=name, max_batch_size=args.max_batch_size)
        policies = [make_policy(config, predictor) for _ in range(args.replicas)]
        router = _router(args.router, cost) if args.replicas > 1 else None
        results.append(simulate(requests, policies, cost, router=router))
    return results


def _predictor(cost):
    """What SLO-aware policies plan with: the profiled model, the stand-in itself, or nothing
    (the edit cost has no step-time form; a policy that needs one says so)."""
    if isinstance(cost, PredictedStepCost):
        return cost.predictor
    return cost if hasattr(cost, "step_time") else None


def _step_cost(args):
    """The profiled batch model's step cost, or the linear stand-in."""
    if not args.cost_model:
        return linear_step_cost(per_forward_s=args.per_forward_ms / 1e3, per_megapixel_s=args.per_megapixel_ms / 1e3)
    model = load(args.cost_model)
    if not isinstance(model, BatchCostModel):
        raise ValueError(f"{args.cost_model} is a {model.kind} cost model; step policies need a batch one "
                         "(`gouache profile`)")
    return PredictedStepCost(model)


def _router(name: str, cost):
    if name != "mask-aware":
        return ROUTERS[name]()
    if not hasattr(cost, "batch_step_time"):
        raise ValueError("the mask-aware router plans with the edit cost model or the stand-in: "
                         "add --mask-mean or drop --cost-model")
    return ROUTERS[name](cost.batch_step_time)


def _run_pool(args, names: list[str]) -> list[SimResult]:
    if args.mask_mean is not None:
        raise ValueError("--mask-mean is for step policies; round policies price generations only")
    model = load(args.cost_model) if args.cost_model else ParallelCostModel.h100_flux_default()
    if not isinstance(model, ParallelCostModel):
        raise ValueError(f"{args.cost_model} is a {model.kind} cost model; round policies need a parallel "
                         "T(resolution, k) one")
    def latency(width: int, height: int, steps: int) -> float:
        _check_profiled(model, [(height, width)])
        return model.standalone_latency((height, width), steps)

    requests = _workload(args, latency)
    present = sorted({(r.height, r.width) for r in requests})
    _check_profiled(model, present)
    tau = args.round_s or shortest_round(model.step_time, present, args.devices)
    config = RoundConfig(tau=tau, max_batch=args.max_batch_size)
    return [simulate_cluster(requests, make_round_policy(name, model.step_time, config), args.devices, model.step_time)
            for name in names]


def _check_profiled(model: ParallelCostModel, resolutions: list[tuple[int, int]]) -> None:
    missing = [res for res in resolutions if res not in model.resolutions]
    if missing:
        raise ValueError(f"the cost model has no step times of {missing} (height, width); it has {model.resolutions}")
