"""`gouache bench sim-to-real`: one workload through the live engine and through the simulator
with the profiled cost model, per policy; how far apart are their latency distributions?

Latency here is arrival -> end of the last denoising step in both (the live side sees it as
the last progress event). Where the engine's torch threads take every core, the stages
(text encoding, VAE decode, image encoding: `gouache profile` measures them) run on the
engine's cores, and the simulator charges each request's preparation and post-processing as
device work between steps; a request's own decode is not part of its latency. With
`--torch-threads` below the core count the stages have cores of their own and cost the steps
nothing, so nothing is charged. Every request carries an SLO of `--slo-scale` x its
standalone latency under the cost model, so deadline-aware policies have deadlines to plan
for; a request a policy drops counts as a miss on both sides.

Two live diagnostics say why the sides differ when they do: the median ratio of each live
step's measured forward time to the cost model's prediction for that batch (about 1 when the
device was as quiet as while profiling; the stages and other processes push it up), and the
median preparation time before a request reaches the queue, which the simulator charges as
device work but does not delay the request by.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from gouache.bench.serve import percentile
from gouache.sim.report import markdown_table, write_json
from gouache.sim.workloads import SimRequest, WorkloadSpec, make_workload

COLUMNS = ["policy", "source", "finished", "dropped", "p50_s", "p95_s", "mean_s", "slo_attainment", "p50_gap"]


def add_arguments(p) -> None:
    p.add_argument("--model", default="tiny-sdxl")
    p.add_argument("--cost-model", required=True, help="JSON from `gouache profile` for the same model and sizes")
    p.add_argument("--policies", default="patched,orca,round-knapsack",
                   help="comma-separated step policies the cost model can price")
    p.add_argument("--patch-size", type=int, default=128)
    p.add_argument("--requests", type=int, default=30)
    p.add_argument("--rate", type=float, default=0.5)
    p.add_argument("--sizes", default="256,384")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--slo-scale", type=float, default=5.0, help="SLO = scale x standalone latency")
    p.add_argument("--max-batch-size", type=int, default=4)
    p.add_argument("--round-s", type=float, default=0.5, help="round length of round-knapsack")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--torch-threads", type=int, default=None,
                   help="intra-op threads of torch in the live engine: the number the cost model was profiled with")
    p.add_argument("--out", default="benchmarks/results/sim_to_real.json")


@dataclass
class LiveRun:
    """What one live run measured."""

    latency: dict[str, float] = field(default_factory=dict)  # request id -> arrival to last step, s
    dropped: set[str] = field(default_factory=set)  # ids that ended with an error (deadline unattainable)
    forward_ratio: list[float] = field(default_factory=list)  # [steps] measured forward / predicted
    prep_s: list[float] = field(default_factory=list)  # [requests] arrival -> queued, s


async def live_run(args, policy: str, trace: list[SimRequest], model) -> LiveRun:
    """Run the trace through the real engine in this process."""
    from gouache.config import EngineConfig, ModelConfig, SchedulerConfig
    from gouache.engine.client import AsyncEngine
    from gouache.outputs import ErrorEvent, ProgressEvent
    from gouache.request import ImageRequest

    sched = SchedulerConfig(policy=policy, max_batch_size=args.max_batch_size, cost_model=args.cost_model,
                            round_s=args.round_s)
    engine = AsyncEngine.from_config(ModelConfig(args.model), EngineConfig(patch_size=args.patch_size, torch_threads=args.torch_threads), sched)
    out, arrivals = LiveRun(), {}
    _observe(engine, model, out, arrivals)
    await engine.start()
    start = time.monotonic()

    async def one(r: SimRequest) -> None:
        await asyncio.sleep(max(0.0, r.arrival - (time.monotonic() - start)))
        arrival = arrivals[f"{r.request_id}-0"] = time.monotonic()
        request = ImageRequest(f"{r.request_id}-0", "a red fox", r.width, r.height, r.steps, 5.0, seed=1,
                               arrival_time=arrival, slo_ms=1e3 * r.slo_s if r.slo_s else None)
        async for event in await engine.submit([request]):
            if isinstance(event, ProgressEvent) and event.step == event.total_steps:
                out.latency[r.request_id] = time.monotonic() - arrival
            elif isinstance(event, ErrorEvent):
                out.dropped.add(r.request_id)

    await asyncio.gather(*(one(r) for r in trace))
    await engine.aclose()
    return out


def _observe(engine, model, out: LiveRun, arrivals: dict[str, float]) -> None:
    """Hook the engine's queue entry and step callbacks to collect the diagnostics."""
    add, on_step = engine.core.add, engine.core.on_step

    def noting_add(state) -> None:
        out.prep_s.append(time.monotonic() - arrivals[state.request_id])
        add(state)

    def noting_step(report) -> None:
        shapes = [[report.states[rid].shape for rid in group] for group in report.plan.groups]
        if report.plan.patched:
            predicted = model.step_time([s for group in shapes for s in group], patched=True)
        else:
            predicted = sum(model.step_time(group, patched=False) for group in shapes)
        out.forward_ratio.append(report.output.forward_s / predicted)
        on_step(report)

    engine.core.add, engine.core.on_step = noting_add, noting_step


def run(args) -> int:
    from gouache.config import SchedulerConfig
    from gouache.sched.costmodel import load
    from gouache.sched.policies import make_policy
    from gouache.sim.simulator import simulate, standalone_latency

    model = load(args.cost_model)

    def step_cost(plan, states) -> float:
        shapes = [[states[rid].shape for rid in group] for group in plan.groups]
        if plan.patched:
            return model.step_time([s for group in shapes for s in group], patched=True)
        return sum(model.step_time(group, patched=False) for group in shapes)

    sizes = [(int(s), int(s)) for s in args.sizes.split(",")]
    spec = WorkloadSpec(args.requests, args.rate, sizes=sizes, steps=args.steps, slo_scale=args.slo_scale,
                        seed=args.seed)
    trace = make_workload(spec, standalone_latency(step_cost))
    shares_cores = not args.torch_threads or args.torch_threads >= (os.cpu_count() or 1)
    stage_cost = (lambda state: model.stage_time(state.shape)) if shares_cores else None
    rows, runs, load_avg = [], {}, {"start": os.getloadavg()[0]}
    for policy in args.policies.split(","):
        live = asyncio.run(live_run(args, policy, trace, model))
        config = SchedulerConfig(policy=policy, max_batch_size=args.max_batch_size, round_s=args.round_s)
        result = simulate(trace, make_policy(config, model), step_cost, stage_cost=stage_cost)
        simulated = {r.request.request_id: r.latency for r in result.records if r.latency is not None}
        dropped = {r.request.request_id for r in result.records if r.dropped_at is not None}
        live_row = _row(policy, "live engine", live.latency, live.dropped, trace)
        sim_row = _row(policy, "simulator", simulated, dropped, trace)
        sim_row["p50_gap"] = sim_row["p50_s"] / live_row["p50_s"] - 1
        rows += [live_row, sim_row]
        runs[policy] = {"live": live.latency, "simulated": simulated,
                        "live_forward_over_predicted_median": statistics.median(live.forward_ratio),
                        "live_prep_median_s": statistics.median(live.prep_s)}
        print(f"{policy}: simulated median {sim_row['p50_gap']:+.1%} off the live one; live forward / predicted "
              f"{runs[policy]['live_forward_over_predicted_median']:.2f}, prep {runs[policy]['live_prep_median_s']:.3f} s")
    load_avg["end"] = os.getloadavg()[0]
    table = markdown_table(rows, COLUMNS)
    print(table)
    command = "gouache bench sim-to-real " + " ".join(sys.argv[3:])
    write_json(args.out, {"command": command, "rows": rows, "runs": runs, "load_average_1min": load_avg,
                          "cpu_count": os.cpu_count(), "stages_charged": shares_cores})
    notes = "\n".join(f"- {p}: live forward / predicted (median) {r['live_forward_over_predicted_median']:.2f}, "
                      f"live preparation {r['live_prep_median_s']:.3f} s" for p, r in runs.items())
    Path(args.out).with_suffix(".md").write_text(
        f"`{command}`\n\n{table}\n\np50_gap: simulated median over live median - 1 (target: within 15 %).\n\n{notes}\n"
        f"- 1-minute load average {load_avg['start']:.2f} at start, {load_avg['end']:.2f} at end "
        f"({os.cpu_count()} cores)\n"
        f"- stage work (preparation, decode, encode) charged to the simulated device: {'yes' if shares_cores else 'no'}\n")
    return 0


def _row(policy: str, source: str, latency: dict[str, float], dropped: set[str], trace: list[SimRequest]) -> dict:
    values = list(latency.values())
    met = sum(1 for r in trace if r.request_id in latency and r.slo_s and latency[r.request_id] <= r.slo_s)
    with_slo = sum(1 for r in trace if r.slo_s)
    return {"policy": policy, "source": source, "finished": len(values), "dropped": len(dropped),
            "p50_s": statistics.median(values), "p95_s": percentile(values, 95), "mean_s": statistics.fmean(values),
            "slo_attainment": met / with_slo if with_slo else None}
