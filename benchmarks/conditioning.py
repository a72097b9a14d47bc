"""Preparation time of a repeated prompt with the conditioning cache off and on, same run.

For each model, one request's preparation (text encoding, noise, sampler set-up) is timed
`--repeats` times for the same prompt at new seeds, after one preparation that fills the cache;
medians, and the ratio on / off. Prints a table, writes JSON.

    .venv/bin/python benchmarks/conditioning.py [--models shapes-unet,shapes-dit,tiny-sdxl]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

from gouache.models.zoo import load_pipeline
from gouache.request import ImageRequest
from gouache.runner.model_runner import ModelRunner

PROMPT = "a red circle at the top left and a blue square in the center on a white background"


def prepare_s(pipe, budget: int, repeats: int) -> list[float]:
    runner = ModelRunner(pipe, conditioning_bytes=budget)
    request = ImageRequest("warm", PROMPT, 128, 128, 20, 4.0, seed=0)
    runner.prepare(request)
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        runner.prepare(replace(request, request_id=f"r{i}", seed=i + 1))
        times.append(time.perf_counter() - start)
        runner.states.clear()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="shapes-unet,shapes-dit,tiny-sdxl")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default="benchmarks/results/conditioning_cpu.json")
    args = parser.parse_args()
    rows = {}
    print("| model | prepare off (ms) | prepare on (ms) | on / off |")
    print("| --- | --- | --- | --- |")
    for name in args.models.split(","):
        pipe = load_pipeline(name)
        off, on = (statistics.median(prepare_s(pipe, budget, args.repeats)) for budget in (0, 64 << 20))
        rows[name] = {"off_s": off, "on_s": on, "ratio": on / off}
        print(f"| {name} | {off * 1e3:.2f} | {on * 1e3:.2f} | {on / off:.2f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "models": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
