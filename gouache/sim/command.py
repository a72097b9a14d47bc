"""`gouache simulate`: any policy on a generated or recorded workload, on a simulated clock.

Every policy runs the same way: `--replicas` replicas of `--devices` devices each, an arrival
going where `--router` sends it (with more than one replica).

- One device per replica: steps cost what `--cost-model` (a batch model from `gouache
  profile`) predicts, or a linear stand-in; with `--mask-mean` every request is an edit and
  steps cost what InstGenIE's FLUX edit model says (`exp_instgenie.COST_MODELS["3-term"]`),
  which the mask-aware router also plans with.
- Several devices per replica (round-knapsack, fixed-sp-k): steps cost T(resolution, k) from
  `--cost-model` (a parallel model) or the documented H100 FLUX.1-dev default, with the
  hand-off of a request that changes devices charged from the same documentation. That model
  has no batch step times, so nothing is batched. Step policies plan one device only.

A flag the run would not read (`--per-forward-ms` with a cost model, `--rate` with `--trace`,
...) is refused with the reason.

SLOs are `--slo-scale` x each request's standalone latency under the run's cost.
"""

from __future__ import annotations

import sys

from gouache.cli_flags import Given, given, parse_shape, refuse_ignored
from gouache.config import SchedulerConfig
from gouache.model_info import shown
from gouache.sched.costmodel import BatchCostModel, load
from gouache.sched.parallel_costmodel import FluxH100Assumptions, ParallelCostModel
from gouache.sched.policies import POLICIES, make_policy
from gouache.sched.policies.round_knapsack import RoundKnapsackPolicy, shortest_round
from gouache.sched.router import ROUTERS
from gouache.sched.scheduler import check_devices
from gouache.sim.costs import LinearHandoff, PredictedStepCost, linear_step_cost, load_handoff, standalone_latency
from gouache.sim.report import markdown_table, result_to_dict, summary_row, write_json
from gouache.sim.results import SimResult
from gouache.sim.simulator import simulate
from gouache.sim.workloads import MIXES, SimRequest, WorkloadSpec, make_workload, read_trace

_COLUMNS = ["policy", "slo_attainment", "latency_p50_s", "latency_p95_s", "latency_p99_s", "queueing_mean_s",
            "utilization", "dropped", "finished"]


# read only to generate a workload: a --trace brings its own
_GENERATING = ("requests", "rate", "cv", "sizes", "mix", "steps", "slo_scale", "seed")
_STAND_IN = ("per_forward_ms", "per_megapixel_ms")  # the linear stand-in step cost's two terms


def add_arguments(p) -> None:
    names = sorted(POLICIES)
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
                   help="comma-separated sizes in pixels: S (a square), WxH, or clips WxHxF (F frames) "
                        "(default: %(default)s)")
    p.add_argument("--mix", default="uniform", choices=MIXES, action=Given,
                   help="how sizes are drawn (default: %(default)s)")
    p.add_argument("--steps", type=int, default=50, action=Given,
                   help="denoising steps of every request (default: %(default)s)")
    p.add_argument("--slo-scale", type=float, default=5.0, action=Given,
                   help="SLO = scale x the request's standalone latency (default: %(default)s)")
    p.add_argument("--mask-mean", type=float, default=None,
                   help="every request is an edit with a Beta mask ratio of this mean, in (0, 1) (InstGenIE: 0.11, "
                        "0.19), priced by InstGenIE's FLUX edit model; with --trace the trace's mask_ratio column "
                        "is used and this only picks that model; one device per replica (default: generations)")
    p.add_argument("--max-batch-size", type=int, default=SchedulerConfig.max_batch_size, action=Given,
                   help="most requests in one forward (default: %(default)s)")
    p.add_argument("--replicas", type=int, default=1, action=Given,
                   help="replicas, each with its own scheduler and --devices devices (default: %(default)s)")
    p.add_argument("--router", default="least-requests", choices=sorted(ROUTERS), action=Given,
                   help="which replica an arrival goes to, with --replicas > 1 (default: %(default)s)")
    p.add_argument("--devices", type=int, default=1, action=Given,
                   help="devices per replica; more than one for round-knapsack and fixed-sp-k (default: %(default)s)")
    p.add_argument("--round-s", type=float, default=None,
                   help="round length in seconds of round-knapsack (default: one step of the largest size on all "
                        f"devices of a pool; {SchedulerConfig.round_s} on one device)")
    p.add_argument("--cost-model", default=None,
                   help="JSON from `gouache profile` (one device) or a parallel T(res, k) model (several) "
                        "(default: the linear stand-in on one device, TetriServe's H100 FLUX.1-dev model on several)")
    p.add_argument("--seed", type=int, default=0, action=Given,
                   help="seed of the generated workload (default: %(default)s)")
    p.add_argument("--per-forward-ms", type=float, default=20.0, action=Given,
                   help="stand-in step cost: milliseconds per forward (default: %(default)s)")
    p.add_argument("--per-megapixel-ms", type=float, default=80.0, action=Given,
                   help="stand-in step cost: milliseconds per megapixel in a forward (default: %(default)s)")
    p.add_argument("--out", default=None, help="write the results (with per-request times) as JSON (default: no file)")


def run(args) -> int:
    names = args.policies.split(",")
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {', '.join(unknown)}; choose from {', '.join(sorted(POLICIES))}")
    if args.replicas < 1 or args.devices < 1:
        raise ValueError(f"--replicas and --devices must be >= 1, got {args.replicas} and {args.devices}")
    for name in names:
        check_devices(POLICIES[name], args.devices)
    _refuse_ignored(args, names)
    results = _run_parallel(args, names) if args.devices > 1 else _run_one_device(args, names)
    print(markdown_table([summary_row(r) for r in results], _COLUMNS))
    if args.out:
        write_json(args.out, {"command": "gouache simulate " + " ".join(sys.argv[2:]),
                              "results": [result_to_dict(r) for r in results]})
        print(f"wrote {args.out}")
    return 0


def _refuse_ignored(args, names: list[str]) -> None:
    """Refuse every flag that this run would not read, saying why."""
    typed, ignored = given(args), {}
    if args.trace:
        ignored |= {d: "--trace replays its own arrivals, sizes, steps and SLOs" for d in _GENERATING if d in typed}
    if args.round_s is not None and RoundKnapsackPolicy.name not in names:
        ignored["round_s"] = "only round-knapsack plans in rounds"
    if "router" in typed and args.replicas == 1:
        ignored["router"] = "one replica has nothing to route; add --replicas"
    if args.devices > 1:
        ignored |= {d: "several devices are priced by the parallel cost model (--cost-model or the H100 FLUX default)"
                    for d in _STAND_IN if d in typed}
        if "max_batch_size" in typed:
            ignored["max_batch_size"] = "the parallel cost model prices no batches, so nothing is batched"
    elif args.cost_model or args.mask_mean is not None:
        ignored |= {d: "the stand-in prices steps only without --cost-model and --mask-mean"
                    for d in _STAND_IN if d in typed}
    refuse_ignored(ignored)


def _workload(args, latency) -> list[SimRequest]:
    if args.trace:
        return read_trace(args.trace)
    sizes = [(w, h, *frames) for h, w, *frames in (parse_shape(s) for s in args.sizes.split(","))]
    spec = WorkloadSpec(args.requests, args.rate, cv=args.cv, sizes=sizes, mix=args.mix, steps=args.steps,
                        slo_scale=args.slo_scale, mask_mean=args.mask_mean, seed=args.seed)
    return make_workload(spec, latency)


def _run_one_device(args, names: list[str]) -> list[SimResult]:
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
        results.append(simulate(requests, _policies(args, name, predictor), cost,
                                router=_router(args.router, cost) if args.replicas > 1 else None))
    return results


def _policies(args, name: str, predictor, round_s: float | None = None) -> list:
    """One instance of policy `name` per replica."""
    config = SchedulerConfig(policy=name, max_batch_size=args.max_batch_size,
                             round_s=round_s or args.round_s or SchedulerConfig.round_s)
    return [make_policy(config, predictor) for _ in range(args.replicas)]


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
        raise ValueError(f"{args.cost_model} is a {model.kind} cost model; one device per replica needs a batch one "
                         "(`gouache profile`), or give --devices")
    return PredictedStepCost(model)


def _router(name: str, cost):
    if name != "mask-aware":
        return ROUTERS[name]()
    if not hasattr(cost, "batch_step_time"):
        raise ValueError("the mask-aware router plans with the edit cost model or the stand-in: "
                         "add --mask-mean or drop --cost-model")
    return ROUTERS[name](cost.batch_step_time)


def _run_parallel(args, names: list[str]) -> list[SimResult]:
    if args.mask_mean is not None:
        raise ValueError("--mask-mean prices edits on one device per replica; drop --devices")
    if args.cost_model:
        model, handoff = load(args.cost_model), load_handoff(args.cost_model)
        if not isinstance(model, ParallelCostModel):
            raise ValueError(f"{args.cost_model} is a {model.kind} cost model; --devices > 1 needs a parallel "
                             "T(resolution, k) one")
    else:
        assumptions = FluxH100Assumptions()
        model = ParallelCostModel.h100_flux_default(assumptions)
        handoff = LinearHandoff(*assumptions.handoff(), source="FluxH100Assumptions.handoff()")

    def latency(width: int, height: int, steps: int, *frames: int) -> float:
        _check_profiled(model, [(height, width, *frames)])
        return model.standalone_latency((height, width, *frames), steps)

    requests = _workload(args, latency)
    present = sorted({r.resolution for r in requests})
    _check_profiled(model, present)
    tau = args.round_s or shortest_round(lambda res, k: model.seconds(res, k), present, args.devices)
    return [simulate(requests, _policies(args, name, model, tau), PredictedStepCost(model),
                     router=_router(args.router, model) if args.replicas > 1 else None,
                     num_devices=args.devices, handoff=handoff)
            for name in names]


def _check_profiled(model: ParallelCostModel, resolutions: list[tuple[int, ...]]) -> None:
    missing = [res for res in resolutions if res not in model.resolutions]
    if missing:
        raise ValueError(f"the cost model has no step times of {', '.join(map(shown, missing))}; it has "
                         f"{', '.join(map(shown, model.resolutions))}")
