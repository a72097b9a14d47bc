"""Video in simulation: a mix of clips on 64 devices, TetriServe's round planner against fixed
sequence-parallel degrees (issue 61).

Costs: T(clip, k) and the hand-off as measured by `gouache profile --devices N --model M --sizes
WxHxF,...` (a `ParallelCostModel` file with its "handoff" entry): measured, not assumed. The
committed run's file is tiny-wan on this 2-core CPU, so k is 1 or 2 (two gloo worker processes);
a profile on a GPU host prices the degrees it has, and the same command simulates it.

Workload: Poisson arrivals of the profiled clips, drawn uniformly, `steps` denoising steps each,
at `load` times the pool's capacity at degree 1 (devices over the mean standalone latency). Each
clip's SLO is `slo_scale` times its own standalone latency at degree 1, TetriServe's rule of
targets per resolution; the scales are swept with the arrivals and clips unchanged, so scales
differ in deadlines only. τ is `shortest_round` (one step of the slowest clip at its fastest
degree). Policies: `fixed-sp-k` for every profiled k (xDiT-style: every request at k devices),
and `round-knapsack` (a degree per request per round), once more with hand-offs free (the row
`round-knapsack, free hand-off`: what moving requests between devices costs it).

`video_experiment(out_dir, cost_model)` writes video.json, video.md and video.png.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from gouache.config import SchedulerConfig
from gouache.model_info import shown
from gouache.sched.costmodel import load
from gouache.sched.parallel_costmodel import ParallelCostModel
from gouache.sched.policies import make_policy
from gouache.sched.policies.round_knapsack import shortest_round
from gouache.sim.costs import PredictedStepCost, load_handoff
from gouache.sim.exp_tetriserve import ADAPTIVE, FREE_HANDOFF, improvements
from gouache.sim.report import markdown_table, plot_sweep, summary_row, write_json
from gouache.sim.simulator import simulate
from gouache.sim.workloads import WorkloadSpec, make_workload

PROFILE = "benchmarks/results/parallel_tiny-wan.json"  # the committed run's measured costs


@dataclass
class VideoSetup:
    """One run of the experiment; the defaults are the committed run's."""

    num_devices: int = 64
    num_requests: int = 600  # per (SLO scale, seed) point
    load: float = 0.9  # arrival rate / the pool's capacity at degree 1
    steps: int = 20  # denoising steps of every clip
    slo_scales: tuple[float, ...] = (1.0, 1.25, 1.5, 2.0, 3.0)
    seeds: tuple[int, ...] = (0, 1, 2)

    def __post_init__(self) -> None:
        if self.num_devices < 1 or self.num_requests < 1 or self.load <= 0 or self.steps < 1 or not self.seeds:
            raise ValueError("num_devices, num_requests, load and steps must be positive, and seeds non-empty")


def video_experiment(out_dir: str | Path, cost_model: str | Path = PROFILE, setup: VideoSetup | None = None) -> dict:
    """Run the sweep on the clips `cost_model` prices; write JSON, a markdown table and a plot to
    `out_dir`; return the JSON."""
    setup = setup or VideoSetup()
    model, handoff = load(cost_model), load_handoff(cost_model)
    if not isinstance(model, ParallelCostModel):
        raise ValueError(f"{cost_model} is a {model.kind} cost model; the video experiment takes a parallel "
                         "T(clip, k) one (`gouache profile --devices N --sizes WxHxF,...`)")
    clips = [res for res in model.resolutions if len(res) == 3]
    if not clips:
        raise ValueError(f"{cost_model} prices no clips; profile a video model with --sizes WxHxF,...")
    degrees = sorted({k for res in clips for k in model.degrees(res)})
    # (label, policy, hand-off charged); round-knapsack again with moves free, to show what they cost
    runs = [(f"fixed-sp-{k}", f"fixed-sp-{k}", handoff) for k in degrees]
    runs += [(ADAPTIVE, ADAPTIVE, handoff), (FREE_HANDOFF, ADAPTIVE, None)]

    def solo(width: int, height: int, steps: int, frames: int = 1) -> float:
        return model.standalone_latency((height, width, frames), steps)

    mean_latency = statistics.mean(solo(w, h, setup.steps, f) for h, w, f in clips)
    rate = setup.load * setup.num_devices / mean_latency
    tau = shortest_round(lambda res, k: model.step_time([res], False, k), clips, setup.num_devices)
    rows = []
    for scale in setup.slo_scales:
        for seed in setup.seeds:
            spec = WorkloadSpec(setup.num_requests, rate, sizes=[(w, h, f) for h, w, f in clips], steps=setup.steps,
                                slo_scale=scale, seed=seed)
            requests = make_workload(spec, solo)
            for label, name, charged in runs:
                policy = make_policy(SchedulerConfig(policy=name, round_s=tau), model)
                result = simulate(requests, policy, PredictedStepCost(model), num_devices=setup.num_devices,
                                  handoff=charged)
                rows.append({**summary_row(result, mix="uniform", slo_scale=scale, seed=seed), "policy": label})
    points = _average(rows)
    data = {
        "experiment": f"Video: SLO attainment vs SLO scale on {setup.num_devices} devices (simulated)",
        "setup": asdict(setup), "cost_model": str(cost_model), "cost_model_source": model.source,
        "clips": [shown(res) for res in clips], "rate_per_s": rate, "tau_s": tau,
        "handoff": None if handoff is None else {"fixed_s": handoff.fixed_s,
                                                 "per_megapixel_s": handoff.per_megapixel_s},
        "step_times": {shown(res): model.table[res] for res in clips},
        "points": points, "improvement": improvements(points), "runs": rows,
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "video.json", data)
    (out / "video.md").write_text(render_markdown(data))
    plot_sweep(points, "slo_scale", "slo_attainment", out / "video.png",
               title=f"clips {', '.join(data['clips'])} on {setup.num_devices} devices",
               xlabel="SLO scale", ylabel="SLO attainment ratio")
    return data


def _average(rows: list[dict]) -> list[dict]:
    """One point per (SLO scale, policy): SAR, utilization and p99 averaged over the seeds."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["mix"], row["slo_scale"], row["policy"]), []).append(row)
    return [{"mix": mix, "slo_scale": scale, "policy": policy,
             **{key: statistics.mean(r[key] for r in group)
                for key in ("slo_attainment", "utilization", "latency_p99_s")}}
            for (mix, scale, policy), group in groups.items()]


def render_markdown(data: dict) -> str:
    setup = data["setup"]
    steps = ", ".join(f"{clip}: " + ", ".join(f"k={k} {s * 1e3:.1f} ms" for k, s in row.items())
                      for clip, row in data["step_times"].items())
    lines = [f"# {data['experiment']}\n",
             f"Clips {', '.join(data['clips'])} (WxHxF), drawn uniformly, {setup['steps']} steps; Poisson arrivals at "
             f"{data['rate_per_s']:.1f}/s ({setup['load']:g}x the pool's capacity at degree 1); "
             f"{setup['num_requests']} requests x {len(setup['seeds'])} seeds per point; τ = {data['tau_s'] * 1e3:.1f} "
             f"ms. Step times measured ({data['cost_model_source']}): {steps}.\n"]
    table = []
    for scale in dict.fromkeys(p["slo_scale"] for p in data["points"]):
        row = {"slo_scale": scale}
        row.update({p["policy"]: p["slo_attainment"] for p in data["points"] if p["slo_scale"] == scale})
        table.append(row)
    lines.append(markdown_table(table, digits=3))
    for summary in data["improvement"].values():
        lines.append(f"\nround-knapsack over the best fixed degree: {summary['mean_gain_points']:+.1f} points mean, "
                     f"{summary['max_gain_points']:+.1f} at most; with hand-offs free "
                     f"{summary['mean_free_handoff_gain_points']:+.1f} mean.")
    return "\n".join(lines) + "\n"
