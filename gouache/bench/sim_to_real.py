"""`gouache bench sim-to-real`: one workload through the live engine and through the simulator
with the profiled cost model; how far apart are their latency distributions?

Latency here is arrival -> end of the last denoising step in both (the live side sees it as
the last progress event), so VAE decode and image encoding, which the simulator does not
model, are left out on both sides.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path

from gouache.bench.serve import percentile
from gouache.sim.report import markdown_table, write_json
from gouache.sim.workloads import SimRequest, WorkloadSpec, make_workload


def add_arguments(p) -> None:
    p.add_argument("--model", default="tiny-sdxl")
    p.add_argument("--cost-model", required=True, help="JSON from `gouache profile` for the same model and sizes")
    p.add_argument("--policy", default="patched", help="a step policy the cost model describes (patched, patched-slo)")
    p.add_argument("--patch-size", type=int, default=128)
    p.add_argument("--requests", type=int, default=30)
    p.add_argument("--rate", type=float, default=0.5)
    p.add_argument("--sizes", default="256,384")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--max-batch-size", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/sim_to_real.json")


async def live_latencies(args, trace: list[SimRequest]) -> dict[str, float]:
    """Arrival -> last denoising step of each request, through the real engine in this process."""
    from gouache.config import EngineConfig, ModelConfig, SchedulerConfig
    from gouache.engine.client import AsyncEngine
    from gouache.outputs import ProgressEvent
    from gouache.request import ImageRequest

    sched = SchedulerConfig(policy=args.policy, max_batch_size=args.max_batch_size, cost_model=args.cost_model)
    engine = AsyncEngine.from_config(ModelConfig(args.model), EngineConfig(patch_size=args.patch_size), sched)
    await engine.start()
    start = time.monotonic()
    out: dict[str, float] = {}

    async def one(r: SimRequest) -> None:
        await asyncio.sleep(max(0.0, r.arrival - (time.monotonic() - start)))
        arrival = time.monotonic()
        request = ImageRequest(f"{r.request_id}-0", "a red fox", r.width, r.height, r.steps, 5.0, seed=1,
                               arrival_time=arrival)
        async for event in await engine.submit([request]):
            if isinstance(event, ProgressEvent) and event.step == event.total_steps:
                out[r.request_id] = time.monotonic() - arrival

    await asyncio.gather(*(one(r) for r in trace))
    await engine.aclose()
    return out


def run(args) -> int:
    from gouache.config import SchedulerConfig
    from gouache.sched.costmodel import load
    from gouache.sched.policies import make_policy
    from gouache.sim.simulator import simulate

    sizes = [(int(s), int(s)) for s in args.sizes.split(",")]
    trace = make_workload(WorkloadSpec(args.requests, args.rate, sizes=sizes, steps=args.steps, seed=args.seed))
    live = asyncio.run(live_latencies(args, trace))
    model = load(args.cost_model)

    def step_cost(plan, states) -> float:
        return sum(model.step_time([states[rid].shape for rid in group], patched=True) for group in plan.groups)

    policy = make_policy(SchedulerConfig(policy=args.policy, max_batch_size=args.max_batch_size), model)
    simulated = {r.request.request_id: r.latency for r in simulate(trace, policy, step_cost).records}
    rows = [_row("live engine", list(live.values())), _row("simulator", list(simulated.values()))]
    gap = rows[1]["p50_s"] / rows[0]["p50_s"] - 1
    table = markdown_table(rows)
    print(table)
    print(f"simulated median is {gap:+.1%} off the live one (target: within 15 %)")
    write_json(args.out, {"command": "gouache bench sim-to-real " + " ".join(sys.argv[3:]), "rows": rows,
                          "median_gap": gap, "live": live, "simulated": simulated})
    Path(args.out).with_suffix(".md").write_text(f"{table}\n\nsimulated median {gap:+.1%} off the live one\n")
    return 0


def _row(name: str, latencies: list[float]) -> dict:
    return {"source": name, "requests": len(latencies), "p50_s": statistics.median(latencies),
            "p95_s": percentile(latencies, 95), "mean_s": statistics.fmean(latencies)}
