"""Experiment: PatchedServe §8 (Fig. 11), SLO satisfaction against load on one SDXL H100.

Poisson arrivals at a sweep of rates around saturation; 512, 768 and 1024 px equally likely;
50 steps; SLO = 5x the standalone latency of the request's size; max batch 16 (PatchedServe's
setting for every method). Policies: `fcfs-static` (DistriFusion-style FCFS), `orca`
(NIRVANA's ORCA batching, one forward per resolution), `patched` (PatchedCache: patched
batching, FCFS admission) and `patched-slo` (Algorithm 1), which plans with the very cost
model the simulator charges.

The step cost (`GpuBatchStepCost`) is derived, not measured: see `SdxlH100Assumptions`. Its
one assumed term that a benchmark can measure is the patched forward's overhead: each
`gouache bench batching` JSON given (`--batching-costs`) reruns the sweep with the overhead
that benchmark measured (`measured_overhead`), and the tables get a row per source. A cost
model from `gouache profile` given there replaces the derived cost whole: every forward is
charged (and planned by patched-slo) as the device measured it, with batches no larger than
the profile measured (`profiled`).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from gouache.config import SchedulerConfig
from gouache.request import RequestState
from gouache.sched.costmodel import BatchCostModel, load
from gouache.sched.plan import Batch
from gouache.sched.policies import make_policy
from gouache.sim.costs import PredictedStepCost, standalone_latency
from gouache.sim.report import markdown_table, plot_sweep, summary_row, write_json
from gouache.sim.simulator import simulate
from gouache.sim.workloads import PATCHEDSERVE_SIZES, WorkloadSpec, make_workload

POLICIES = ("fcfs-static", "orca", "patched", "patched-slo")
BASELINES = ("fcfs-static", "orca")  # PatchedServe's DistriFusion (FCFS) and NIRVANA (ORCA) stand-ins
RATES = (0.12, 0.16, 0.2, 0.24, 0.28, 0.32, 0.36, 0.4, 0.44)  # requests per second
TARGETS = (0.99, 0.95, 0.90)  # SLO satisfaction levels whose sustainable load is compared (PatchedServe §8.1)


@dataclass(frozen=True)
class GpuBatchStepCost:
    """Seconds of one step: Σ over the plan's forwards of

        per_forward_s + (1 + patch_overhead if patched over 2+ sizes) × (work^n + floor_s^n)^(1/n),
        work = Σ over its images (per_megapixel_s × MP + per_megapixel2_s × MP²),
               less cache_saving of it in patched forwards (the block cache, PatchedServe §5).

    `work` is the GPU's compute for the images (linear layers and convolutions grow with
    pixels, self-attention with their square); `floor_s` is the time a forward takes however
    little it computes (eager PyTorch launches every kernel from the CPU). The soft maximum
    of the two (sharpness n) makes a step grow sub-linearly with the batch's pixels until the
    GPU saturates, then linearly: a small image alone wastes most of the device, so batching
    pays, and one forward over all sizes (patched) pays more than one per size (grouped).
    It is also a `StepTimePredictor`, for `patched-slo`.
    """

    per_forward_s: float  # per forward, not overlapped with the GPU: sampler, CFG combine, glue
    floor_s: float  # the launch-bound floor of one forward
    per_megapixel_s: float  # GPU seconds per megapixel (linear terms)
    per_megapixel2_s: float  # GPU seconds per megapixel squared, per image (self-attention)
    sharpness: float = 3.0  # n of the soft maximum; large n = hard roofline
    patch_overhead: float = 0.05  # extra time of a patched forward: halo gathers, per-image GroupNorm
    cache_saving: float = 0.0  # share of a patched forward's work the block cache skips

    def __call__(self, batch: Batch, states: dict[str, RequestState]) -> float:
        return self.forward([states[rid].resolution for rid in batch.request_ids], batch.patched)

    def step_time(self, resolutions: Sequence[tuple[int, int]], patched: bool, degree: int = 1) -> float:
        """The same cost: one forward if patched, else one per distinct resolution; one device."""
        if degree != 1:
            return math.inf
        if patched:
            return self.forward(resolutions, True)
        by_resolution: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for res in resolutions:
            by_resolution.setdefault(tuple(res), []).append(res)
        return sum(self.forward(group, False) for group in by_resolution.values())

    def sizes(self, patched: bool) -> None:
        return None

    def forward(self, resolutions: Sequence[tuple[int, int]], patched: bool) -> float:
        work = sum(self.work(h * w / 1e6) for h, w in resolutions) * (1 - self.cache_saving if patched else 1.0)
        n = self.sharpness
        busy = (work**n + self.floor_s**n) ** (1 / n)
        cut = patched and len(set(map(tuple, resolutions))) > 1  # one size runs as a plain batch
        return self.per_forward_s + busy * (1 + self.patch_overhead if cut else 1.0)

    def work(self, megapixels: float) -> float:
        return self.per_megapixel_s * megapixels + self.per_megapixel2_s * megapixels**2


@dataclass(frozen=True)
class SdxlH100Assumptions:
    """The anchors `GpuBatchStepCost` is solved from (SDXL, CFG on, bf16, eager, one H100).

    - step_1024_s: one 1024 px step alone, ~0.10 s: PyTorch's "Diffusion, Fast" SDXL H100
      baseline with bf16 + SDPA, ~3.3 s for 30 steps, less the VAE decode.
    - ratio_1024_512: PatchedServe §8.1, "to generate one 1024x1024 image, SDXL takes 1.3x
      [the] time [of] one 512x512": a lone 512 px image leaves most of the H100 idle.
    - attention_share_1024: share of the 1024 px work that is quadratic in pixels (SDXL's
      attention sits at the 1/16 and 1/32 resolutions); assumed.
    - per_forward_s, sharpness, patch_overhead: assumed (PatchedServe: splitting overhead is
      "tiny"); the floor and the work scale are then solved so that both anchors hold.
    """

    step_1024_s: float = 0.100
    ratio_1024_512: float = 1.3
    attention_share_1024: float = 0.2
    per_forward_s: float = 0.008
    sharpness: float = 3.0
    patch_overhead: float = 0.05

    def cost(self) -> GpuBatchStepCost:
        """Bisect the floor so that 512 px alone takes step_1024_s / ratio; for each floor the
        1024 px work is the one that makes 1024 px alone take step_1024_s."""
        target_512 = self.step_1024_s / self.ratio_1024_512
        low, high = 0.0, self.step_1024_s - self.per_forward_s
        for _ in range(60):  # the 512 px step grows with the floor
            floor = (low + high) / 2
            low, high = (floor, high) if self._with(floor).forward([(512, 512)], False) < target_512 else (low, floor)
        return self._with((low + high) / 2)

    def _with(self, floor: float) -> GpuBatchStepCost:
        n, mp = self.sharpness, 1024 * 1024 / 1e6
        busy = self.step_1024_s - self.per_forward_s
        work_1024 = max(busy**n - floor**n, 0.0) ** (1 / n)
        quadratic = self.attention_share_1024 * work_1024 / mp**2
        linear = (1 - self.attention_share_1024) * work_1024 / mp
        return GpuBatchStepCost(self.per_forward_s, floor, linear, quadratic, n, self.patch_overhead)


def measured_overhead(path: str | Path) -> tuple[str, float]:
    """A `gouache bench batching` JSON's patched-forward overhead: the median of the patch
    machinery forced on / grouped - 1 over its one-resolution mixes, where both do the same
    arithmetic (the multi-resolution mixes add the batching gain the cost model computes
    itself). Results from before the engine ran one size as a plain batch have no forced
    timing; their one-forward time is the forced one. Returns the source's name (model,
    device, dtype) and the overhead."""
    data = json.loads(Path(path).read_text())
    rows = [r for r in data.get("results", []) if r.get("resolutions") == 1]
    if not rows:
        raise ValueError(f"{path} has no one-resolution mix (e.g. SSS, 4M); rerun `gouache bench batching` with one")
    method = rows[0].get("method", "patched")
    overhead = statistics.median(r.get("forced_vs_grouped") or r["patched_vs_grouped"] for r in rows) - 1
    return f"{data['model']} {method}, {data['device']}, {data['dtype']} (measured)", overhead


def measured_cache_saving(path: str | Path) -> tuple[str, float]:
    """A `gouache bench fidelity --candidate-block-cache` JSON's saving: 1 - the candidate's step
    time / the exact reference's (of the steady batch; of the engine's run in older results), with
    the fidelity it was bought at in the name."""
    data = json.loads(Path(path).read_text())
    candidate = data["candidate"]
    if not candidate.get("block_cache"):
        raise ValueError(f"{path} is not a block-cache run; "
                         "make one with `gouache bench fidelity --candidate-block-cache T`")
    name = (f"{data['model']} block cache {candidate['block_cache']:g} under {candidate['policy']}, CPU (measured: "
            f"SSIM {data['ssim_mean']:.3f}, alignment {0.0 - data['alignment_drop_points']:+.1f} points)")
    return name, 1 - data.get("steady_step_ratio", data["denoise_ratio"])


def patchedserve_experiment(out_dir: str | Path, rates: Sequence[float] = RATES, num_requests: int = 800,
                            seeds: Sequence[int] = (0, 1, 2), max_batch: int = 16,
                            cost: GpuBatchStepCost | None = None, batching_costs: Sequence[str | Path] = ()) -> dict:
    """Run the sweep, and again with each benchmark's measured cost: a `bench batching` JSON's
    patched overhead, a `bench fidelity` JSON's block-cache saving (patched forwards only); write
    patchedserve.{json,md,png} into `out_dir`; return the JSON data."""
    cost = cost or SdxlH100Assumptions().cost()
    runs = _sweep(cost, rates, num_requests, seeds, max_batch)
    points = _mean_over_seeds(runs)
    sources = [_source("assumed (PatchedServe: splitting overhead is \"tiny\")", cost, points)]
    for path in batching_costs:
        given = json.loads(Path(path).read_text())
        if given.get("kind") == "batch":
            sources.append(profiled(path, rates, num_requests, seeds, max_batch))
            continue
        if "denoise_ratio" in given:
            name, saving = measured_cache_saving(path)
            measured = replace(cost, cache_saving=saving)
        else:
            name, overhead = measured_overhead(path)
            measured = replace(cost, patch_overhead=overhead)
        sources.append(_source(name, measured, _mean_over_seeds(
            _sweep(measured, rates, num_requests, seeds, max_batch)), str(path)))
    solo = standalone_latency(cost)
    data = {
        "experiment": "PatchedServe §8: SLO satisfaction vs QPS, SDXL on one H100 (simulated)",
        "setup": {"sizes": [list(s) for s in PATCHEDSERVE_SIZES], "steps": 50, "slo_scale": 5.0,
                  "max_batch": max_batch, "num_requests": num_requests, "seeds": list(seeds)},
        "cost_model": {**cost.__dict__, "standalone_s": {f"{w}": solo(w, h, 50) for w, h in PATCHEDSERVE_SIZES},
                       "step_alone_s": {f"{w}": solo(w, h, 1) for w, h in PATCHEDSERVE_SIZES}},
        "points": points,
        "margins": margins(points),
        "capacity": capacity(points),
        "sources": sources,
        "runs": runs,
    }
    _write(Path(out_dir), data)
    return data


def profiled(path: str | Path, rates: Sequence[float], num_requests: int, seeds: Sequence[int],
             max_batch: int) -> dict:
    """The per-source row of a sweep charged by a `gouache profile` cost model of PatchedServe's
    sizes: its measured forwards, batches capped at the most images it measured in one forward
    (its SVR only interpolates)."""
    model = load(path)
    if not isinstance(model, BatchCostModel) or set(PATCHEDSERVE_SIZES) - (set(model.sizes(True)) & set(model.grouped)):
        raise ValueError(f"{path} is not a batch cost model of {', '.join(f'{w} px' for w, _ in PATCHEDSERVE_SIZES)}; "
                         f"profile them with `gouache profile --sizes 512,768,1024`")
    largest = min(max_batch, max(sum(n for *_, n in composition) for composition in model.table))
    points = _mean_over_seeds(_sweep(PredictedStepCost(model), rates, num_requests, seeds, largest, model))
    report = Path(path).with_suffix(".report.json")  # `gouache profile` names the model and device there
    about = json.loads(report.read_text()) if report.is_file() else {}
    name = (f"{about.get('model', Path(path).stem)} profiled on {about.get('device', 'its device')}, batches of "
            f"<= {largest} (measured)")
    return {**_source(name, None, points, str(path)), "max_batch": largest, "points": points}


def _sweep(cost, rates: Sequence[float], num_requests: int, seeds: Sequence[int], max_batch: int,
           predictor=None) -> list[dict]:
    """Every policy at every rate and seed, charged `cost`; patched-slo plans with `predictor`
    (default: `cost` itself)."""
    solo = standalone_latency(cost)
    runs = []
    for rate in rates:
        for seed in seeds:
            spec = WorkloadSpec(num_requests, rate, sizes=PATCHEDSERVE_SIZES, steps=50, slo_scale=5.0, seed=seed)
            trace = make_workload(spec, solo)
            for name in POLICIES:
                policy = make_policy(SchedulerConfig(policy=name, max_batch_size=max_batch), predictor or cost)
                runs.append(summary_row(simulate(trace, policy, cost), rate=rate, seed=seed))
    return runs


def _source(name: str, cost: GpuBatchStepCost | None, points: Sequence[dict], path: str | None = None) -> dict:
    """One row of the per-source table: the costs charged (None: a profiled model's, measured
    whole) and what patched-slo makes of them."""
    found, sustained = margins(points), capacity(points)
    return {"source": name, "file": path, "patch_overhead": cost and cost.patch_overhead,
            "cache_saving": cost and cost.cache_saving,
            "mean_margin_pp": found["mean_margin_pp"], "mean_margin_over_orca_pp": found["mean_margin_over_orca_pp"],
            **{f"capacity_ratio_{target}": c["patched_slo_over_best_baseline"] for target, c in sustained.items()}}


def _mean_over_seeds(runs: Sequence[dict]) -> list[dict]:
    groups: dict[tuple[str, float], list[dict]] = {}
    for run in runs:
        groups.setdefault((run["policy"], run["rate"]), []).append(run)
    keys = ("slo_attainment", "latency_p50_s", "latency_p99_s", "utilization", "dropped", "throughput_rps")
    return [{"policy": policy, "rate": rate,
             **{k: float(np.mean([r[k] for r in group if r[k] is not None])) for k in keys}}
            for (policy, rate), group in groups.items()]


def margins(points: Sequence[dict]) -> dict:
    """patched-slo's SLO satisfaction minus the best baseline's (and patched's), per rate and on average."""
    at = {(p["policy"], p["rate"]): p["slo_attainment"] for p in points}
    rates = sorted({p["rate"] for p in points})
    per_rate = []
    for rate in rates:
        best = max(BASELINES, key=lambda name: at[name, rate])
        per_rate.append({"rate": rate, "patched_slo": at["patched-slo", rate], "best_baseline": best,
                         "best_baseline_attainment": at[best, rate],
                         "margin_pp": 100 * (at["patched-slo", rate] - at[best, rate]),
                         "margin_over_orca_pp": 100 * (at["patched-slo", rate] - at["orca", rate]),
                         "margin_over_patched_pp": 100 * (at["patched-slo", rate] - at["patched", rate])})
    operating = [m for m in per_rate if m["patched_slo"] >= 0.99]
    return {
        "per_rate": per_rate,
        "mean_margin_pp": float(np.mean([m["margin_pp"] for m in per_rate])),
        "mean_margin_over_orca_pp": float(np.mean([m["margin_over_orca_pp"] for m in per_rate])),
        "mean_margin_over_patched_pp": float(np.mean([m["margin_over_patched_pp"] for m in per_rate])),
        "operating_point": operating[-1] if operating else None,  # highest rate with patched-slo >= 99 %
    }


def capacity(points: Sequence[dict]) -> dict:
    """Per policy and target: the highest swept rate at which SLO satisfaction is still >= target
    (linearly interpolated between swept rates), and patched-slo's ratio to the best baseline."""
    result = {}
    for target in TARGETS:
        rates = {name: _highest_rate(points, name, target) for name in POLICIES}
        best = max(rates[name] or 0.0 for name in BASELINES)
        ratio = rates["patched-slo"] / best if rates["patched-slo"] and best else None
        result[f"{target:.2f}"] = {"rate": rates, "patched_slo_over_best_baseline": ratio}
    return result


def _highest_rate(points: Sequence[dict], policy: str, target: float) -> float | None:
    curve = sorted((p["rate"], p["slo_attainment"]) for p in points if p["policy"] == policy)
    if not curve or curve[0][1] < target:
        return None
    for (r0, a0), (r1, a1) in zip(curve, curve[1:]):
        if a1 < target:
            return r0 + (r1 - r0) * (a0 - target) / (a0 - a1)
    return curve[-1][0]


def _write(out: Path, data: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "patchedserve.json", data)
    columns = ["policy", "rate", "slo_attainment", "dropped", "latency_p50_s", "latency_p99_s", "utilization"]
    table = markdown_table(sorted(data["points"], key=lambda p: (p["rate"], POLICIES.index(p["policy"]))), columns)
    margin_rows = [{k: m[k] for k in ("rate", "patched_slo", "best_baseline", "best_baseline_attainment", "margin_pp",
                                      "margin_over_orca_pp", "margin_over_patched_pp")}
                   for m in data["margins"]["per_rate"]]
    capacity_rows = [{"target": t, **{n: c["rate"][n] for n in POLICIES},
                      "patched-slo / best baseline": c["patched_slo_over_best_baseline"]}
                     for t, c in data["capacity"].items()]
    source_rows = [{k: v for k, v in s.items() if k not in ("file", "points")} for s in data["sources"]]
    (out / "patchedserve.md").write_text(
        f"# {data['experiment']}\n\n{table}\n## patched-slo margin\n\n{markdown_table(margin_rows, digits=2)}\n"
        f"mean margin over the best baseline: {data['margins']['mean_margin_pp']:.1f} pp; over orca: "
        f"{data['margins']['mean_margin_over_orca_pp']:.1f} pp\n\n"
        f"## highest rate (req/s) meeting each SLO-satisfaction target\n\n{markdown_table(capacity_rows)}\n"
        f"## by source of the patched overhead\n\nThe tables above charge the first row's overhead; each "
        f"other row reruns the whole sweep charging what its benchmark measured: a `bench batching` JSON's "
        f"patched overhead (the median one-forward / grouped - 1 over its one-resolution mixes), or a "
        f"`bench fidelity` JSON's block-cache saving (1 - cached / exact step time), taken off the work of "
        f"patched forwards only. capacity_ratio_T: patched-slo's highest rate meeting T over the best "
        f"baseline's.\n\n"
        f"{markdown_table(source_rows, digits=2)}")
    plot_sweep(data["points"], "rate", "slo_attainment", out / "patchedserve.png",
               title="SDXL, 1 H100 (simulated): 512/768/1024 px, SLO 5x", xlabel="QPS",
               ylabel="SLO satisfaction")
