"""`gouache bench tiers`: service tiers, preemption and tenants on the live engine, and the same
overload trace in the simulator (issue 38's live targets).

One in-process engine per run (`--model`, `patched-slo` planning with `--cost-model`, one
device, `--max-queue-len` with flex refused past half of it). Capacity is one request over
the mean standalone latency to the image of the trace's sizes, measured on the live engine
just before the runs (`--calibrate` requests of each size, one at a time, the median of
each): the cost model's prediction of it moved -11 % to +8 % against the live engine from
run to run on a shared CPU, and the load with it. The SLOs come from the same measurement.

- **overload**: Poisson arrivals at `--load` x capacity for `--duration-s`, tiers drawn
  20/60/20 (priority, default, flex) and tenants 50/30/20 (alpha, beta, gamma). The tiers'
  SLOs are one figure each, as `--tier-slo-ms` gives them: priority `--priority-slo-scale` x
  the largest size's standalone latency (its stages included: the SLO is to the image),
  default 10x it, flex none. Per tier: finished,
  refused (429), dropped (deadline unattainable), lost (accepted, never answered), p50 / p95
  latency to the image, SLO attainment. Targets: priority p95 <= 1.3x the idle run's, 0 lost,
  flex refused first.
- **idle**: the overload trace's priority requests alone.
- **fairness**: two tenants of equal weight, each sending 1x capacity (2x together), default
  tier: their finished requests within 10 % of each other.
- **isolation**: tenant `calm` at half the capacity (Poisson) and tenant `flood` (rate limit a
  quarter of capacity, through the API's `TenantBook`) sending at its limit, evenly spaced (its
  whole allowance, all admitted), then at 10x it (Poisson; the limit admits as much): calm's p95
  moves by < 10 %. With `--isolation-repeats R`, R such pairs in turn, each with traces of its
  own seeds: calm's p95 per condition over all its requests, and each pair's change beside it
  (their spread is the measure's own scatter).
- **simulated**: the overload trace in the simulator (`gouache.sim`), the same policy, queue
  limit and cost model: per tier, p50 / p95 to the end of denoising and the requests refused,
  against the live run's. `sim_to_real` compares each tier by the number its target names
  (target: within 10 %): priority's and default's latency (p50 and p95), flex's refusals ("flex
  gets the 429s first"). Flex's latency is not compared: a flex request runs on what the higher
  tiers leave over, a small difference of two large quantities, which a cost error of the
  profile's own scatter (3 %) moves by tens of percent (docs/tiers.md). A simulated step costs
  its predicted forward times the live run's engine step over predicted forward, summed over its
  steps: a step of the engine loop is the forward, the sampler steps, the composer and the
  loop's own work, and it runs while the stage threads encode prompts and decode images on the
  same cores, so their cost is inside the steps measured, not added beside them. With
  `--calibrate-steps` (the default, as in `gouache serve`) the live policy plans with the cost
  model scaled online by the measured steps, so the simulated one plans with it times the same
  factor. `simulated_sampled_steps` draws each simulated step's factor from the live steps' own
  ratios instead (seeded), so that the simulated steps vary as the live ones did.
  `simulated_stages_serial` keeps the previous accounting for comparison: every cost times the
  median forward over predicted, and each request's stage work charged to the device between
  steps (`simulate(stage_cost=...)`).

Writes JSON and a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gouache.sim.report import markdown_table, write_json
from gouache.sim.workloads import SimRequest, tiered_trace
from gouache.stats import percentile

TIER_SHARES = {"priority": 0.2, "default": 0.6, "flex": 0.2}
TENANT_SHARES = {"alpha": 0.5, "beta": 0.3, "gamma": 0.2}


def add_arguments(p) -> None:
    p.add_argument("--model", default="tiny-sdxl", help="model of the live engine (default: %(default)s)")
    p.add_argument("--cost-model", required=True, help="JSON from `gouache profile` for the same model and sizes")
    p.add_argument("--sizes", default="256,384", help="comma-separated square sides in pixels (default: %(default)s)")
    p.add_argument("--steps", type=int, default=10, help="denoising steps per request (default: %(default)s)")
    p.add_argument("--load", type=float, default=2.0, help="overload arrival rate / capacity (default: %(default)s)")
    p.add_argument("--duration-s", type=float, default=300.0,
                   help="seconds of overload arrivals (default: %(default)s)")
    p.add_argument("--side-duration-s", type=float, default=120.0,
                   help="seconds of arrivals of the fairness and isolation runs (default: %(default)s)")
    p.add_argument("--isolation-repeats", type=int, default=1,
                   help="pairs of isolation runs (flood at 1x, then 10x its limit), each with its own traces "
                        "(default: %(default)s)")
    p.add_argument("--priority-slo-scale", type=float, default=1.5,
                   help="priority's SLO over the largest size's standalone latency (default: %(default)s)")
    p.add_argument("--max-batch-size", type=int, default=4, help="images per step (default: %(default)s)")
    p.add_argument("--max-queue-len", type=int, default=16, help="images in flight before 429 (default: %(default)s)")
    p.add_argument("--torch-threads", type=int, default=None, help="intra-op threads of torch (default: torch's)")
    p.add_argument("--calibrate", type=int, default=6,
                   help="requests of each size served alone to measure capacity (default: %(default)s)")
    p.add_argument("--calibrate-steps", action=argparse.BooleanOptionalAction, default=True,
                   help="the engine scales its cost model online by measured step times, as `gouache serve` "
                        "does by default (default: on)")
    p.add_argument("--seed", type=int, default=0, help="seed of the traces (default: %(default)s)")
    p.add_argument("--out", default="benchmarks/results/tiers_cpu.json", help="JSON output path (default: %(default)s)")


@dataclass
class Outcome:
    """What became of one request of a live run."""

    result: str = "lost"  # finished | refused | dropped | failed | lost
    latency_s: float | None = None  # arrival -> its image
    denoised_s: float | None = None  # arrival -> its last denoising step


@dataclass
class SampledStepCost:
    """A simulated step's cost: its prediction times one of `ratios` drawn at random (seeded)."""

    predicted: Callable[..., float]
    ratios: Sequence[float]
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def __call__(self, batch, states) -> float:
        return self.predicted(batch, states) * self.rng.choice(self.ratios)


@dataclass
class LiveRun:
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    forward_ratio: list[float] = field(default_factory=list)  # [steps] measured forward / predicted
    step_ratio: list[float] = field(default_factory=list)  # [steps] engine step (launch to result) / predicted forward
    predicted_s: float = 0.0  # all steps' predicted forwards
    step_s: float = 0.0  # ... and their engine steps, launch to result
    scale_end: float | None = None  # the engine's measured / predicted step scale at the end (--calibrate-steps)


def capacity_rps(model, sizes: list[tuple[int, int]], steps: int) -> float:
    """One device's requests per second at the sizes' mean standalone latency, stages included,
    as the cost model predicts it."""
    from gouache.sim.costs import PredictedStepCost, standalone_latency

    alone = standalone_latency(PredictedStepCost(model))
    return 1.0 / statistics.fmean(alone(w, h, steps) + sum(model.stage_time((h, w))) for w, h in sizes)


def live_standalone(args, sizes: list[tuple[int, int]], model) -> dict[tuple[int, int], float]:
    """Each size's median latency to the image on the live engine, served alone: `--calibrate`
    requests of each, far enough apart never to meet (the first of each size left out: a new
    size's first forward allocates)."""
    from gouache.sim.costs import PredictedStepCost, standalone_latency

    alone = standalone_latency(PredictedStepCost(model))
    gap = 3 * max(alone(w, h, args.steps) + sum(model.stage_time((h, w))) for w, h in sizes)
    trace = [SimRequest(f"s{i}", i * gap, *sizes[i % len(sizes)], args.steps, tier="default")
             for i in range(len(sizes) * (args.calibrate + 1))]
    run = asyncio.run(live_run(args, trace, model, ()))
    return {size: statistics.median(run.outcomes[r.request_id].latency_s for r in trace[len(sizes):]
                                    if (r.width, r.height) == size)
            for size in sizes}


async def live_run(args, trace: list[SimRequest], model, tier_slo_ms, book=None) -> LiveRun:
    """The trace through a fresh in-process engine; `book` (a `TenantBook`) limits each
    tenant's requests as the API does."""
    from gouache.config import EngineConfig, ModelConfig, SchedulerConfig
    from gouache.engine.build import build_engine
    from gouache.errors import DeadlineUnattainableError, QueueFullError
    from gouache.outputs import ErrorEvent, ImageEvent, ProgressEvent
    from gouache.request import ImageRequest, Tier
    from gouache.sim.costs import PredictedStepCost

    sched = SchedulerConfig(policy="patched-slo", max_batch_size=args.max_batch_size, cost_model=args.cost_model,
                            tier_slo_ms=tier_slo_ms, calibrate_steps=args.calibrate_steps)
    engine = build_engine(ModelConfig(args.model), EngineConfig(max_queue_len=args.max_queue_len,
                                                                torch_threads=args.torch_threads), sched)
    out, predicted, on_step = LiveRun(), PredictedStepCost(model), engine.core.on_step

    def noting_step(report) -> None:
        guess = predicted(report.batch, report.states)
        out.forward_ratio.append(report.output.forward_s / guess)
        out.step_ratio.append(report.step_s / guess)
        out.predicted_s += guess
        out.step_s += report.step_s
        on_step(report)

    engine.core.on_step = noting_step
    slo = dict(tier_slo_ms)
    await engine.start()
    start = time.monotonic()

    async def one(r: SimRequest) -> None:
        outcome = out.outcomes[r.request_id] = Outcome()
        await asyncio.sleep(max(0.0, r.arrival - (time.monotonic() - start)))
        arrival = time.monotonic()
        tenant = None if book is None else book.named(r.tenant)
        request = ImageRequest(f"{r.request_id}-0", "a red fox", r.width, r.height, r.steps, 5.0, seed=1,
                               arrival_time=arrival, slo_ms=slo.get(r.tier), tier=Tier.named(r.tier), tenant=r.tenant,
                               tenant_weight=r.weight)
        try:
            if tenant is not None:
                book.acquire(tenant)
            try:
                handle = await engine.submit([request])
                async for event in handle:
                    if isinstance(event, ProgressEvent) and event.step == event.total_steps:
                        outcome.denoised_s = time.monotonic() - arrival
                    elif isinstance(event, ImageEvent):
                        outcome.result, outcome.latency_s = "finished", time.monotonic() - arrival
                    elif isinstance(event, ErrorEvent):
                        outcome.result = "dropped" if event.kind == DeadlineUnattainableError.kind else "failed"
            finally:
                if tenant is not None:
                    book.release(tenant)
        except QueueFullError:  # the queue's limit, or the tenant's (TenantLimitError)
            outcome.result = "refused"

    await asyncio.gather(*(one(r) for r in trace))
    await engine.aclose()
    out.scale_end = engine.calibration.scale if engine.calibration is not None else None
    return out


def tier_rows(run: str, trace: list[SimRequest], latency: dict[str, Outcome]) -> list[dict]:
    rows = []
    for tier in TIER_SHARES:
        ids = [r for r in trace if r.tier == tier]
        if not ids:
            continue
        outcomes = [latency.get(r.request_id) for r in ids]
        values = [o.latency_s for o in outcomes if isinstance(o, Outcome) and o.latency_s is not None]
        count = {k: sum(isinstance(o, Outcome) and o.result == k for o in outcomes)
                 for k in ("finished", "refused", "dropped", "failed", "lost")}
        with_slo = [r for r in ids if r.slo_s]
        met = sum(1 for r in with_slo if (o := latency.get(r.request_id)) is not None
                  and o.latency_s is not None and o.latency_s <= r.slo_s)
        rows.append({"run": run, "tier": tier, "requests": len(ids), **count,
                     "p50_s": percentile(values, 50) if values else None,
                     "p95_s": percentile(values, 95) if values else None,
                     "slo_attainment": met / len(with_slo) if with_slo else None})
    return rows


def simulated_rows(args, trace, model, scale: float, tier_slo_ms, denoised: dict[str, float | None],
                   stages: bool, calibrated: bool = True, ratios: Sequence[float] = (),
                   refused: dict[str, int] | None = None) -> list[dict]:
    """The overload trace in the simulator, every cost times `scale` (with each request's stage
    work charged to the device if `stages`), planned with the cost model times `scale` where
    `calibrated` (and the live engine calibrated its own), else with the cost model as profiled;
    per tier, its denoising-end p50 / p95 beside the live run's (`denoised`: request id ->
    seconds to the end of its denoising). With `ratios` (the live steps' own measured /
    predicted), each simulated step costs its prediction times one of them drawn at random
    (seeded) instead of times `scale`: the steps vary as the live ones did, not only on average.
    `refused`: the live run's refusals per tier, beside the simulated ones."""
    from gouache.config import SchedulerConfig
    from gouache.sched.calibration import Calibrated
    from gouache.sched.policies import make_policy
    from gouache.sim.costs import PredictedStepCost
    from gouache.sim.simulator import Admission, simulate

    def stage_cost(state) -> tuple[float, float]:
        prep, post = model.stage_time(state.resolution)
        return scale * prep, scale * post

    config = SchedulerConfig(policy="patched-slo", max_batch_size=args.max_batch_size, tier_slo_ms=tier_slo_ms)
    # planned as the live engine plans: with the cost model corrected by the steps' measured scale
    planner = Calibrated(model, scale=scale) if calibrated and args.calibrate_steps else model
    cost = PredictedStepCost(model, scale) if not ratios else SampledStepCost(PredictedStepCost(model), ratios)
    result = simulate(trace, make_policy(config, planner), cost,
                      stage_cost=stage_cost if stages else None, admission=Admission(args.max_queue_len))
    rows = []
    for tier in TIER_SHARES:
        sim = [r.latency for r in result.records if r.request.tier == tier and r.latency is not None]
        real = [denoised[r.request_id] for r in trace if r.tier == tier and denoised.get(r.request_id) is not None]
        if not sim or not real:
            continue
        row = {"tier": tier, "live_p50_s": percentile(real, 50), "sim_p50_s": percentile(sim, 50),
               "live_p95_s": percentile(real, 95), "sim_p95_s": percentile(sim, 95),
               "sim_refused": sum(r.refused_at is not None for r in result.records if r.request.tier == tier)}
        row["p50_gap"] = row["sim_p50_s"] / row["live_p50_s"] - 1
        row["p95_gap"] = row["sim_p95_s"] / row["live_p95_s"] - 1
        if refused is not None:
            row["live_refused"] = refused.get(tier, 0)
            row["refused_gap"] = row["sim_refused"] / row["live_refused"] - 1 if row["live_refused"] else None
        rows.append(row)
    return rows


COMPARED = {"priority": ("p50_gap", "p95_gap"), "default": ("p50_gap", "p95_gap"), "flex": ("refused_gap",)}


def sim_to_real(rows: list[dict]) -> dict:
    """Each tier's largest gap among the numbers its target names (`COMPARED`), the largest of
    all, and whether it is within 10 %. A tier the live run refused nothing of has no refusal
    gap: then both must have refused nothing."""
    gaps = {}
    for row in rows:
        values = [row[key] for key in COMPARED[row["tier"]]]
        if None in values:  # no live refusal to compare with
            values = [0.0 if row["sim_refused"] == 0 else float("inf")]
        gaps[row["tier"]] = max(abs(v) for v in values)
    largest = max(gaps.values())
    return {"compared": {tier: list(COMPARED[tier]) for tier in gaps}, "largest_gap": gaps,
            "largest": largest, "within_10pct": largest <= 0.10}


def isolation_runs(args, capacity: float, sizes, model) -> tuple[dict, list[float]]:
    """Tenant calm beside tenant flood at 1x, then 10x, its rate limit, `--isolation-repeats`
    times with traces of each repeat's own seeds: per condition, calm's p95 over every repeat
    and the flood's refusals; and each pair's change of calm's p95."""
    from gouache.api.tenants import Tenant, TenantBook

    calm_latency: dict[str, list[float]] = {"1x": [], "10x": []}
    flood_counts = {"1x": [0, 0], "10x": [0, 0]}  # refused, sent
    pair_changes = []
    for repeat in range(args.isolation_repeats):
        seed, pair = args.seed + 100 * repeat, {}
        for flood_x in (1.0, 10.0):
            condition, limit = f"{flood_x:g}x", capacity / 4
            calm = tiered_trace(capacity / 2, args.side_duration_s, sizes, args.steps, {"default": 1.0}, {"calm": 1.0},
                                {"default": None}, seed + 2, "c")
            # at 1x, evenly spaced: it uses its whole allowance, as much as its limit admits of the 10x flood
            flood = tiered_trace(flood_x * limit, args.side_duration_s, sizes, args.steps, {"default": 1.0},
                                 {"flood": 1.0}, {"default": None}, seed + 3, "x", cv=0.05 if flood_x == 1 else 1.0)
            book = TenantBook((Tenant("k-calm", "calm"), Tenant("k-flood", "flood", rate_per_s=limit)))
            trace = sorted(calm + flood, key=lambda r: r.arrival)
            out = asyncio.run(live_run(args, trace, model, (), book))
            latency = [o.latency_s for rid, o in out.outcomes.items() if rid.startswith("c") and o.latency_s]
            calm_latency[condition] += latency
            pair[condition] = percentile(latency, 95)
            flood_counts[condition][0] += sum(o.result == "refused" for rid, o in out.outcomes.items()
                                              if rid.startswith("x"))
            flood_counts[condition][1] += len(flood)
        pair_changes.append(pair["10x"] / pair["1x"] - 1)
    return ({condition: {"calm_p95_s": percentile(latency, 95), "flood_refused": flood_counts[condition][0],
                         "flood_sent": flood_counts[condition][1]} for condition, latency in calm_latency.items()},
            pair_changes)


def run(args) -> int:
    from gouache.sched.costmodel import load

    if args.isolation_repeats < 1:
        raise ValueError(f"--isolation-repeats is a count of run pairs, >= 1; got {args.isolation_repeats}")
    model = load(args.cost_model)
    sizes = [(int(s), int(s)) for s in args.sizes.split(",")]
    predicted = capacity_rps(model, sizes, args.steps)
    standalone = live_standalone(args, sizes, model)
    capacity = 1.0 / statistics.fmean(standalone.values())
    largest = max(standalone.values())
    slo_s = {"priority": args.priority_slo_scale * largest, "default": 10 * largest, "flex": None}
    tier_slo_ms = tuple((tier, 1e3 * s) for tier, s in slo_s.items() if s is not None)
    overload = tiered_trace(args.load * capacity, args.duration_s, sizes, args.steps, TIER_SHARES, TENANT_SHARES,
                            slo_s, args.seed)
    live = asyncio.run(live_run(args, overload, model, tier_slo_ms))
    priority = [r for r in overload if r.tier == "priority"]
    idle = asyncio.run(live_run(args, priority, model, tier_slo_ms))
    rows = tier_rows("overload", overload, live.outcomes) + tier_rows("idle", priority, idle.outcomes)
    p95 = {row["run"]: row["p95_s"] for row in rows if row["tier"] == "priority"}

    fair_trace = tiered_trace(args.load * capacity, args.side_duration_s, sizes, args.steps, {"default": 1.0},
                              {"left": 0.5, "right": 0.5}, {"default": None}, args.seed + 1, "f")
    fair = asyncio.run(live_run(args, fair_trace, model, ()))
    finished = {name: sum(fair.outcomes[r.request_id].result == "finished" for r in fair_trace if r.tenant == name)
                for name in ("left", "right")}

    isolation, pair_changes = isolation_runs(args, capacity, sizes, model)
    denoised = {rid: o.denoised_s for rid, o in live.outcomes.items()}
    refused = {row["tier"]: row["refused"] for row in rows if row["run"] == "overload"}
    speed = statistics.median(live.forward_ratio)
    loop = live.step_s / live.predicted_s
    sim = simulated_rows(args, overload, model, loop, tier_slo_ms, denoised, stages=False, refused=refused)
    serial = simulated_rows(args, overload, model, speed, tier_slo_ms, denoised, stages=True, refused=refused)
    # what planning with the cost model as profiled would have done on the same steps
    raw = simulated_rows(args, overload, model, loop, tier_slo_ms, denoised, stages=False, calibrated=False,
                         refused=refused) if args.calibrate_steps else None
    sampled = simulated_rows(args, overload, model, loop, tier_slo_ms, denoised, stages=False, ratios=live.step_ratio,
                             refused=refused)
    command = "gouache bench tiers " + " ".join(sys.argv[3:])
    data = {"command": command, "capacity_rps": capacity, "capacity_rps_predicted": predicted,
            "standalone_s": {f"{w}x{h}": t for (w, h), t in standalone.items()}, "slo_s": slo_s, "rows": rows,
            "priority_p95_over_idle": p95["overload"] / p95["idle"],
            "lost": sum(o.result == "lost" for o in live.outcomes.values()),
            "fairness_finished": finished,
            "fairness_ratio": min(finished.values()) / max(max(finished.values()), 1),
            "isolation": isolation,
            "isolation_calm_p95_change": isolation["10x"]["calm_p95_s"] / isolation["1x"]["calm_p95_s"] - 1,
            "isolation_pair_changes": pair_changes,
            "calibrate_steps": args.calibrate_steps, "live_step_scale_end": live.scale_end,
            "live_forward_over_predicted_median": speed, "live_step_over_predicted": loop, "simulated": sim,
            "simulated_stages_serial": serial, "simulated_planned_uncalibrated": raw,
            "simulated_sampled_steps": sampled, "live_step_over_predicted_per_step": live.step_ratio,
            "sim_to_real": {"simulated": sim_to_real(sim), "simulated_sampled_steps": sim_to_real(sampled)},
            "live_denoised_s": denoised,
            "cpu_count": os.cpu_count(), "load_average_1min_end": os.getloadavg()[0]}
    write_json(args.out, data)
    Path(args.out).with_suffix(".md").write_text(report(data))
    print(report(data))
    return 0


def _agreement(data: dict) -> str:
    """The sim-to-real verdict's line (results from before it have none)."""
    if "sim_to_real" not in data:
        return ""
    parts = [f"{name.replace('_', ' ')}: largest gap {100 * v['largest']:.1f} % "
             f"({', '.join(f'{tier} {100 * gap:.1f} %' for tier, gap in v['largest_gap'].items())})"
             for name, v in data["sim_to_real"].items()]
    return ("Sim-to-real, each tier by its target's numbers (priority and default: p50 and p95 to the end of "
            "denoising; flex: refusals), target within 10 %: " + "; ".join(parts) + ".\n\n")


def report(data: dict) -> str:
    iso = data["isolation"]
    return (f"`{data['command']}`\n\nCapacity {data['capacity_rps']:.2f} requests/s "
            f"(measured alone on the live engine; the cost model predicts {data['capacity_rps_predicted']:.2f}); "
            f"SLOs: priority {data['slo_s']['priority']:.2f} s, default {data['slo_s']['default']:.2f} s, "
            "flex none.\n\n"
            + markdown_table(data["rows"])
            + f"\nPriority p95, overload / idle: {data['priority_p95_over_idle']:.2f} (target <= 1.3); "
            f"lost: {data['lost']}. "
            + (f"The engine planned with its cost model scaled online by its steps (--calibrate-steps); the scale "
               f"ended the overload run at {data['live_step_scale_end']:.2f}.\n\n" if data.get("calibrate_steps")
               else "The engine planned with its cost model as profiled (--no-calibrate-steps).\n\n")
            + f"Fairness, two tenants of weight 1 at 1x capacity each: finished "
            f"{data['fairness_finished']} (ratio {data['fairness_ratio']:.2f}, target >= 0.9).\n\n"
            f"Isolation: calm's p95 {iso['1x']['calm_p95_s']:.2f} s with flood at its rate limit, "
            f"{iso['10x']['calm_p95_s']:.2f} s at 10x it ({100 * data['isolation_calm_p95_change']:+.1f} %, target "
            f"within 10 %); flood refused {iso['10x']['flood_refused']} of {iso['10x']['flood_sent']}"
            + (f"; each pair's change: {', '.join(f'{100 * c:+.1f} %' for c in data['isolation_pair_changes'])}"
               if len(data.get("isolation_pair_changes", ())) > 1 else "") + ".\n\n"
            + _agreement(data) +
            f"Simulated, end of denoising: every step x {data['live_step_over_predicted']:.2f} (the live engine's "
            "steps over their predicted forwards, summed; stage work inside them):\n\n"
            + markdown_table(data["simulated"])
            + ("\nThe same, each step's cost drawn from the live steps' own ratios (seeded):\n\n"
               + markdown_table(data["simulated_sampled_steps"]) if data.get("simulated_sampled_steps") else "")
            + (f"\nThe same, planned with the cost model as profiled (the engine's steps still x "
               f"{data['live_step_over_predicted']:.2f}):\n\n" + markdown_table(data["simulated_planned_uncalibrated"])
               if data.get("simulated_planned_uncalibrated") else "")
            + f"\nStages charged to the device between steps, every cost x "
            f"{data['live_forward_over_predicted_median']:.2f} (the live forward / predicted median):\n\n"
            + markdown_table(data["simulated_stages_serial"]))
