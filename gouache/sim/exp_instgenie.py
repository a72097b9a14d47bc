"""Experiment: InstGenIE §6.5 (Fig. 16-right), P95 latency of masked edits on 8 replicas by router.

Poisson arrivals of 1024 px FLUX.1-dev edits (28 steps, diffusers' default) whose mask ratios
have InstGenIE's means (0.11 in their traces, 0.19 in the public one), drawn two ways
(`MASKS`): a mild Beta(2, b) (`workloads.mask_beta`), and a heavy tail where a share of the
edits repaint the whole image and the rest are small (`workloads.mixed_masks`). Eight
replicas, one H100 each, each running continuous batching (`orca`, max batch 8, InstGenIE §6.2's setting
for FLUX; §6.5 runs every router inside InstGenIE's scheduler) behind one of four routers:
round-robin (the paper's request-granularity baseline read literally: it "uniformly assigns
requests to workers", Fig. 4-right), least-requests (request granularity with feedback: the
fewest requests in flight), least-tokens (masked-token granularity) and mask-aware (Algorithm 2,
predicting with the same cost model the simulator charges). Why the routers' gaps come out as
they do: docs/routing.md.

Rates are fractions (`LOADS`) of the replicas' saturation throughput (full batches of
mean-mask edits, `capacity_rps`), so that each sweep straddles its own saturation point.

The step cost (`MaskStepCost`) is derived from published figures, in two variants that the
figures cannot tell apart (`FluxEditAssumptions`, `COST_MODELS`): "2-term", every fixed cost
shared by the forward; "3-term", part of it paid per request, fitted to InstGenIE's batching
gain. The first lets masks decide most of a batch's cost, the second much less of it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

import numpy as np

from gouache.config import SchedulerConfig
from gouache.request import RequestState
from gouache.sched.costmodel import MaskCostModel
from gouache.sched.parallel_costmodel import ParallelCostModel
from gouache.sched.plan import Batch
from gouache.sched.policies import make_policy
from gouache.sched.router import (
    LeastRequestsRouter,
    LeastTokensRouter,
    MaskAwareRouter,
    RoundRobinRouter,
    Router,
    RouteRequest,
)
from gouache.sim.report import markdown_table, plot_sweep, summary_row, write_json
from gouache.sim.simulator import simulate
from gouache.sim.workloads import MASK_MEANS, SimRequest, WorkloadSpec, make_workload, mixed_masks, with_masks

ROUTERS = ("round-robin", "least-requests", "least-tokens", "mask-aware")
LOADS = (0.5, 0.7, 0.8, 0.9, 0.95)  # arrival rate / saturation throughput (`capacity_rps`)
SIZE = (1024, 1024)
STEPS = 28
# mask distributions: "beta", or "full-X", a share X of whole-image edits and small ones
# (`edit_trace`); "heavy" is full-X with X the mean mask's `HEAVY_SHARE`
MASKS = ("beta", "heavy")
HEAVY_SHARE = {0.11: 0.05, 0.19: 0.10}  # mean mask ratio -> its heavy tail's share of whole images


@dataclass(frozen=True)
class MaskStepCost:
    """Seconds of one step of masked edits: Σ over the plan's forwards of

        per_forward_s + Σ over its requests (per_request_s + FLOPs(L, m) / flops_per_s),

    FLOPs(L, m) being `MaskCostModel.flops` (InstGenIE Table 1: only the m·L masked tokens
    go through the projections and the feed-forward, and attend to all L keys), so compute is
    proportional to the mask ratio. Loading the unmasked tokens' cached activations is taken
    as hidden by the bubble-free pipeline (InstGenIE §4.2); what it does not hide is in the fixed terms,
    which are fitted to measured speedups (`FluxEditAssumptions`).

    A request's mask ratio is not in its `RequestState`: the cost holds `mask_ratio`, request
    id -> ratio, made from the trace by `for_trace` (absent ids are generations, m = 1).
    `batch_step_time` is the same cost over the router's `RouteRequest`s, for `MaskAwareRouter`.
    """

    per_forward_s: float  # shared by the batch: launches, weight reads, the sampler step
    per_request_s: float  # per request whatever its mask: text tokens, gathers, what loading leaves exposed
    flops_per_s: float  # achieved FLOP/s on the masked-token computation
    hidden: int = 3072  # FLUX.1-dev hidden size
    num_blocks: int = 57  # 19 double-stream + 38 single-stream blocks
    mask_ratio: Mapping[str, float] = field(default_factory=dict, repr=False)  # request id -> mask ratio
    px_per_token: int = 16  # FLUX: 8x VAE downsampling, then 2x2 patchify

    def __call__(self, batch: Batch, states: dict[str, RequestState]) -> float:
        return self.per_forward_s + sum(
            self.request_s(self.tokens(states[rid].resolution), self.mask_ratio.get(rid, 1.0))
            for rid in batch.request_ids
        )

    def batch_step_time(self, batch: Sequence[RouteRequest]) -> float:
        """One forward over `batch`, from the router's view of requests."""
        return self.per_forward_s + sum(self.request_s(r.pixels // self.px_per_token**2, r.mask_ratio) for r in batch)

    def request_s(self, tokens: int, mask_ratio: float) -> float:
        """A request's share of a step: its fixed part plus its masked tokens' compute, which
        Table 1 makes proportional to the mask ratio (so the m = 1 count is computed once)."""
        full = self._full_s.get(tokens)
        if full is None:
            flops = MaskCostModel(self.hidden, self.num_blocks).flops([(tokens, 1.0)])
            full = self._full_s[tokens] = flops / self.flops_per_s
        return self.per_request_s + mask_ratio * full

    def tokens(self, resolution: tuple[int, int]) -> int:
        return (resolution[0] // self.px_per_token) * (resolution[1] // self.px_per_token)

    def for_trace(self, requests: Sequence[SimRequest]) -> MaskStepCost:
        """This cost with the trace's mask ratios, for the simulator to charge."""
        return replace(self, mask_ratio={r.request_id: r.mask_ratio for r in requests if r.mask_ratio is not None})

    @cached_property
    def _full_s(self) -> dict[int, float]:
        return {}  # tokens -> compute seconds of an unmasked (m = 1) request; MaskCostModel's FLOPs, nothing fitted


@dataclass(frozen=True)
class FluxEditAssumptions:
    """The published anchors `MaskStepCost` is solved from (FLUX.1-dev, 1024 px, one H100).

    - full_step_s: a full 1024 px step alone, 0.243 s (`ParallelCostModel.h100_flux_default()`,
      k = 1: xDiT's eager 1-H100 FLUX time; docs/costmodels.md).
    - speedup / at_mask: InstGenIE §6.3 (Fig. 15-right), editing at mask ratio 0.2 is 1.9x
      faster than regenerating with FLUX (image level; loading overlapped).
    - batching_gain / batch: InstGenIE §1 and §4.3, mask-aware editing "magnifies the
      performance gain of batching by 1.29x with a batch size of 4" on FLUX: the throughput
      gain from batch 1 to 4 is 1.29x larger for edits than for full generations (the mask
      ratio is not given; `at_mask` is assumed). None leaves it out.

    With t(B, m) = F + B·P + B·m·C for a batch of B requests of ratio m (C = full compute):
    the first two anchors give C and F + P. Without `batching_gain`, P = 0: every fixed cost is
    per forward (the "2-term" model). With it, the third anchor splits F from P ("3-term").
    An H100 has the H800's compute, so the H800 ratios are used as they are.
    """

    full_step_s: float = field(default_factory=lambda: ParallelCostModel.h100_flux_default().seconds(1024, 1))
    speedup: float = 1.9
    at_mask: float = 0.2
    batching_gain: float | None = 1.29
    batch: int = 4
    tokens: int = 4096  # 1024 px: (1024 / 16)² latent tokens

    def cost(self) -> MaskStepCost:
        t1, m, g, b = self.full_step_s, self.at_mask, self.batching_gain, self.batch
        te = t1 / self.speedup
        compute = (t1 - te) / (1 - m)  # C: the masked-token compute of a full (m = 1) request
        fixed = t1 - compute  # F + P
        per_request = 0.0
        if g is not None:  # te·(F + bP + bC) = g·t1·(F + bP + b·m·C), the gain ratio, solved for X = F + bP
            x = b * compute * (g * t1 * m - te) / (te - g * t1)
            per_request = (x - fixed) / (b - 1)
        per_forward = fixed - per_request
        if min(compute, per_request, per_forward) < 0:
            raise ValueError(f"these anchors imply a negative cost term: C={compute}, P={per_request}, F={per_forward}")
        flops = MaskCostModel(3072, 57).flops([(self.tokens, 1.0)])
        return MaskStepCost(per_forward, per_request, flops / compute)


COST_MODELS = {"2-term": FluxEditAssumptions(batching_gain=None), "3-term": FluxEditAssumptions()}


def make_router(name: str, cost: MaskStepCost) -> Router:
    if name == "mask-aware":
        return MaskAwareRouter(cost.batch_step_time)
    return {"round-robin": RoundRobinRouter, "least-requests": LeastRequestsRouter,
            "least-tokens": LeastTokensRouter}[name]()


def edit_trace(num_requests: int, rate: float, mask_mean: float, masks: str, seed: int,
               mask_shape: float = 2.0) -> list[SimRequest]:
    """Poisson 1024 px edits at `rate` whose masks have mean `mask_mean`: "beta", Beta(mask_shape,
    b); "heavy" or "full-X", a share X of whole images and Beta for the rest. Arrivals and masks
    have their own random streams: traces that differ in masks only share their arrivals."""
    spec = WorkloadSpec(num_requests, rate, sizes=[SIZE], steps=STEPS, mask_mean=mask_mean, mask_shape=mask_shape,
                        seed=seed)
    requests = make_workload(spec)
    if masks == "heavy":
        masks = f"full-{HEAVY_SHARE[mask_mean]}"
    if masks == "beta":
        return requests
    if not masks.startswith("full-"):
        raise ValueError(f"masks must be beta, heavy or full-<share>, got {masks!r}")
    rng = np.random.default_rng([seed, 7])
    return with_masks(requests, mixed_masks(num_requests, mask_mean, float(masks[5:]), rng, mask_shape))


def capacity_rps(cost: MaskStepCost, mask_mean: float, replicas: int, max_batch: int, steps: int = STEPS) -> float:
    """Requests per second the replicas finish with full batches of mean-mask edits: saturation."""
    batch = [RouteRequest("r", SIZE[0] * SIZE[1], steps, mask_mean)] * max_batch
    return replicas * max_batch / (steps * cost.batch_step_time(batch))


def instgenie_experiment(out_dir: str | Path, loads: Sequence[float] = LOADS,
                         mask_means: Sequence[float] = (MASK_MEANS["instgenie"], MASK_MEANS["public"]),
                         cost_models: Sequence[str] = tuple(COST_MODELS), num_requests: int = 1200,
                         seeds: Sequence[int] = (0, 1, 2), replicas: int = 8, max_batch: int = 8,
                         workers: int = 2, masks: Sequence[str] = MASKS) -> dict:
    """Run the sweep (rates = `loads` x saturation, per cost model, mask mean and mask
    distribution), in `workers` processes; write instgenie.{json,md} and one PNG per (cost
    model, mask mean, masks) into `out_dir`."""
    jobs = [(model, mean, kind, load, seed, num_requests, replicas, max_batch)
            for model in cost_models for mean in mask_means for kind in masks for load in loads for seed in seeds]
    if workers > 1:
        with ProcessPoolExecutor(workers) as pool:
            runs = [row for rows in pool.map(_run_job, jobs) for row in rows]
    else:
        runs = [row for job in jobs for row in _run_job(job)]
    points = _mean_over_seeds(runs)
    costs = {name: COST_MODELS[name].cost() for name in cost_models}
    data = {
        "experiment": "InstGenIE §6.5: P95 latency vs request rate, 8 replicas, FLUX.1-dev edits (simulated)",
        "setup": {"size": list(SIZE), "steps": STEPS, "replicas": replicas, "max_batch": max_batch,
                  "policy": "orca", "num_requests": num_requests, "seeds": list(seeds),
                  "heavy_share": {f"{m}": HEAVY_SHARE.get(m) for m in mask_means}},
        "cost_models": {name: {"per_forward_s": c.per_forward_s, "per_request_s": c.per_request_s,
                               "flops_per_s": c.flops_per_s,
                               "step_alone_s": {f"{m}": c.batch_step_time([RouteRequest("x", SIZE[0] * SIZE[1], 1, m)])
                                                for m in (0.11, 0.19, 0.2, 1.0)},
                               "saturation_rps": {f"{m}": capacity_rps(c, m, replicas, max_batch) for m in mask_means}}
                        for name, c in costs.items()},
        "points": points,
        "reductions": reductions(points),
        "runs": runs,
    }
    _write(Path(out_dir), data)
    return data


def _run_job(job: tuple) -> list[dict]:
    """One trace (cost model, mask mean, masks, load, seed) through the routers."""
    model, mean, kind, load, seed, num_requests, replicas, max_batch = job
    cost = COST_MODELS[model].cost()
    rate = load * capacity_rps(cost, mean, replicas, max_batch)
    trace = edit_trace(num_requests, rate, mean, kind, seed)
    charged = cost.for_trace(trace)
    rows = []
    for name in ROUTERS:
        policies = [make_policy(SchedulerConfig(policy="orca", max_batch_size=max_batch)) for _ in range(replicas)]
        result = simulate(trace, policies, charged, router=make_router(name, cost))
        rows.append(summary_row(result, cost_model=model, router=name, mask_mean=mean, masks=kind, load=load,
                                rate=rate, seed=seed))
    return rows


_POINT = ("cost_model", "mask_mean", "masks", "load")  # what a point of the sweep is, besides its router


def _mean_over_seeds(runs: Sequence[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        groups.setdefault((*(run[k] for k in _POINT), run["router"]), []).append(run)
    keys = ("rate", "latency_p95_s", "latency_p50_s", "queueing_mean_s", "utilization")
    return [{**dict(zip(_POINT, point)), "router": router, **{k: float(np.mean([r[k] for r in g])) for k in keys}}
            for (*point, router), g in groups.items()]


def reductions(points: Sequence[dict]) -> list[dict]:
    """Per cost model, mask mean, masks and load: 1 - P95(mask-aware) / P95(other), for each other
    router (InstGenIE's "35 % increase" of a baseline's P95 is this reduction at 0.26)."""
    p95 = {(*(p[k] for k in _POINT), p["router"]): p["latency_p95_s"] for p in points}
    rows = []
    for point in dict.fromkeys(tuple(p[k] for k in _POINT) for p in points):
        ours = p95[(*point, "mask-aware")]
        rows.append({**dict(zip(_POINT, point)), "p95_mask_aware_s": ours,
                     **{f"vs {name}": 1 - ours / p95[(*point, name)] for name in ROUTERS[:-1]}})
    return rows


def _write(out: Path, data: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "instgenie.json", data)
    columns = ["cost_model", "mask_mean", "masks", "load", "rate", "router", "latency_p95_s", "latency_p50_s",
               "queueing_mean_s"]
    (out / "instgenie.md").write_text(
        f"# {data['experiment']}\n\n{markdown_table(data['points'], columns, digits=2)}\n"
        f"## P95 reduction of mask-aware (1 - ours / theirs)\n\n{markdown_table(data['reductions'])}")
    for model, mean, kind in dict.fromkeys((p["cost_model"], p["mask_mean"], p["masks"]) for p in data["points"]):
        plot_sweep([p for p in data["points"] if (p["cost_model"], p["mask_mean"], p["masks"]) == (model, mean, kind)],
                   "rate", "latency_p95_s", out / f"instgenie_{model}_mask{mean}_{kind}.png", by="router",
                   xlabel="requests/s over 8 replicas", ylabel="P95 latency (s)",
                   title=f"FLUX edits, 8 H100s (sim.): {model} cost, mask mean {mean}, {kind}")
