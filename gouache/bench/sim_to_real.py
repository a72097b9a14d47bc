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
device was as fast as while profiling), and the median preparation time before a request
reaches the queue, which the simulator does not delay the request by.

A shared machine's speed drifts by up to 2-3x over minutes, so the ratio is often not 1 even
with nothing else running: the profile and the live run saw different machines. Each policy
is therefore simulated twice: with the profiled costs, and with every step (and stage) cost
times that policy's live ratio. The first gap is what a user of the profile gets; the second
isolates what the simulator models (queueing, batching, the policy's choices) from how fast
the device happened to be. The ratio comes from the live run's step times alone, never from
its latencies.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from gouache.sim.costs import PredictedStepCost, standalone_latency
from gouache.sim.report import markdown_table, write_json
from gouache.sim.simulator import simulate
from gouache.sim.workloads import SimRequest, WorkloadSpec, make_workload
from gouache.stats import percentile

COLUMNS = ["policy", "source", "finished", "dropped", "p50_s", "p95_s", "mean_s", "slo_attainment", "p50_gap"]


def add_arguments(p) -> None:
    p.add_argument("--model", default="tiny-sdxl", help="model of the live engine (default: %(default)s)")
    p.add_argument("--cost-model", required=True, help="JSON from `gouache profile` for the same model and sizes")
    p.add_argument("--policies", default="patched,orca,round-knapsack",
                   help="comma-separated step policies the cost model can price (default: %(default)s)")
    p.add_argument("--patch-size", type=int, default=None,
                   help="the largest patch side in pixels for patching policies, UNet models (default: the server's)")
    p.add_argument("--requests", type=int, default=30, help="requests per policy (default: %(default)s)")
    p.add_argument("--rate", type=float, default=0.5,
                   help="mean arrivals in requests/s, Poisson (default: %(default)s)")
    p.add_argument("--sizes", default="256,384", help="comma-separated square sides in pixels (default: %(default)s)")
    p.add_argument("--steps", type=int, default=10, help="denoising steps per request (default: %(default)s)")
    p.add_argument("--slo-scale", type=float, default=5.0,
                   help="SLO = scale x standalone latency (default: %(default)s)")
    p.add_argument("--max-batch-size", type=int, default=4, help="images per step (default: %(default)s)")
    p.add_argument("--round-s", type=float, default=0.5,
                   help="round length of round-knapsack in seconds (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival trace (default: %(default)s)")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="intra-op threads of torch in the live engine: the number the cost model was profiled with")
    p.add_argument("--out", default="benchmarks/results/sim_to_real.json",
                   help="JSON output path (default: %(default)s)")


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
    from gouache.engine.build import build_engine
    from gouache.outputs import ErrorEvent, ProgressEvent
    from gouache.request import ImageRequest

    sched = SchedulerConfig(policy=policy, max_batch_size=args.max_batch_size, cost_model=args.cost_model,
                            round_s=args.round_s)
    engine_config = EngineConfig(patch_pixels=args.patch_size, torch_threads=args.torch_threads)
    engine = build_engine(ModelConfig(args.model), engine_config, sched)
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
    predicted = PredictedStepCost(model)

    def noting_add(state) -> None:
        out.prep_s.append(time.monotonic() - arrivals[state.request_id])
        add(state)

    def noting_step(report) -> None:
        out.forward_ratio.append(report.output.forward_s / predicted(report.batch, report.states))
        on_step(report)

    engine.core.add, engine.core.on_step = noting_add, noting_step


def run(args) -> int:
    from gouache.sched.costmodel import load

    model = load(args.cost_model)
    sizes = [(int(s), int(s)) for s in args.sizes.split(",")]
    spec = WorkloadSpec(args.requests, args.rate, sizes=sizes, steps=args.steps, slo_scale=args.slo_scale,
                        seed=args.seed)
    trace = make_workload(spec, standalone_latency(PredictedStepCost(model)))
    shares_cores = not args.torch_threads or args.torch_threads >= (os.cpu_count() or 1)
    rows, runs, load_avg = [], {}, {"start": os.getloadavg()[0]}
    for policy in args.policies.split(","):
        live = asyncio.run(live_run(args, policy, trace, model))
        speed = statistics.median(live.forward_ratio)
        live_row = _row(policy, "live engine", live.latency, live.dropped, trace)
        rows.append(live_row)
        runs[policy] = {"live": live.latency, "live_forward_over_predicted_median": speed,
                        "live_prep_median_s": statistics.median(live.prep_s)}
        for label, source, scale in (("simulated", "simulator", 1.0),
                                     ("simulated_at_live_speed", f"simulator, steps x {speed:.2f}", speed)):
            simulated, dropped = _simulated(args, policy, trace, model, scale, shares_cores)
            row = _row(policy, source, simulated, dropped, trace)
            row["p50_gap"] = row["p50_s"] / live_row["p50_s"] - 1
            rows.append(row)
            runs[policy][label] = simulated
        print(f"{policy}: simulated median {rows[-2]['p50_gap']:+.1%} off the live one ({rows[-1]['p50_gap']:+.1%} at "
              f"the live speed); live forward / predicted {speed:.2f}, prep {runs[policy]['live_prep_median_s']:.3f} s")
    load_avg["end"] = os.getloadavg()[0]
    table = markdown_table(rows, COLUMNS)
    print(table)
    command = "gouache bench sim-to-real " + " ".join(sys.argv[3:])
    write_json(args.out, {"command": command, "rows": rows, "runs": runs, "load_average_1min": load_avg,
                          "cpu_count": os.cpu_count(), "stages_charged": shares_cores})
    notes = "\n".join(f"- {p}: live forward / predicted (median) {r['live_forward_over_predicted_median']:.2f}, "
                      f"live preparation {r['live_prep_median_s']:.3f} s" for p, r in runs.items())
    Path(args.out).with_suffix(".md").write_text(
        f"`{command}`\n\n{table}\n\np50_gap: simulated median over live median - 1 (target: within 15 %). "
        f"Rows \"steps x r\": every simulated cost times r, that policy's median live forward / predicted "
        f"(the device's speed during the live run against the profile's).\n\n{notes}\n"
        f"- 1-minute load average {load_avg['start']:.2f} at start, {load_avg['end']:.2f} at end "
        f"({os.cpu_count()} cores)\n"
        f"- stage work (preparation, decode, encode) charged to the simulated device: "
        f"{'yes' if shares_cores else 'no'}\n")
    return 0


def _simulated(args, policy: str, trace: list[SimRequest], model, scale: float,
               charge_stages: bool) -> tuple[dict[str, float], set[str]]:
    """The trace in the simulator with every step (and stage) cost times `scale`: latency by
    id of the finished requests, and the ids the policy dropped. The policy plans with the
    unscaled model, as it does live."""
    from gouache.config import SchedulerConfig
    from gouache.sched.policies import make_policy

    def stage_cost(state) -> tuple[float, float]:
        prep, post = model.stage_time(state.resolution)
        return scale * prep, scale * post

    config = SchedulerConfig(policy=policy, max_batch_size=args.max_batch_size, round_s=args.round_s)
    result = simulate(trace, make_policy(config, model), PredictedStepCost(model, scale),
                      stage_cost=stage_cost if charge_stages else None)
    simulated = {r.request.request_id: r.latency for r in result.records if r.latency is not None}
    return simulated, {r.request.request_id for r in result.records if r.dropped_at is not None}


def _row(policy: str, source: str, latency: dict[str, float], dropped: set[str], trace: list[SimRequest]) -> dict:
    values = list(latency.values())
    met = sum(1 for r in trace if r.request_id in latency and r.slo_s and latency[r.request_id] <= r.slo_s)
    with_slo = sum(1 for r in trace if r.slo_s)
    return {"policy": policy, "source": source, "finished": len(values), "dropped": len(dropped),
            "p50_s": percentile(values, 50), "p95_s": percentile(values, 95), "mean_s": statistics.fmean(values),
            "slo_attainment": met / with_slo if with_slo else None}
