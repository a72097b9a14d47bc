"""Simulation results as JSON-ready dicts, markdown tables and sweep plots.

A sweep is a list of flat rows, one per (policy, swept value) run: `summary_row(result,
rate=0.5)` gives `{"policy": ..., "rate": 0.5, <metrics>}`. The same rows feed
`markdown_table` and `plot_sweep`, and `write_json` stores them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from gouache.sim.results import SimResult


def summary_row(result: SimResult, **params) -> dict:
    """One flat row: the policy, the parameters of this run, then every metric."""
    return {"policy": result.policy, **params, **asdict(result.metrics())}


def result_to_dict(result: SimResult, per_request: bool = True) -> dict:
    """The run's metrics and, if asked, each request's times (None where it never got there)."""
    data = {"policy": result.policy, "metrics": asdict(result.metrics())}
    if per_request:
        data["requests"] = [
            {**asdict(r.request), "first_step": r.first_step, "finish": r.finish,
             "dropped_at": r.dropped_at, "refused_at": r.refused_at, "pauses": r.pauses, "met_slo": r.met_slo,
             "replica": r.replica}
            for r in result.records
        ]
    return data


def write_json(path: str | Path, data) -> None:
    """`data` as JSON at `path`, its folder made if missing (a long run must not end unwritten)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


def markdown_table(rows: Sequence[dict], columns: Sequence[str] | None = None, digits: int = 3) -> str:
    """A GitHub markdown table of `rows` (all their keys unless `columns` picks some)."""
    if not rows:
        return ""
    columns = list(columns or rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(c), digits) for c in columns) + " |")
    return "\n".join(lines) + "\n"


def _cell(value, digits: int) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def plot_sweep(rows: Sequence[dict], x: str, y: str, path: str | Path, by: str = "policy",
               title: str | None = None, xlabel: str | None = None, ylabel: str | None = None) -> None:
    """A PNG line plot of metric `y` against swept parameter `x`, one line per value of `by`.

    Drawn on an Agg canvas directly, so no global matplotlib backend is set or needed.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.5, 3.8), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for name in dict.fromkeys(row[by] for row in rows):  # first-seen order
        points = sorted((row[x], row[y]) for row in rows if row[by] == name and row[y] is not None)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=str(name))
    ax.set_xlabel(xlabel or x)
    ax.set_ylabel(ylabel or y)
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=120)
