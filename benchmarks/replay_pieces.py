"""A DiT's template replay in compiled pieces against the same edit in full (issue 59's target:
template edit at mask 0.2 / full edit <= 0.50 compiled on shapes-dit and on tiny-flux at 1024 px).

One runner compiled (`--compile-sizes` the edit's size, one row bucket: a request's rows, so
nothing pads; its warm-up compiles the row graph and the replay buckets), one eager, on the
same weights. A template is registered (every step recorded) on each; then an edit of a
centred square of `--mask` of the image replays it and the same edit runs in full, one step
of each in turn, variants interleaved. Medians after the first step. The compiled replay's
time is split by where it goes (the pieces, the attention breaks, the output piece). Prints a
table, writes JSON and markdown.

    .venv-test/bin/python benchmarks/replay_pieces.py [--model shapes-dit] [--size 256] [--mask 0.2]
        [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from gouache.config import CompileConfig, TemplateConfig
from gouache.models.zoo import load_pipeline
from gouache.request import ImageRequest
from gouache.runner import pieces as pieces_module
from gouache.runner.model_runner import ModelRunner
from gouache.sched.plan import Batch
from gouache.uploads import EditMask, Upload


def timed(spent: dict, name: str, fn):
    def run(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        spent[name].append(time.perf_counter() - start)
        return out
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="shapes-dit")
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--mask", type=float, default=0.2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--graphs", type=int, default=16, help="--compile-graphs (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32", help="the weights' dtype (default: %(default)s)")
    parser.add_argument("--profile", action="store_true",
                        help="also print the operators that took most of one timed step of each")
    parser.add_argument("--compile-cache", default=None, metavar="DIR")
    parser.add_argument("--out", default=None,
                        help="JSON path (default: benchmarks/results/replay_pieces_<model>.json)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pipe = load_pipeline(args.model, args.dtype)
    # every template in host memory (sd3-arch records 0.75 GB a step at 512 px): the default spills to disk
    templates = TemplateConfig(host_bytes=16 << 30)
    eager = ModelRunner(pipe, templates=templates)
    probe = ImageRequest("probe", "probe", args.size, args.size, 2, 4.0, seed=0)
    rows = 2 if eager.family.uses_cfg(probe) else 1
    compiled = ModelRunner(pipe, templates=templates, compile=CompileConfig(
        enabled=True, buckets=(rows,), sizes=((args.size, args.size),), graphs=args.graphs,
        cache_dir=args.compile_cache))
    pieces = compiled.family.pieces
    if pieces is None or "template" not in compiled.family.compiled.holds:
        raise SystemExit(f"{args.model}'s replays do not run in compiled pieces")
    compiled.warm_up(args.size)
    spent: dict[str, list[float]] = collections.defaultdict(list)
    for name in ("_first", "_between", "_replayed"):
        setattr(pieces, name, timed(spent, name.strip("_") + " piece", getattr(pieces, name)))
    pieces_module.Replay.attend = timed(spent, "attention breaks", pieces_module.Replay.attend)
    image = np.random.default_rng(0).integers(0, 255, (args.size, args.size, 3), dtype=np.uint8)
    mask = np.zeros((args.size, args.size), np.float32)
    half = round(args.size * args.mask ** 0.5 / 2)
    centre = args.size // 2
    mask[centre - half:centre + half, centre - half:centre + half] = 1
    variants = {"eager": eager, "compiled": compiled}
    for runner in variants.values():
        runner.prepare(ImageRequest("record", "a red circle", args.size, args.size, args.steps, 4.0, seed=1,
                                    image=b"-", template_id="t", register_template=True),
                       Upload(image, EditMask(np.zeros_like(mask))))
        for _ in range(args.steps):
            runner.execute(Batch(("record",)))
        runner.release("record")
        for rid, replay in (("template edit", True), ("full edit", False)):
            runner.prepare(ImageRequest(rid, "a blue square", args.size, args.size, args.steps, 4.0, seed=2,
                                        image=b"-", template_id="t", template_cache=replay),
                           Upload(image, EditMask(mask)))
    seconds: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    paths: dict[tuple[str, str], dict] = collections.defaultdict(dict)
    for k in range(args.steps):
        for variant, runner in variants.items():
            for rid in ("template edit", "full edit"):
                if variant == "compiled" and rid == "template edit" and k == 1:
                    spent.clear()  # the breakdown of the timed steps only
                start = time.perf_counter()
                if args.profile and k == args.steps - 1:
                    with torch.profiler.profile() as profile:
                        out = runner.execute(Batch((rid,)))
                    print(f"{variant} {rid}:\n" + profile.key_averages().table(sort_by="self_cpu_time_total",
                                                                                row_limit=15))
                else:
                    out = runner.execute(Batch((rid,)))
                assert not out.failed, out.failed
                if k and not (args.profile and k == args.steps - 1):  # not the profiled step
                    seconds[variant, rid].append(time.perf_counter() - start)
                    path = "compiled" if out.compile.compiled else "eager"
                    if out.compile.eager:
                        path = "eager: " + ", ".join(out.compile.eager)
                    paths[variant, rid][path] = paths[variant, rid].get(path, 0) + 1
    ms = {f"{variant} {rid}": 1e3 * statistics.median(s) for (variant, rid), s in seconds.items()}
    timed_steps = args.steps - 1
    breakdown = {name: 1e3 * sum(s) / timed_steps for name, s in spent.items()}
    ratios = {variant: ms[f"{variant} template edit"] / ms[f"{variant} full edit"] for variant in variants}
    lines = [f"`.venv-test/bin/python benchmarks/replay_pieces.py --model {args.model} --size {args.size} "
             f"--mask {args.mask} --graphs {args.graphs} --dtype {args.dtype}` (mask {mask.mean():.3f}; replay buckets "
             f"{pieces.buckets.describe()})", "",
             "| variant | template edit ms | full edit ms | template / full | paths |",
             "| --- | --- | --- | --- | --- |"]
    for variant in variants:
        lines.append(f"| {variant} | {ms[f'{variant} template edit']:.1f} | {ms[f'{variant} full edit']:.1f} | "
                     f"{ratios[variant]:.2f} | {dict(paths[variant, 'template edit'])} |")
    lines += ["", "| compiled replay step, ms a step | ms |", "| --- | --- |"]
    lines += [f"| {name} | {value:.2f} |" for name, value in breakdown.items()]
    print("\n".join(lines))
    out = Path(args.out or f"benchmarks/results/replay_pieces_{args.model}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "mask_ratio": float(mask.mean()), "ms": ms, "ratios": ratios,
                               "compiled_replay_ms": breakdown,
                               "paths": {f"{v} {r}": p for (v, r), p in paths.items()}}, indent=2) + "\n")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
