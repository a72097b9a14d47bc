"""`gouache bench parallel`: what running a request over worker processes costs on this machine.

For each size, one request is stepped (`profile_parallel.time_size`, medians of `--repeats`):

- in the engine's process (`uniproc`) and through one `multiproc` worker at k = 1: the
  executor's overhead (the pipe, the pickled batch and states, the latents coming back);
- on k = 2, 4, ... workers: the step, and the part of it rank 0 spends in the Ulysses
  collectives (the all-to-alls and the final all-gather, `StepOutput.collective_s`);
- moved between devices 0 and 1 every step: the hand-off, the extra time over a step that stays.

Prints a table, writes JSON and the table as Markdown (`--out`, default
benchmarks/results/parallel_<model>_cpu.json).
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path

from tqdm import tqdm

from gouache.cli_flags import parse_shape
from gouache.model_info import shown
from gouache.sim.report import markdown_table, write_json


def add_arguments(p) -> None:
    p.add_argument("--model", default="shapes-dit", help="a DiT (default: %(default)s)")
    p.add_argument("--devices", type=int, default=4, help="worker processes (default: %(default)s)")
    p.add_argument("--sizes", default="64,128,192,256",
                   help="sizes in pixels: S (a square), WxH, or a video model's clips WxHxF (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per point, median kept (default: %(default)s)")
    p.add_argument("--torch-threads", type=int, default=1,
                   help="intra-op threads of each process (default: %(default)s)")
    p.add_argument("--out", default=None, help="JSON path; the table (.md) goes beside it "
                                               "(default: benchmarks/results/parallel_<model>_cpu.json)")


def run(args) -> int:
    import torch

    from gouache.executor.multiproc import MultiprocExecutor
    from gouache.executor.pool import DevicePool
    from gouache.executor.worker import WorkerSpec
    from gouache.models.zoo import load_pipeline
    from gouache.parallel.ulysses import check_degree
    from gouache.profile.parallel import time_size
    from gouache.runner.model_runner import ModelRunner
    from gouache.sched.rounds import degrees as degrees_of
    from gouache.sched.rounds import max_degree

    if args.devices < 2:
        raise ValueError(f"--devices must be >= 2 to measure collectives and hand-offs, got {args.devices}")
    sizes = list(dict.fromkeys(parse_shape(s) for s in args.sizes.split(",")))
    degrees = list(degrees_of(max_degree(args.devices)))
    torch.set_num_threads(args.torch_threads)
    pipe = load_pipeline(args.model)
    for k in degrees:
        check_degree(pipe, k)
    runner = ModelRunner(pipe)
    local = DevicePool.in_process(runner)
    executor = MultiprocExecutor(WorkerSpec(args.model, torch_threads=args.torch_threads), args.devices)
    rows = []
    try:
        pool = DevicePool(runner, executor)
        with tqdm(total=len(sizes) * (len(degrees) + 3), desc="timing", unit="row") as bar:
            for res in sizes:
                alone, _, _ = time_size(local, res, [1], args.repeats, bar)
                steps, collectives, moved = time_size(pool, res, degrees, args.repeats, bar)
                row = {"size": shown(res), "uniproc_k1_ms": 1e3 * alone[1], "multiproc_k1_ms": 1e3 * steps[1],
                       "multiproc_over_uniproc": steps[1] / alone[1]}
                for k in degrees[1:]:
                    row[f"k{k}_step_ms"] = 1e3 * steps[k]
                    row[f"k{k}_collectives_ms"] = 1e3 * collectives[k]
                row["handoff_ms"] = 1e3 * (moved - steps[1])
                rows.append(row)
    finally:
        executor.shutdown()
    out = Path(args.out or f"benchmarks/results/parallel_{args.model}_cpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    command = "gouache bench parallel " + " ".join(sys.argv[3:])
    machine = f"{platform.machine()} CPU, {torch.get_num_threads()} torch thread(s) per process"
    write_json(out, {"command": command, "model": args.model, "devices": args.devices, "machine": machine,
                     "repeats": args.repeats, "rows": rows})
    table = markdown_table(rows, digits=2)
    out.with_suffix(".md").write_text(
        f"# Running over worker processes: {args.model}, {args.devices} workers ({machine})\n\n"
        f"`{command}`; medians of {args.repeats} steps. *_collectives_ms: rank 0's time in the Ulysses "
        "all-to-alls and all-gather within the step; handoff_ms: a step that moves the request between "
        "devices 0 and 1 minus one that does not.\n\n" + table)
    print(table)
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0
