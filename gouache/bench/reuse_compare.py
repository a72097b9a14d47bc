"""`gouache bench reuse-compare DIR`: the reuse predictor against the fixed threshold at equal
SSIM, from the `gouache bench fidelity` runs `benchmarks/reuse_predictor.sh` leaves in DIR
(`<model>_<units>_<threshold|predictor>_<value>.json`).

For each model, units (whole images, or patches / tokens) and target SSIM, each decider's run
that reuses the most unit-blocks among those whose mean SSIM against the exact images reaches
the target: measured points, no interpolation. Writes DIR/compare.json and .md.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

TARGETS = (0.95, 0.98)
NAME = re.compile(r"(?P<model>.+)_(?P<units>image|part)_(?P<decider>threshold|predictor)_(?P<value>[0-9.]+)\.json")


def add_arguments(p) -> None:
    p.add_argument("dir", help="the fidelity runs of benchmarks/reuse_predictor.sh")


def load(directory: Path) -> dict[tuple[str, str], dict[str, list[dict]]]:
    """(model, units) -> decider -> runs, each {value, ssim, reused, step_ratio, decide_share, file}."""
    setups: dict[tuple[str, str], dict[str, list[dict]]] = {}
    for path in sorted(directory.glob("*.json")):
        match = NAME.fullmatch(path.name)
        if not match:
            continue
        report = json.loads(path.read_text())
        candidate = report["candidate"]
        setups.setdefault((match["model"], match["units"]), {}).setdefault(match["decider"], []).append({
            "value": float(match["value"]), "ssim": report["ssim_mean"], "reused": candidate["reused_fraction"],
            "step_ratio": report["steady_step_ratio"], "decide_share": candidate.get("decide_share", 0.0),
            "file": path.name,
        })
    if not setups:
        raise ValueError(f"{directory}: no fidelity runs named <model>_<image|part>_<threshold|predictor>_<value>.json")
    return setups


def best_at(runs: list[dict], target: float) -> dict | None:
    """The run reusing the most among those at or above the target SSIM."""
    passing = [r for r in runs if r["ssim"] >= target]
    return max(passing, key=lambda r: r["reused"]) if passing else None


def compare(setups: dict) -> list[dict]:
    rows = []
    for (model, units), deciders in sorted(setups.items()):
        for target in TARGETS:
            row = {"model": model, "units": units, "ssim_target": target}
            for decider in ("threshold", "predictor"):
                row[decider] = best_at(deciders.get(decider, []), target)
            both = row["threshold"] and row["predictor"]
            row["reused_gain_points"] = (100 * (row["predictor"]["reused"] - row["threshold"]["reused"])
                                         if both else None)
            row["decide_share_max"] = max((r["decide_share"] for r in deciders.get("predictor", [])), default=None)
            rows.append(row)
    return rows


def _cell(run: dict | None) -> str:
    if run is None:
        return "none reaches it"
    ratio = "-" if run["step_ratio"] is None else f"{run['step_ratio']:.2f}"
    return f"{run['value']:g}: {100 * run['reused']:.0f} % reused, step {ratio}, SSIM {run['ssim']:.3f}"


def table(rows: list[dict]) -> str:
    lines = ["| model | units | SSIM >= | threshold (value: reuse, step ratio, SSIM) | predictor (cut-off value: ...) "
             "| reuse gain (points) | predictor's decisions / step time |", "|" + " --- |" * 7]
    for r in rows:
        gain = "-" if r["reused_gain_points"] is None else f"{r['reused_gain_points']:+.0f}"
        share = "-" if r["decide_share_max"] is None else f"{100 * r['decide_share_max']:.2f} %"
        units = "image" if r["units"] == "image" else ("patch" if "unet" in r["model"] else "token")
        lines.append(f"| {r['model']} | {units} | {r['ssim_target']} | {_cell(r['threshold'])} "
                     f"| {_cell(r['predictor'])} | {gain} | {share} |")
    return "\n".join(lines)


def run(args) -> int:
    directory = Path(args.dir)
    rows = compare(load(directory))
    text = table(rows)
    print(text)
    (directory / "compare.json").write_text(json.dumps(rows, indent=1) + "\n")
    (directory / "compare.md").write_text(f"`gouache bench reuse-compare {args.dir}`\n\n{text}\n")
    print(f"wrote {directory / 'compare.json'}, {directory / 'compare.md'}", file=sys.stderr)
    return 0
