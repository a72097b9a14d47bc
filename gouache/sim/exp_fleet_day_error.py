"""How far the fleet day's approximations move its numbers, measured by simulating more.

Each check runs the approximation and a fuller simulation of the same setup (the fleet's,
`FleetDaySetup()`, unless it says otherwise) and reports the approximation's relative error:

- compressed hours, small cell: one cell of `small_replicas` replicas through a real 24-hour
  day, against 48 compressed days of it pooled (as many requests in all). A small cell's
  queues settle more slowly than a large one's, so compression moves it at least as much;
- compressed hours, the fleet's cell: hours `fleet.compress / reference_compress` times
  longer (each draw of the compressed day pooled to match its size);
- coarse steps: `coarse_steps` = 1 (every step planned) against the fleet's k, on the fleet's
  cell, for each pair the fleet sizes;

and two spreads that are not errors against a reference:

- the sampled cell: the fleet's cells one by one; their spread is what one simulated cell can
  be off by;
- the router's reach: the same per-device load on cells of half, one and two times the fleet's
  cell (what a router that saw more of the fleet would gain).

`fleet_day_error_experiment(out_dir)` writes fleet_day_error.json and fleet_day_error.md.
"""

from __future__ import annotations

import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from gouache.sim.exp_fleet_day import FleetDaySetup, _job, merge, summarize
from gouache.sim.report import markdown_table, write_json

_KEYS = ("mean_slowdown", "latency_p50_s", "latency_p95_s", "latency_p99_s", "p95_over_unloaded", "slo_attainment")


@dataclass(frozen=True)
class ErrorSetup:
    fleet: FleetDaySetup = field(default_factory=FleetDaySetup)
    router: str = "least-requests"  # of the compression and spread checks
    policy: str = "orca"
    small_replicas: int = 16  # the cell the real day is simulated on
    reference_compress: float = 8.0  # the fleet's cell's fuller day
    cells: int = 4  # fleet cells simulated one by one for the spread
    reach: tuple[float, ...] = (0.5, 1.0, 2.0)  # cell sizes, in fleet cells


Job = tuple  # (FleetDaySetup, router, policy, replicas, cell): `exp_fleet_day.run_cell`'s arguments


def plan(setup: ErrorSetup) -> tuple[dict[str, tuple[list[Job], list[Job]]], dict[str, list[Job]]]:
    """The checks, name -> (approximation's jobs, reference's jobs), and the spreads, name -> jobs."""
    fleet, pair = setup.fleet, (setup.router, setup.policy)
    small = replace(fleet, devices=setup.small_replicas, cells=1)  # a cell of its own, at the fleet's rate a device
    draws = round(fleet.compress)
    fuller = replace(fleet, compress=setup.reference_compress)
    pooled = round(fleet.compress / setup.reference_compress)
    checks = {
        f"hours {fleet.compress:g}x shorter vs a real day, {setup.small_replicas} replicas": (
            [(small, *pair, small.devices, c) for c in range(draws)],
            [(replace(small, compress=1.0), *pair, small.devices, 0)]),
        f"hours {fleet.compress:g}x vs {setup.reference_compress:g}x shorter, {fleet.replicas} replicas": (
            [(fleet, *pair, fleet.replicas, c) for c in range(pooled)], [(fuller, *pair, fleet.replicas, 0)]),
    }
    for router, policy in fleet.search:
        checks[f"{fleet.coarse_steps} steps a plan vs 1, {router} x {policy}"] = (
            [(fleet, router, policy, fleet.replicas, 0)],
            [(replace(fleet, coarse_steps=1), router, policy, fleet.replicas, 0)])
    spreads = {f"cell {c}": [(fleet, *pair, fleet.replicas, c)] for c in range(setup.cells)}
    for reach in setup.reach:
        replicas = round(fleet.replicas * reach)
        spreads[f"reach {replicas} replicas"] = [(replace(fleet, devices=replicas * fleet.cells), *pair, replicas, 0)]
    return checks, spreads


def fleet_day_error_experiment(out_dir: str | Path, setup: ErrorSetup | None = None) -> dict:
    setup = setup or ErrorSetup()
    start = time.perf_counter()
    checks, spreads = plan(setup)
    groups = [jobs for approx, reference in checks.values() for jobs in (approx, reference)] + list(spreads.values())
    flat = [job for jobs in groups for job in jobs]
    # the longest first, so that neither worker is left with a long one at the end
    order = sorted(range(len(flat)), key=lambda i: -_weight(flat[i]))
    if setup.fleet.workers > 1:
        with ProcessPoolExecutor(setup.fleet.workers) as pool:
            done = dict(zip(order, pool.map(_job, [flat[i] for i in order])))
    else:
        done = {i: _job(flat[i]) for i in order}
    runs, i = [], 0
    for jobs in groups:
        runs.append(merge([done[i + j] for j in range(len(jobs))]))
        i += len(jobs)
    summaries = iter([summarize(run, jobs[0][0], jobs[0][3] * jobs[0][0].cells) for run, jobs in zip(runs, groups)])
    rows = []
    for name in checks:
        approx, reference = next(summaries), next(summaries)
        rows.append({"check": name, "simulated_requests": f"{approx['simulated_requests']} / "
                                                          f"{reference['simulated_requests']}",
                     **{key: _relative(approx[key], reference[key]) for key in _KEYS},
                     "reference_p95_over_unloaded": reference["p95_over_unloaded"]})
    spread_rows = [{"run": name, **{key: summary[key] for key in ("simulated_requests", *_KEYS)}}
                   for name, summary in zip(spreads, summaries)]
    data = {"setup": asdict(setup), "errors": rows, "spreads": spread_rows, "wall_s": time.perf_counter() - start}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "fleet_day_error.json", data)
    (out / "fleet_day_error.md").write_text(report(data))
    return data


def _weight(job: Job) -> float:
    """Roughly how long a job runs: its requests, times 4 when every step is planned."""
    setup, _, _, replicas, _ = job
    return replicas / setup.replicas * setup.devices / setup.compress * (4 if setup.coarse_steps == 1 else 1)


def _relative(approx: float | None, exact: float | None) -> float | None:
    return None if approx is None or not exact else approx / exact - 1


def report(data: dict) -> str:
    setup = data["setup"]
    errors = [{k: (f"{100 * v:+.1f} %" if isinstance(v, float) and k in _KEYS else v) for k, v in row.items()}
              for row in data["errors"]]
    return (f"Relative error of each approximation against its fuller simulation (approximation / reference - 1); "
            f"{setup['router']} x {setup['policy']} unless named.\n\n{markdown_table(errors)}\n"
            f"Spreads (not errors against a reference):\n\n{markdown_table(data['spreads'])}\n"
            f"Wall time {data['wall_s']:.0f} s.\n")
