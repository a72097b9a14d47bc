"""A step on two devices under --compile (issue 59), eager and compiled, against the same batch
on one of them: a UNet's CFG halves (each rank's half of the rows) or a DiT's Ulysses shards
(each rank's shard of every row's tokens, in the family's compiled pieces).

Two workers per variant (`--compile` with the size and the row buckets of both ways warmed up
before they serve, or eager), one thread each; a batch of `--batch` requests of one size with
guidance (two rows each) denoises `--steps` steps at degree 2 (both devices: the halves) and
as many at degree 1 (device 0: every row), interleaved step by step, each timed from the
pool's submit to its result. The ratio degree 2 / degree 1 is what the split saves; the
compiled column keeps it where the split step runs compiled. Medians after a first step of
each. Prints a table, writes JSON.

    .venv-test/bin/python benchmarks/parallel_compile.py [--model shapes-unet] [--size 128] [--batch 2] [--steps 12]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from gouache.config import CompileConfig
from gouache.executor.multiproc import MultiprocExecutor
from gouache.executor.pool import DevicePool
from gouache.executor.worker import WorkerSpec
from gouache.models.zoo import load_pipeline
from gouache.request import ImageRequest
from gouache.runner.model_runner import ModelRunner
from gouache.sched.plan import Batch


def variant(args, compile: CompileConfig | None) -> tuple[dict[str, list[float]], dict[str, dict]]:
    """Step seconds by degree, and the compile paths of the degree-2 steps, on two workers."""
    runner = ModelRunner(load_pipeline(args.model))
    executor = MultiprocExecutor(WorkerSpec(args.model, torch_threads=1, compile=compile), 2)
    pool = DevicePool(runner, executor)
    times: dict[str, list[float]] = {"degree 1": [], "degree 2": []}
    paths: dict[str, dict] = {"degree 1": {}, "degree 2": {}}
    try:
        batches = {}
        for degree, devices in (("degree 1", (0,)), ("degree 2", (0, 1))):
            ids = []
            for i in range(args.batch):
                request = ImageRequest(f"{degree[-1]}-{i}", "a red circle", args.size, args.size, args.steps, 4.0,
                                       seed=i)
                runner.prepare(request)
                ids.append(request.request_id)
            batches[degree] = Batch(tuple(ids), devices, len(devices))
        for k in range(args.steps):
            for degree, batch in batches.items():
                start = time.perf_counter()
                output = pool.submit(batch).result()
                seconds = time.perf_counter() - start
                assert not output.failed, output.failed
                if k:  # the first step of each warms its workers up
                    times[degree].append(seconds)
                    path = "compiled" if output.compile.compiled else "eager"
                    if output.compile.eager:
                        path = "eager: " + ", ".join(output.compile.eager)
                    paths[degree][path] = paths[degree].get(path, 0) + 1
        for batch in batches.values():
            for rid in batch.request_ids:
                pool.release(rid)
    finally:
        executor.shutdown()
    return times, paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="shapes-unet")
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--compile-cache", default=None, metavar="DIR")
    parser.add_argument("--out", default=None, help="(default: benchmarks/results/parallel_compile_MODEL_cpu.json)")
    args = parser.parse_args()
    args.out = args.out or f"benchmarks/results/parallel_compile_{args.model}_cpu.json"
    rows = 2 * args.batch
    compile = CompileConfig(enabled=True, buckets=tuple(sorted({rows // 2, rows})), sizes=((args.size, args.size),),
                            cache_dir=args.compile_cache)
    results = {name: variant(args, config) for name, config in (("eager", None), ("compiled", compile))}
    medians = {name: {degree: statistics.median(t) for degree, t in times.items()}
               for name, (times, _) in results.items()}
    print(f"| variant | degree 1 ms | degree 2 ms | degree 2 / degree 1 | paths |  "
          f"({args.model}, {args.size} px, {args.batch} requests)")
    print("| --- | --- | --- | --- | --- |")
    for name, (_, paths) in results.items():
        m = medians[name]
        print(f"| {name} | {1e3 * m['degree 1']:.1f} | {1e3 * m['degree 2']:.1f} | "
              f"{m['degree 2'] / m['degree 1']:.2f} | {paths} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "args": vars(args), "step_s": {name: times for name, (times, _) in results.items()},
        "median_s": medians, "paths": {name: paths for name, (_, paths) in results.items()}}, indent=2) + "\n")
    Path(args.out).with_suffix(".md").write_text(
        f"`.venv-test/bin/python benchmarks/parallel_compile.py --model {args.model} --size {args.size} "
        f"--batch {args.batch} --steps {args.steps}`\n\n"
        + "\n".join(f"- {name}: degree 1 {1e3 * m['degree 1']:.1f} ms, degree 2 {1e3 * m['degree 2']:.1f} ms, "
                    f"ratio {m['degree 2'] / m['degree 1']:.2f}; paths {results[name][1]}"
                    for name, m in medians.items()) + "\n")


if __name__ == "__main__":
    main()
