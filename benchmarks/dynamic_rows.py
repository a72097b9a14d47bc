"""Compiled forwards of static rows padded to buckets against one graph of dynamic rows (issue 59).

`gouache.runner.compiled` used to compile a static graph per row bucket (1, 2, 4, ... rows), each
forward padded up to its bucket; it now compiles one graph whose row dimension is dynamic (a
one-row forward keeps a static graph) and runs every row count unpadded. This times both on
one model's denoiser at one size, each in its own process (dynamo keeps a function's graphs
for every wrapper of it, so one process would mix them), the two alternated `--rounds` times:

- the warm-up: compile seconds and graphs for the buckets (`--buckets`);
- a forward of each of `--rows` (with CFG, two rows a request), the median of `--repeats`.

Prints a table, writes JSON (`--out`).

    .venv-test/bin/python benchmarks/dynamic_rows.py [--model shapes-unet --size 128] [--out ...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = ("static", "dynamic")


def measure(model: str, size: int, buckets: tuple[int, ...], rows: list[int], repeats: int, static: bool) -> dict:
    """One variant in this process: its warm-up and each row count's median forward (ms)."""
    import torch
    import torch._dynamo.utils

    from gouache.config import CompileConfig
    from gouache.models.zoo import load_pipeline
    from gouache.request import ImageRequest
    from gouache.runner.compiled import CompiledDenoiser, _resize
    from gouache.runner.model_runner import ModelRunner

    runner = ModelRunner(load_pipeline(model))
    state = runner.family.prepare(ImageRequest("probe", "a red circle", size, size, 2, 5.0, seed=0))
    example, shared = runner.family.forward_inputs([state])
    compiled = CompiledDenoiser(runner.family.denoiser, CompileConfig(enabled=True, buckets=buckets),
                                runner.family.device)
    compiled.dynamic_rows = not static
    start = time.perf_counter()
    compiled.warm_up(compiled.row_graphs([(example, shared)]), progress=lambda line: None)
    warm_s = time.perf_counter() - start
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    out = {"warm_up_s": warm_s, "graphs": graphs, "ms": {}}
    with torch.no_grad():
        for n in rows:
            inputs = _resize(example, n)
            times = []
            for _ in range(repeats + 1):  # the first: a row count's first call
                with compiled.step(None):
                    began = time.perf_counter()
                    compiled(inputs, shared)
                    times.append(time.perf_counter() - began)
            out["ms"][n] = statistics.median(times[1:]) * 1000
    out["recompiles"] = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="shapes-unet")
    p.add_argument("--size", type=int, default=128)
    p.add_argument("--buckets", default="2,4,8,16,32")
    p.add_argument("--rows", default="2,4,6,8,12,16,24,32")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2, help="times each variant runs, alternated")
    p.add_argument("--out", default="benchmarks/results/dynamic_rows_cpu.json")
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # one variant's process
    args = p.parse_args()
    buckets = tuple(int(b) for b in args.buckets.split(","))
    rows = [int(r) for r in args.rows.split(",")]
    if args.variant:
        print(json.dumps(measure(args.model, args.size, buckets, rows, args.repeats, args.variant == "static")))
        return
    runs = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):
        for variant in VARIANTS:
            with tempfile.TemporaryDirectory(prefix="gouache-dynamic-rows-") as cache:  # every warm-up cold
                done = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--variant", variant], check=True,
                                      capture_output=True, text=True,
                                      env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache})
            runs[variant].append(json.loads(done.stdout.strip().splitlines()[-1]))
    table = {v: {"warm_up_s": statistics.median(r["warm_up_s"] for r in rs),
                 "graphs": [r["graphs"] for r in rs], "recompiles": [r["recompiles"] for r in rs],
                 "ms": {n: statistics.median(r["ms"][str(n)] for r in rs) for n in rows}} for v, rs in runs.items()}
    print(f"{args.model} at {args.size} px, buckets {args.buckets}, {args.rounds} rounds (medians)")
    print("| variant | warm-up s | graphs | " + " | ".join(f"{n} rows ms" for n in rows) + " |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in rows) + " |")
    for v, t in table.items():
        print(f"| {v} | {t['warm_up_s']:.0f} | {t['graphs'][0]} | " + " | ".join(f"{t['ms'][n]:.1f}" for n in rows)
              + " |")
    ratio = {n: table["dynamic"]["ms"][n] / table["static"]["ms"][n] for n in rows}
    print("| dynamic / static | {:.2f} | | ".format(table["dynamic"]["warm_up_s"] / table["static"]["warm_up_s"])
          + " | ".join(f"{ratio[n]:.2f}" for n in rows) + " |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"model": args.model, "size": args.size, "buckets": buckets, "rows": rows,
                                          "repeats": args.repeats, "runs": runs, "medians": table,
                                          "dynamic_over_static": ratio, "machine": platform.processor()
                                          or platform.machine()}, indent=2) + "\n")


if __name__ == "__main__":
    main()
