"""A fleet day in simulation: 1,000 one-device replicas serving 24 hours of diurnal mixed traffic,
per router x policy, and the devices that day needs at p95 <= 2x the unloaded latency.

The fleet. `devices` one-device replicas (FLUX.1-dev on an H100 each, max batch 8, the engine's
queue limit of 16 in flight, flex refused past half) in `cells` cells. A global balancer
splits arrivals among cells evenly at random; within a cell a load-aware router
(least-requests or mask-aware) picks the replica. Traffic: `diurnal.fleet_day_trace`, sized
by `mean_rps_per_device` at `devices`; the rate is the day's, whatever the fleet size tried.
Steps cost `fleet_cost.FleetStepCost` (masks, LoRAs, ControlNets).

What is simulated, and why it fits the time: every request of a sampled cell goes through the
step-level simulator (the live `Scheduler` and policy of each replica, the router at each
arrival); nothing is computed by formula. Three approximations make a day fit in minutes on
two cores; `exp_fleet_day_error` measures each (docs/scheduling.md, "A fleet day"):

1. Cells are independent and alike (a random split of a Poisson stream is independent Poisson
   streams of the same shape), so `cells_simulated` of them are simulated, each with its own
   trace, and counts are scaled by cells / cells_simulated. Latency quantiles are those of
   the simulated cells' requests.
2. The day is compressed: each hour lasts 3600 / `compress` s at that hour's rate, so a cell
   sees 1 / compress of its day's requests, with the diurnal shape kept; counts are scaled by
   `compress`. It holds while the rate changes slowly against the time queues take to settle
   (seconds to a minute here, against 75 s per compressed hour).
3. Coarse steps (`coarse.CoarseSteps`): a step policy's plan runs up to `coarse_steps` steps.

Unloaded latency: each request's steps at its step cost alone (what an idle replica gives it,
`FleetStepCost.alone_s`). Latency quantiles count a lost request (refused at the queue limit
or dropped as unattainable) as infinitely late, so a fleet that loses more than 5 % has no
finite p95. The device count: the fewest replicas per cell (x cells) whose day p95 is at most
`target` x the unloaded p95 (`Bracket`), for each pair of `search`: each round simulates one
size per pair still searching (as many as there are workers for a lone pair) on the same cell
trace, until the bracket is `resolution` replicas per cell wide.

`fleet_day_experiment(out_dir)` writes fleet_day.json, fleet_day.md and fleet_day.png.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from gouache.config import SchedulerConfig
from gouache.request import TIERS
from gouache.sched.policies import make_policy
from gouache.sched.router import LeastRequestsRouter, MaskAwareRouter, Router
from gouache.sim.coarse import CoarseSteps
from gouache.sim.diurnal import DAY_S, DayMix, Diurnal, FleetTrace, fleet_day_trace
from gouache.sim.exp_instgenie import COST_MODELS
from gouache.sim.fleet_cost import FleetStepCost
from gouache.sim.report import write_json
from gouache.sim.results import SimResult
from gouache.sim.simulator import Admission, simulate

ROUTERS = ("least-requests", "mask-aware")
POLICIES = ("orca", "patched-slo")
QUANTILES = (50, 95, 99)


@dataclass(frozen=True)
class FleetDaySetup:
    """One fleet day; the defaults are the committed run's."""

    devices: int = 1000  # one-device replicas the day's rate is sized for, and the first fleet simulated
    cells: int = 8  # the global balancer's cells; each has devices / cells replicas and its own router
    mean_rps_per_device: float = 0.15  # the day's mean rate / `devices`
    amplitude: float = 0.6  # diurnal swing: peak mean·(1+a), trough mean·(1-a)
    peak_hour: float = 20.0
    compress: float = 48.0  # an hour lasts 3600 / compress simulated seconds
    cells_simulated: int = 1  # cells simulated per (router, policy, size); counts scaled by cells / this
    coarse_steps: int = 4  # a step policy's plan runs up to this many steps (`coarse.CoarseSteps`); 1: exact
    max_batch: int = 8
    max_in_flight: int = 16  # per replica (the engine's queue limit, as exp_tiers)
    routers: tuple[str, ...] = ROUTERS
    policies: tuple[str, ...] = POLICIES
    search: tuple[tuple[str, str], ...] = (("least-requests", "orca"), ("mask-aware", "patched-slo"))  # sized by search
    target: float = 2.0  # p95 / unloaded p95 the device count is sized for
    resolution: int = 3  # replicas per cell the search narrows to
    mix: DayMix = field(default_factory=DayMix)
    seed: int = 0
    workers: int = 2  # processes: cells and fleet sizes run side by side

    def __post_init__(self) -> None:
        if self.devices < 1 or self.cells < 1 or self.devices % self.cells:
            raise ValueError(f"devices ({self.devices}) must split evenly into cells ({self.cells})")
        if not 1 <= self.cells_simulated <= self.cells:
            raise ValueError(f"cells_simulated must be 1 to cells ({self.cells}), got {self.cells_simulated}")
        if self.mean_rps_per_device <= 0 or self.compress < 1 or self.target <= 1 or self.resolution < 1:
            raise ValueError("mean_rps_per_device must be positive, compress >= 1, target > 1, resolution >= 1")
        unknown = {r for r, _ in self.search} - set(self.routers) | {p for _, p in self.search} - set(self.policies)
        if unknown:
            raise ValueError(f"search names {unknown}, which are not among the routers and policies run")

    @property
    def replicas(self) -> int:
        """Replicas per cell at `devices`."""
        return self.devices // self.cells

    @property
    def scale(self) -> float:
        """Requests of the fleet's day per simulated request."""
        return self.compress * self.cells / self.cells_simulated

    def day(self) -> Diurnal:
        """One cell's rate over its (compressed) day."""
        return Diurnal(self.devices * self.mean_rps_per_device / self.cells, self.amplitude, self.peak_hour,
                       DAY_S / self.compress)


PLAIN = FleetStepCost(COST_MODELS["3-term"].cost())  # no masks or adapters: what SLOs and the predictor price


def cell_trace(setup: FleetDaySetup, cell: int) -> FleetTrace:
    """Cell `cell`'s requests: its own seeded draw of the day."""
    return fleet_day_trace(setup.day(), setup.mix, PLAIN.standalone, seed=setup.seed * 1000 + cell, prefix=f"c{cell}r")


def make_router(name: str, cost: FleetStepCost) -> Router:
    if name == "mask-aware":
        return MaskAwareRouter(cost.batch_step_time)
    if name == "least-requests":
        return LeastRequestsRouter()
    raise ValueError(f"unknown router {name!r}; choose from {', '.join(ROUTERS)}")


@dataclass
class CellRun:
    """One cell's day under one router, policy and replica count: per request, trace order."""

    latency: np.ndarray  # [n] seconds, arrival -> last step; inf if refused or dropped
    alone: np.ndarray  # [n] seconds the request takes on an idle replica
    hour: np.ndarray  # [n] hour of the day it arrived in, 0..23
    tier: np.ndarray  # [n] its tier's rank (TIERS)
    met_slo: np.ndarray  # [n] 1 met, 0 missed (late, refused, dropped), -1 no SLO
    refused: int
    dropped: int
    busy_device_s: float  # simulated device-seconds busy
    wall_s: float  # seconds the simulation took


def run_cell(setup: FleetDaySetup, router: str, policy: str, replicas: int, cell: int = 0,
             trace: FleetTrace | None = None) -> CellRun:
    """Simulate one cell: `replicas` replicas behind `router`, each running `policy`."""
    start = time.perf_counter()
    trace = trace or cell_trace(setup, cell)
    cost = FleetStepCost.for_trace(trace)
    config = SchedulerConfig(policy=policy, max_batch_size=setup.max_batch)
    policies = [CoarseSteps(make_policy(config, PLAIN), setup.coarse_steps) for _ in range(replicas)]
    result = simulate(trace.requests, policies, cost, make_router(router, cost) if replicas > 1 else None,
                      admission=Admission(setup.max_in_flight))
    return _cell_run(result, cost, trace.day.day_s / 24, time.perf_counter() - start)


def _cell_run(result: SimResult, cost: FleetStepCost, hour_s: float, wall_s: float) -> CellRun:
    records = result.records
    latency = np.array([np.inf if r.finish is None else r.latency for r in records])
    alone = np.array([r.request.steps * cost.alone_s(r.request.request_id, (r.request.height, r.request.width))
                      for r in records])
    met = np.array([-1 if r.met_slo is None else int(r.met_slo) for r in records])
    unfinished = [r for r in records if r.finish is None and r.refused_at is None and r.dropped_at is None]
    if unfinished:
        raise RuntimeError(f"{len(unfinished)} requests were left unfinished: the simulation stopped early")
    return CellRun(
        latency=latency, alone=alone, met_slo=met,
        hour=np.minimum((np.array([r.request.arrival for r in records]) // hour_s).astype(int), 23),
        tier=np.array([TIERS.index(r.request.tier) for r in records]),
        refused=sum(r.refused_at is not None for r in records), dropped=sum(r.dropped_at is not None for r in records),
        busy_device_s=result.busy_device_s, wall_s=wall_s)


def _job(job: tuple) -> CellRun:
    return run_cell(*job)


def merge(runs: Sequence[CellRun]) -> CellRun:
    """The simulated cells' requests as one sample."""
    return CellRun(*(np.concatenate([getattr(r, k) for r in runs]) for k in ("latency", "alone", "hour", "tier",
                                                                              "met_slo")),
                   refused=sum(r.refused for r in runs), dropped=sum(r.dropped for r in runs),
                   busy_device_s=sum(r.busy_device_s for r in runs), wall_s=sum(r.wall_s for r in runs))


def quantile(values: np.ndarray, q: float) -> float:
    """The sample at the q-th percentile (no interpolation, so a lost request's inf shows only
    where lost requests reach the quantile)."""
    return float(np.percentile(values, q, method="inverted_cdf")) if values.size else float("nan")


def summarize(run: CellRun, setup: FleetDaySetup, devices: int) -> dict:
    """The day's numbers for the fleet of `devices`, from its simulated cells."""
    unloaded = quantile(run.alone, 95)
    slo = run.met_slo[run.met_slo >= 0]
    done = np.isfinite(run.latency)
    finished = int(done.sum())
    device_hours = devices * 24.0
    images = finished * setup.scale
    hourly = [quantile(run.latency[run.hour == h], 95) / unloaded for h in range(24)]
    return {
        "devices": devices,
        "requests_per_day": run.latency.size * setup.scale,
        **{f"latency_p{q}_s": quantile(run.latency, q) for q in QUANTILES},
        "unloaded_p95_s": unloaded,
        "mean_slowdown": float(np.mean(run.latency[done] / run.alone[done])) if done.any() else None,
        "p95_over_unloaded": quantile(run.latency, 95) / unloaded,
        "worst_hour_p95_over_unloaded": float(np.nanmax(hourly)),
        "priority_p95_s": quantile(run.latency[run.tier == 0], 95),
        "slo_attainment": float(slo.mean()) if slo.size else None,
        "lost_share": 1 - finished / run.latency.size,
        "refused": run.refused, "dropped": run.dropped,
        "device_hours": device_hours,
        "busy_device_hours": run.busy_device_s * setup.scale / 3600,
        "images_per_day": images,
        "images_per_device_hour": images / device_hours,
        "hourly_p95_over_unloaded": hourly,
        "simulated_requests": int(run.latency.size),
        "simulated_s": run.wall_s,
    }


@dataclass
class Bracket:
    """The search for the fewest replicas per cell whose ratio (day p95 / unloaded p95) is at
    most `target`: bracketed from what is known, widening by 25 % steps, then narrowed by the
    sizes `next` asks for, until the bracket is `resolution` wide; the answer is its top."""

    target: float
    resolution: int
    known: dict[int, float]  # replicas per cell -> ratio

    def next(self, probes: int) -> list[int]:
        """Up to `probes` sizes to try next, spread over the bracket; [] once it is found."""
        top, bottom = self._bracket()
        if top is None:
            most = max(self.known)
            sizes = [max(most + k, math.ceil(most * (1 + 0.25 * k))) for k in range(1, probes + 1)]
        elif bottom is None:
            sizes = [max(1, min(top - k, math.floor(top * (1 - 0.25 * k)))) for k in range(1, probes + 1)]
        elif top - bottom <= self.resolution:
            sizes = []
        else:
            sizes = [bottom + round((top - bottom) * k / (probes + 1)) for k in range(1, probes + 1)]
        return sorted({n for n in sizes if n not in self.known})

    @property
    def answer(self) -> int | None:
        return self._bracket()[0]

    def _bracket(self) -> tuple[int | None, int | None]:
        top = min((n for n, ratio in self.known.items() if ratio <= self.target), default=None)
        bottom = max((n for n, ratio in self.known.items() if ratio > self.target and (top is None or n < top)),
                     default=None)
        return top, bottom


def search_devices(evaluate: Callable[[list[int]], dict[int, float]], known: dict[int, float], target: float,
                   resolution: int, probes: int = 2) -> int | None:
    """`Bracket`'s answer, evaluating `probes` sizes at a time (replicas -> ratio)."""
    bracket = Bracket(target, resolution, dict(known))
    while sizes := bracket.next(probes):
        bracket.known.update(evaluate(sizes))
    return bracket.answer


def fleet_day_experiment(out_dir: str | Path, setup: FleetDaySetup | None = None) -> dict:
    """Simulate the day per router x policy at `setup.devices`, search the devices it needs for
    each pair of `setup.search` (the searches take turns at the workers); write fleet_day.json,
    .md and .png to `out_dir`; return the JSON."""
    setup = setup or FleetDaySetup()
    start = time.perf_counter()
    with ProcessPoolExecutor(setup.workers) if setup.workers > 1 else nullcontext() as pool:
        def simulate_fleets(fleets: list[tuple[str, str, int]]) -> list[dict]:
            jobs = [(setup, r, p, n, c) for r, p, n in fleets for c in range(setup.cells_simulated)]
            runs = list((pool.map if pool else map)(_job, jobs))
            print(f"fleet-day: {', '.join(f'{r} x {p} on {n * setup.cells}' for r, p, n in fleets)} "
                  f"({time.perf_counter() - start:.0f} s)", file=sys.stderr)
            k = setup.cells_simulated
            return [{"router": r, "policy": p, **summarize(merge(runs[i * k:(i + 1) * k]), setup, n * setup.cells)}
                    for i, (r, p, n) in enumerate(fleets)]

        rows = simulate_fleets([(r, p, setup.replicas) for r in setup.routers for p in setup.policies])
        tried = {pair: {setup.replicas: next(row for row in rows if (row["router"], row["policy"]) == pair)}
                 for pair in setup.search}
        brackets = {pair: Bracket(setup.target, setup.resolution, {n: row["p95_over_unloaded"] for n, row in
                                                                   tried[pair].items()}) for pair in setup.search}
        while True:
            active = [pair for pair in setup.search if brackets[pair].next(1)]
            if not active:
                break
            share = max(1, setup.workers // len(active))
            fleets = [(*pair, n) for pair in active for n in brackets[pair].next(share)]
            for row in simulate_fleets(fleets):
                pair, n = (row["router"], row["policy"]), row["devices"] // setup.cells
                tried[pair][n] = row
                brackets[pair].known[n] = row["p95_over_unloaded"]
    searches = [{"router": r, "policy": p, "replicas_per_cell": brackets[r, p].answer,
                 "devices": None if brackets[r, p].answer is None else brackets[r, p].answer * setup.cells,
                 "tried": [{"replicas_per_cell": n, **tried[r, p][n]} for n in sorted(tried[r, p])]}
                for r, p in setup.search]
    data = {"setup": asdict(setup), "cost": _cost_summary(), "rows": rows, "searches": searches,
            "wall_s": time.perf_counter() - start}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "fleet_day.json", data)
    (out / "fleet_day.md").write_text(report(data))
    plot(data, out / "fleet_day.png")
    return data


def _cost_summary() -> dict:
    from gouache.sim.fleet_cost import CONTROLNET_STEP_RATIO, LORA_STEP_RATIO, share_factor

    base = PLAIN.base
    return {"per_forward_s": base.per_forward_s, "per_request_s": base.per_request_s, "flops_per_s": base.flops_per_s,
            "lora_step_ratio": LORA_STEP_RATIO, "controlnet_step_ratio": CONTROLNET_STEP_RATIO,
            "lora_share_factor": share_factor(base, LORA_STEP_RATIO),
            "controlnet_share_factor": share_factor(base, CONTROLNET_STEP_RATIO),
            "standalone_s": {str(s): PLAIN.standalone(s, s, 28) for s in (512, 768, 1024)}}


_COLUMNS = ("router", "policy", "devices", "latency_p50_s", "latency_p95_s", "latency_p99_s", "p95_over_unloaded",
            "worst_hour_p95_over_unloaded", "priority_p95_s", "slo_attainment", "lost_share", "device_hours",
            "busy_device_hours", "images_per_device_hour")
_HEADS = ("router", "policy", "devices", "p50 s", "p95 s", "p99 s", "p95 / unloaded", "worst hour", "priority p95 s",
          "SLO attainment", "lost", "device-hours", "busy device-hours", "images / device-hour")


def report(data: dict) -> str:
    setup, rows = data["setup"], data["rows"]
    first = rows[0]
    head = (f"{setup['devices']} one-device replicas in {setup['cells']} cells, {first['requests_per_day']:,.0f} "
            f"requests in the day (mean {setup['mean_rps_per_device']:g} req/s a device, x{1 + setup['amplitude']:g} "
            f"at {setup['peak_hour']:g}:00); simulated: {setup['cells_simulated']} cell(s), hours compressed "
            f"{setup['compress']:g}x ({first['simulated_requests']:,} requests a run). Unloaded p95 "
            f"{first['unloaded_p95_s']:.2f} s.\n\n")
    lines = ["| " + " | ".join(_HEADS) + " |", "|" + "---|" * len(_HEADS)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row[c]) for c in _COLUMNS) + " |")
    tail = []
    for search in data["searches"]:
        tried = ", ".join(f"{t['devices']}: {_cell(t['p95_over_unloaded'])}" for t in search["tried"])
        tail.append(f"\n{search['router']} x {search['policy']}: the day needs **{search['devices']} devices** "
                    f"for p95 <= {setup['target']:g}x unloaded (p95 / unloaded by devices tried: {tried}).\n")
    return head + "\n".join(lines) + "\n" + "".join(tail) + f"\nWall time {data['wall_s']:.0f} s.\n"


def _cell(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        if not np.isfinite(value):
            return "lost"
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"
    return str(value)


def plot(data: dict, path: str | Path, cap: float = 4.0) -> None:
    """Left: each hour's p95 / unloaded p95 per router x policy, over the arrival rate. Right: the
    day's p95 / unloaded p95 against fleet size for the searched pairs, with the target. Ratios
    above `cap` (a fleet that lost over 5 % has none) are drawn at it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    setup = data["setup"]
    fig = Figure(figsize=(11, 4), layout="constrained")
    FigureCanvasAgg(fig)
    hours, (left, right) = np.arange(24), fig.subplots(1, 2)
    rate = left.twinx()
    day = Diurnal(setup["mean_rps_per_device"] * setup["devices"], setup["amplitude"], setup["peak_hour"])
    rate.bar(hours + 0.5, day.rate((hours + 0.5) * 3600.0), width=1.0, color="grey", alpha=0.15)
    rate.set_ylabel("fleet arrivals, requests/s (bars)")
    left.set_zorder(rate.get_zorder() + 1)
    left.patch.set_visible(False)
    for row in data["rows"]:
        left.plot(hours + 0.5, np.minimum(row["hourly_p95_over_unloaded"], cap), marker=".",
                  label=f"{row['router']} x {row['policy']}")
    left.set_xlabel("hour of the day")
    left.set_ylabel("hour's p95 / day's unloaded p95")
    left.set_title(f"{setup['devices']} devices, by hour of arrival")
    left.set_xlim(0, 24)
    left.grid(alpha=0.3)
    left.legend(fontsize=7, loc="upper left")
    for search in data["searches"]:
        tried = search["tried"]
        right.plot([t["devices"] for t in tried], [min(t["p95_over_unloaded"], cap) for t in tried], marker="o",
                   label=f"{search['router']} x {search['policy']}: {search['devices']} needed")
    right.axhline(setup["target"], color="black", linestyle="--", linewidth=1, label=f"{setup['target']:g}x unloaded")
    right.set_ylim(0.9, cap + 0.1)
    right.set_xlabel("devices")
    right.set_ylabel(f"day's p95 / unloaded p95 (at most {cap:g})")
    right.set_title("devices the day needs")
    right.grid(alpha=0.3)
    right.legend(fontsize=7)
    fig.savefig(path, dpi=120)
