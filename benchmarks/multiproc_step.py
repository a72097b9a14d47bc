"""Step time of the `multiproc` executor against the in-process one (`uniproc`), same batch.

A batch of `--batch` requests of one size denoises `--steps` steps through the engine's device
pool, once on a worker process and once in this process; each step is timed from the pool's
submit to its result (a worker's step includes sending the plan and receiving the reply). The
ratio multiproc / uniproc is what the process boundary costs. Prints a table, writes JSON.

    .venv/bin/python benchmarks/multiproc_step.py [--model tiny-flux] [--size 512] [--batch 8] [--steps 12]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from gouache.executor.multiproc import MultiprocExecutor
from gouache.executor.pool import DevicePool
from gouache.executor.worker import WorkerSpec
from gouache.models.zoo import load_pipeline
from gouache.request import ImageRequest
from gouache.runner.model_runner import ModelRunner
from gouache.sched.plan import Batch


def step_times(pool: DevicePool, runner: ModelRunner, args) -> list[float]:
    ids = []
    for i in range(args.batch):
        request = ImageRequest(f"r{i}", "a red circle", args.size, args.size, args.steps, 4.0, seed=i)
        runner.prepare(request)
        ids.append(request.request_id)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        output = pool.submit(Batch(tuple(ids))).result()
        times.append(time.perf_counter() - start)
        assert not output.failed, output.failed
    for rid in ids:
        pool.release(rid)
    return times[1:]  # the first step warms the worker up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-flux")
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each side")
    parser.add_argument("--out", default="benchmarks/results/multiproc_step/after.json")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    runner = ModelRunner(load_pipeline(args.model))
    results = {"uniproc": step_times(DevicePool.in_process(runner), runner, args)}
    executor = MultiprocExecutor(WorkerSpec(args.model, torch_threads=args.threads), 1)
    try:
        results["multiproc"] = step_times(DevicePool(runner, executor), runner, args)
    finally:
        executor.shutdown()
    medians = {name: statistics.median(times) for name, times in results.items()}
    print(f"| executor | median step (s) | min | max | x uniproc |  ({args.model}, {args.size} px, batch {args.batch})")
    print("| --- | --- | --- | --- | --- |")
    for name, times in results.items():
        print(f"| {name} | {medians[name]:.4f} | {min(times):.4f} | {max(times):.4f} | "
              f"{medians[name] / medians['uniproc']:.3f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "step_s": results, "median_s": medians}, indent=2) + "\n")


if __name__ == "__main__":
    main()
