"""`gouache simulate`: any policy on a generated or recorded workload, on a simulated clock.

Two kinds of policy, one kind per run so that all share one trace and its SLOs:

- step policies (orca, patched, patched-slo, ...) on `--replicas` replicas of one device
  each, an arrival going where `--router` sends it. Steps cost what `--cost-model` (a batch
  model from `gouache profile`) predicts, or a linear stand-in; with `--mask-mean` every
  request is an edit and steps cost what InstGenIE's FLUX edit model says
  (`exp_instgenie.COST_MODELS["3-term"]`), which the mask-aware router also plans with.
- round policies (round-knapsack, fixed-sp-1/2/4/8) over one pool of `--devices` devices,
  costed by T(resolution, k) from `--cost-model` (a parallel model) or the documented H100
  FLUX.1-dev default. That model has no batch step times, so nothing is batched in a pool.
  With one device, round-knapsack is the engine's own one-device form, a step policy.

A flag the run would not read (`--max-batch-size` for a pool, `--rate` with `--trace`, ...)
is refused with the reason.

SLOs are `--slo-scale` x each request's standalone latency under the run's cost.
"""

from __future__ import annotations

import sys

from gouache.cli_flags import Given, given, refuse_ignored
from gouache.config import SchedulerConfig
from gouache.sched.costmodel import BatchCostModel, ParallelCostModel, load
from gouache.sched.policies import POLICIES, make_policy
from gouache.sched.router import ROUTERS
from gouache.sched.policies.round_knapsack import RoundKnapsackPolicy, shortest_round
from gouache.sched.rounds_interface import ROUND_POLICY_NAMES, RoundConfig, make_round_policy
from gouache.sim.cluster import simulate_cluster
from gouache.sim.report import markdown_table, result_to_dict, summary_row, write_json
from gouache.sim.simulator import PredictedStepCost, SimResult, linear_step_cost, simulate, standalone_latency
from gouache.sim.workloads import MIXES, SimRequest, WorkloadSpec, make_workload, read_trace

_COLUMNS = ["policy", "slo_attainment", "latency_p50_s", "latency_p95_s", "latency_p99_s", "queueing_mean_s",
            "utilization", "dropped", "finished"]


# read only to generate a workload: a --trace brings its own
_GENERATING = ("requests", "rate", "cv", "sizes", "mix", "steps", "slo_scale", "seed")
_STAND_IN = ("per_forward_ms", "per_megapixel_ms")  # the linear stand-in step cost's two terms


def add_arguments(p) -> None:
    names = sorted({*POLICIES, *ROUND_POLICY_NAMES})
    p.add_argument("--policies", default="fcfs-static,orca",
                   help=f"comma-separated, from {', '.join(names)} (default: %(default)s)")
    p.add_argument("--trace", default=None,
                   help="replay a CSV/JSONL trace (arrival s, width, height, steps, slo_s, mask_ratio) instead of "
                        "generating requests (default: generate)")
    p.add_argument("--requests", type=int, default=500, action=Given,
                   help="requests to generate (default: %(default)s)")
    p.add_argument("--rate", type=float, default=0.2, action=Given,
                   help="mean arrivals per second, requests/s (default: %(default)s)")
    p.add_argument("--cv", type=float, default=1.0, action=Given,
                   help="coefficient of variation of inter-arrival gaps: 1 = Poisson, > 1 bursty "
                        "(default: %(default)s)")
    p.add_argument("--sizes", default="512,768,1024", action=Given,
                   help="comma-separated square sizes in pixels (default: %(default)s)")
    p.add_argument("--mix", default="uniform", choices=MIXES, action=Given,
                   help="how sizes are drawn (default: %(default)s)")
    p.add_argument("--steps", type=int, default=50, action=Given,
                   help="denoising steps of every request (default: %(default)s)")
    p.add_argument("--slo-scale", type=float, default=5.0, action=Given,
                   help="SLO = scale x the request's standalone latency (default: %(default)s)")
    p.add_argument("--mask-mean", type=float, default=None,
                   help="every request is an edit with a Beta mask ratio of this mean, in (0, 1) (InstGenIE: 0.11, "
                        "0.19), priced by InstGenIE's FLUX edit model; with --trace the trace's mask_ratio column "
                        "is used and this only picks that model; step policies only (default: generations)")
    p.add_argument("--max-batch-size", type=int, default=SchedulerConfig.max_batch_size, action=Given,
                   help="most requests in one step, for step policies (default: %(default)s)")
    p.add_argument("--replicas", type=int, default=1, action=Given,
                   help="replicas of one device each, for step policies (default: %(default)s)")
    p.add_argument("--router", default="least-requests", choices=sorted(ROUTERS), action=Given,
                   help="which replica an arrival goes to, with --replicas > 1 (default: %(default)s)")
    p.add_argument("--devices", type=int, default=1, action=Given,
                   help="devices in the pool of the round policies (default: %(default)s)")
    p.add_argument("--round-s", type=float, default=None,
                   help="round length in seconds of round-knapsack (default: one step of the largest size on all "
                        f"devices of a pool; {SchedulerConfig.round_s} on one device)")
    p.add_argument("--cost-model", default=None,
                   help="JSON from `gouache profile` (step policies) or a parallel T(res, k) model (round policies) "
                        "(default: the linear stand-in for step policies, TetriServe's H100 FLUX.1-dev model "
                        "for a pool)")
    p.add_argument("--seed", type=int, default=0, action=Given,
                   help="seed of the generated workload (default: %(default)s)")
    p.add_argument("--per-forward-ms", type=float, default=20.0, action=Given,
                   help="stand-in step cost: milliseconds per forward (default: %(default)s)")
    p.add_argument("--per-megapixel-ms", type=float, default=80.0, action=Given,
                   help="stand-in step cost: milliseconds per megapixel in a forward (default: %(default)s)")
    p.add_argument("--out", default=None, help="write the results (with per-request times) as JSON (default: no file)")


def run(args) -> int:
    names, known = args.policies.split(","), sorted({*POLICIES, *ROUND_POLICY_NAMES})
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown policies {', '.join(unknown)}; choose from {', '.join(known)}")
    pool = [_in_pool(n, args.devices) for n in names]
    if len(set(pool)) > 1:
        raise ValueError("run step policies and round policies (fixed-sp-k, round-knapsack with --devices > 1) "
                         "in separate commands: they need different cost models")
    _refuse_ignored(args, names, pool[0])
    results = _run_pool(args, names) if pool[0] else _run_replicas(args, names)
    print(markdown_table([summary_row(r) for r in results], _COLUMNS))
    if args.out:
        write_json(args.out, {"command": "gouache simulate " + " ".join(sys.argv[2:]),
                              "results": [result_to_dict(r) for r in results]})
        print(f"wrote {args.out}")
    return 0


def _refuse_ignored(args, names: list[str], pool: bool) -> None:
    """Refuse every flag that this run would not read, saying why."""
    typed, ignored = given(args), {}
    if args.trace:
        ignored |= {d: "--trace replays its own arrivals, sizes, steps and SLOs" for d in _GENERATING if d in typed}
    if args.round_s is not None and RoundKnapsackPolicy.name not in names:
        ignored["round_s"] = "only round-knapsack plans in rounds"
    if pool:
        ignored |= {d: "round policies run on one pool of --devices devices"
                    for d in ("replicas", "router") if d in typed}
        if "max_batch_size" in typed:
            ignored["max_batch_size"] = ("round policies over a pool never batch: a parallel T(resolution, k) "
                                         "cost model has no batch step times")
        ignored |= {d: "round policies are priced by the parallel cost model (--cost-model or the H100 FLUX default)"
                    for d in _STAND_IN if d in typed}
    else:
        if "devices" in typed and not set(names) & set(ROUND_POLICY_NAMES):
            ignored["devices"] = "it sizes the round policies' pool; step policies run on --replicas"
        if "router" in typed and args.replicas == 1:
            ignored["router"] = "one replica has nothing to route; add --replicas"
        if args.cost_model or args.mask_mean is not None:
            ignored |= {d: "the stand-in prices steps only without --cost-model and --mask-mean"
                        for d in _STAND_IN if d in typed}
    refuse_ignored(ignored)


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
        config = SchedulerConfig(policy=name, max_batch_size=args.max_batch_size,
                                 round_s=SchedulerConfig.round_s if args.round_s is None else args.round_s)
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
    tau = shortest_round(model.step_time, present, args.devices) if args.round_s is None else args.round_s
    config = RoundConfig(tau=tau)
    return [simulate_cluster(requests, make_round_policy(name, model.step_time, config), args.devices, model.step_time)
            for name in names]


def _check_profiled(model: ParallelCostModel, resolutions: list[tuple[int, int]]) -> None:
    missing = [res for res in resolutions if res not in model.resolutions]
    if missing:
        raise ValueError(f"the cost model has no step times of {missing} (height, width); it has {model.resolutions}")
