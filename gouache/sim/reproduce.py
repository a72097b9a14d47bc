"""`gouache reproduce`: the three papers' headline experiments, side by side, in one run, the
service tiers' experiment (issue 38) and video's round planner on measured costs (issue 61); on
request (`--only`, minutes each), a fleet day of 1,000 devices and the check of its
approximations.

Each writes JSON, a markdown table and PNG plots under `--out/<name>/`. They run on the
simulator with documented cost models (see docs/costmodels.md), not on GPUs.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path


def _patchedserve(out: Path, args) -> dict:
    from gouache.sim.exp_patchedserve import patchedserve_experiment

    return patchedserve_experiment(out, batching_costs=args.batching_costs or ())


def _tetriserve(out: Path, args) -> dict:
    from gouache.sim.exp_tetriserve import tetriserve_experiment

    return tetriserve_experiment(out)


def _instgenie(out: Path, args) -> dict:
    from gouache.sim.exp_instgenie import instgenie_experiment

    return instgenie_experiment(out)


def _tiers(out: Path, args) -> dict:
    from gouache.sim.exp_tiers import tiers_experiment

    return tiers_experiment(out)


def _video(out: Path, args) -> dict:
    from gouache.sim.exp_video import video_experiment

    return video_experiment(out)


def _fleet_day(out: Path, args) -> dict:
    from gouache.sim.exp_fleet_day import fleet_day_experiment

    return fleet_day_experiment(out)


def _fleet_day_error(out: Path, args) -> dict:
    from gouache.sim.exp_fleet_day_error import fleet_day_error_experiment

    return fleet_day_error_experiment(out)


EXPERIMENTS: dict[str, Callable[[Path, object], dict]] = {
    "patchedserve": _patchedserve,  # SLO satisfaction vs QPS: fcfs-static, orca, patched, patched-slo
    "tetriserve": _tetriserve,  # SLO attainment vs SLO scale on 8 devices: fixed-sp-1/2/4/8, round-knapsack
    "instgenie": _instgenie,  # P95 latency vs rate over 8 replicas: least-requests, least-tokens, mask-aware
    "tiers": _tiers,  # service tiers at 2x load on 64 devices: with tiers, tier-blind, priority alone
    "video": _video,  # a clip mix on 64 devices, measured costs: SLO attainment of fixed-sp-k, round-knapsack
    "fleet-day": _fleet_day,  # 1,000 devices, a diurnal day of mixed traffic, router x policy; devices needed
    "fleet-day-error": _fleet_day_error,  # the fleet day's approximations against fuller simulations
}
LONG = ("fleet-day", "fleet-day-error")  # minutes each: run only when --only names them


def add_arguments(p) -> None:
    p.add_argument("--only", default=",".join(n for n in EXPERIMENTS if n not in LONG),
                   help=f"comma-separated subset of the experiments, from {', '.join(EXPERIMENTS)} "
                        f"(default: %(default)s; {' and '.join(LONG)} take minutes each)")
    p.add_argument("--out", default="benchmarks/results/reproduce",
                   help="output folder; each experiment writes under OUT/<name>/ (default: %(default)s)")
    p.add_argument("--batching-costs", nargs="+", default=None, metavar="JSON",
                   help="measured costs the PatchedServe experiment also charges, a table row each: `gouache bench "
                        "batching` results (the patched overhead) and `gouache bench fidelity --candidate-block-cache` "
                        "results (the block cache's saving, in patched forwards), or a `gouache profile` cost model of "
                        "512/768/1024 px (every forward as measured) (default: the assumed overhead only)")


def run(args) -> int:
    names = args.only.split(",")
    unknown = [n for n in names if n not in EXPERIMENTS]
    if unknown:
        raise ValueError(f"unknown experiment(s) {', '.join(unknown)}; choose from {', '.join(EXPERIMENTS)}")
    if args.batching_costs and "patchedserve" not in names:
        raise ValueError("--batching-costs would be ignored: only the patchedserve experiment reads it")
    for name in names:
        out = Path(args.out) / name
        out.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        EXPERIMENTS[name](out, args)
        print(f"{name}: wrote {out} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
        table = next(out.glob("*.md"), None)
        if table is not None:
            print(f"\n## {name}\n\n{table.read_text()}")
    return 0
