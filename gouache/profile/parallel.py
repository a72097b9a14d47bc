"""`gouache profile --devices N`: T(resolution, k) and the hand-off, measured through the engine's
own multiproc executor, for round-knapsack over N devices.

For each size, one request is prepared in the driver and stepped through `DevicePool` on the
block (0..k-1) for each k in 1, 2, 4, ... <= N: a step to move it there and one to warm up,
then `--repeats` timed steps, median kept. The time is a whole `submit` until its result (the
pipe, the workers' collectives, the latents coming back), which is what the engine loop waits
for. The hand-off is the extra time of a step that first moves the request from device 0 to
device 1, over a step that does not (median of `--repeats` moves), fitted over the sizes as a
fixed time plus a time per megapixel. Writes a `ParallelCostModel` JSON (kind "parallel") with
a "handoff" entry, which `gouache serve --cost-model` and `gouache simulate --cost-model` read.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from gouache.cli_flags import parse_shape
from gouache.files import write_atomic
from gouache.model_info import shown
from gouache.sched.interface import Resolution


def run(args) -> int:
    from gouache.executor.multiproc import MultiprocExecutor
    from gouache.executor.pool import DevicePool
    from gouache.executor.worker import WorkerSpec
    from gouache.models.zoo import load_pipeline
    from gouache.parallel.ulysses import check_degree
    from gouache.runner.model_runner import ModelRunner
    from gouache.sched.parallel_costmodel import ParallelCostModel
    from gouache.sched.rounds import degrees as degrees_of
    from gouache.sched.rounds import max_degree

    sizes = list(dict.fromkeys(parse_shape(s) for s in args.sizes.split(",")))
    degrees = list(degrees_of(max_degree(args.devices)))
    spec = WorkerSpec(args.model, args.dtype, args.device, args.patch_size, args.torch_threads)
    pipe = load_pipeline(args.model, args.dtype, "cpu")
    for k in degrees:
        check_degree(pipe, k)
    executor = MultiprocExecutor(spec, args.devices)
    try:
        pool = DevicePool(ModelRunner(pipe), executor)
        table, moves = {}, {}
        with tqdm(total=len(sizes) * (len(degrees) + 1), desc="timing degrees and hand-offs", unit="row") as bar:
            for res in sizes:
                table[res], _, moves[res] = time_size(pool, res, degrees, args.repeats, bar)
    finally:
        executor.shutdown()
    pixels = np.array([math.prod(res) / 1e6 for res in sizes])  # a clip's every frame: what it hands off
    extra = np.array([moves[res] - table[res][1] for res in sizes])
    per_megapixel, fixed = np.polyfit(pixels, extra, 1) if len(sizes) > 1 else (0.0, float(extra[0]))
    source = f"gouache profile --devices {args.devices} on {args.device} ({args.model})"
    model = ParallelCostModel(table, source=source)
    data = {**model.to_json(),
            "handoff": {"fixed_s": max(float(fixed), 0.0), "per_megapixel_s": max(float(per_megapixel), 0.0),
                        "measured_s": {shown(res): moves[res] - table[res][1] for res in sizes},
                        "source": source}}
    out = Path(args.out or f"benchmarks/results/parallel_{args.model}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, json.dumps({**data, "command": "gouache profile " + " ".join(sys.argv[2:])}, indent=1) + "\n")
    for res, row in table.items():
        print(f"{shown(res)}: " + ", ".join(f"k={k} {s * 1e3:.1f} ms" for k, s in row.items())
              + f"; hand-off +{(moves[res] - row[1]) * 1e3:.1f} ms")
    print(f"wrote {out}")
    return 0


def time_size(pool, res: Resolution, degrees: list[int], repeats: int,
              bar) -> tuple[dict[int, float], dict[int, float], float]:
    """One request of `res` ((h, w), or a clip's (h, w, frames)) stepped on block (0..k-1) for
    each k, then moved between devices 0 and 1 each step: the median seconds of a step at each
    k, the median of its seconds in Ulysses collectives (rank 0's), and the median seconds of a
    step that moves it."""
    from gouache.request import ImageRequest
    from gouache.sched.plan import Batch

    steps = (len(degrees) + 1) * (repeats + 2) * 2 + 2
    height, width, *frames = res
    request = ImageRequest(f"profile-{shown(res)}", "a red fox", width, height, steps, 5.0, seed=0,
                           num_frames=frames[0] if frames else 1)
    pool.runner.prepare(request)
    rid = request.request_id

    collective = []

    def step(devices: tuple[int, ...]) -> float:
        start = time.perf_counter()
        output = pool.submit(Batch((rid,), devices)).result()
        if output.failed:
            raise RuntimeError(f"profiling step failed: {output.failed}")
        collective.append(output.collective_s)
        return time.perf_counter() - start

    row, collectives = {}, {}
    for k in degrees:
        block = tuple(range(k))
        step(block)  # move there
        step(block)  # warm up
        collective.clear()
        row[k] = statistics.median(step(block) for _ in range(repeats))
        collectives[k] = statistics.median(collective)
        bar.update()
    moved = []
    for i in range(repeats):  # alternate devices 0 and 1 (device 0 only when there is one)
        moved.append(step((i % 2,) if len(degrees) > 1 else (0,)))
    bar.update()
    pool.release(rid)
    return row, collectives, statistics.median(moved)
