"""A trial of `torch.compile` on the denoiser's plain forward, before the compiled layer exists.

For each model and batch size: the eager forward and the compiled one (inductor, and inductor
with `freezing`, which folds the weights into the graph as constants), median milliseconds
over repeats after the compile, the first call's seconds (the compile: cold, each trial in an
empty inductor cache), and the largest difference from eager. Then whether a compiled forward
sees a weight changed in place after it was compiled, as merging a LoRA adapter does, and
whether that recompiles. Prints a table, writes JSON. Each mode compiles in a process of its own
(inductor's settings are global).

    .venv/bin/python benchmarks/compile_trial.py [--models shapes-unet,shapes-dit] [--size 128]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("inductor", "inductor+freezing")


def trial(model: str, size: int, mode: str, repeats: int) -> dict:
    import torch
    import torch._dynamo

    from gouache.models.zoo import load_pipeline
    from gouache.request import ImageRequest
    from gouache.runner.model_runner import ModelRunner

    torch._inductor.config.freezing = mode == "inductor+freezing"
    runner = ModelRunner(load_pipeline(model))
    family, denoiser = runner.family, runner.family.denoiser
    compiled = torch.compile(denoiser.forward)
    rows = {}

    def median_ms(fn) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    with torch.no_grad():
        for batch in (1, 8):
            for i in range(batch):
                runner.prepare(ImageRequest(f"{batch}-{i}", "a red circle", size, size, 20, 4.0, seed=i))
            states = [runner.states[f"{batch}-{i}"] for i in range(batch)]
            eager = family.forward(states)
            eager_ms = median_ms(lambda: family.forward(states))
            denoiser.forward = compiled
            start = time.perf_counter()
            out = family.forward(states)
            compile_s = time.perf_counter() - start
            compiled_ms = median_ms(lambda: family.forward(states))
            del denoiser.forward
            rows[batch] = {"eager_ms": eager_ms, "compiled_ms": compiled_ms, "ratio": compiled_ms / eager_ms,
                           "compile_s": compile_s, "max_diff": (out - eager).abs().max().item()}
        states = [runner.states["1-0"]]
        weight = [p for p in denoiser.parameters() if p.dim() > 1][-1]  # the output projection's
        before = family.forward(states)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        weight.add_(0.05)  # in place, as merging an adapter does
        denoiser.forward = compiled
        out = family.forward(states)
        del denoiser.forward
        eager = family.forward(states)
        changed = {"eager_moved": (eager - before).abs().max().item(), "max_diff": (out - eager).abs().max().item(),
                   "new_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs}
    return {"batches": rows, "weight_changed_in_place": changed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="shapes-unet,shapes-dit")
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/compile_trial_cpu.json")
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)  # a child's trial
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    if args.one:
        print(json.dumps(trial(args.one[0], args.size, args.one[1], args.repeats)))
        return
    results = {}
    print("| model | mode | batch | eager ms | compiled ms | compiled / eager | compile s | "
          f"max diff |  ({args.size} px)")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for model in args.models.split(","):
        for mode in MODES:
            with tempfile.TemporaryDirectory() as cache:  # a cold compile: no earlier run's kernels
                child = subprocess.run([sys.executable, __file__, "--one", model, mode, "--size", str(args.size),
                                        "--repeats", str(args.repeats), "--threads", str(args.threads)],
                                       capture_output=True, text=True, check=True,
                                       env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache})
            result = results.setdefault(model, {})[mode] = json.loads(child.stdout.strip().splitlines()[-1])
            for batch, row in result["batches"].items():
                print(f"| {model} | {mode} | {batch} | {row['eager_ms']:.1f} | {row['compiled_ms']:.1f} | "
                      f"{row['ratio']:.2f} | {row['compile_s']:.1f} | {row['max_diff']:.1e} |")
    print("\n| model | mode | eager moved by the change | compiled vs eager after it | graphs compiled for it |")
    print("| --- | --- | --- | --- | --- |")
    for model, modes in results.items():
        for mode, result in modes.items():
            changed = result["weight_changed_in_place"]
            print(f"| {model} | {mode} | {changed['eager_moved']:.1e} | {changed['max_diff']:.1e} | "
                  f"{changed['new_graphs']} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "one"},
                                          "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
