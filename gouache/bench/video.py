"""`gouache bench video`: the block cache on a video model's clips, per clip and per token, against
the exact clips: per-frame SSIM and PSNR, the share of block runs reused, and the step time.

One batch of clips (`--clips`, every one a request with CFG) is denoised start to end through the
engine's own step path (`ModelRunner.execute`), first exact and then with the block cache at each
`--thresholds`: under `orca` (one plain forward per clip shape: the units are whole clips) and
under `patched` (one packed forward: the units are tokens). Each clip's frames are decoded and
compared frame by frame with the exact run's (SSIM as `bench fidelity` computes it); the step
time is the median over `--repeats` runs of each setup, taken in turn. Writes JSON, a markdown
table and a contact sheet of frames (exact | the largest threshold | their difference x4).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from gouache.bench.fidelity import psnr, ssim
from gouache.bench.sheet import contact_sheet, difference
from gouache.cli_flags import parse_shape

POLICIES = {"orca": "clip", "patched": "token"}  # policy -> the block cache's unit


def add_arguments(p) -> None:
    p.add_argument("--model", default="tiny-wan", help="a video model, built-in or a directory (default: %(default)s)")
    p.add_argument("--clips", default="64x64x9,96x64x17,64x64x25",
                   help="the batch's clips, WxHxF each (default: %(default)s)")
    p.add_argument("--steps", type=int, default=20, help="denoising steps of every clip (default: %(default)s)")
    p.add_argument("--thresholds", default="0.05,0.1,0.2",
                   help="block-cache thresholds to measure (default: %(default)s)")
    p.add_argument("--max-reuse", type=int, default=2,
                   help="most steps in a row a unit reuses one block's output (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed runs of each setup, medians kept (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the first clip; the others count up (default: %(default)s)")
    p.add_argument("--out", default="benchmarks/results/video/block_cache_cpu.json",
                   help="JSON path; the table (.md) and contact sheet (.png) go beside it (default: %(default)s)")


def run(args) -> int:
    from gouache.config import BlockCacheConfig
    from gouache.models.zoo import load_pipeline
    from gouache.runner.describe import model_info
    from gouache.runner.model_runner import ModelRunner

    clips = [parse_shape(text) for text in args.clips.split(",")]
    if any(len(clip) != 3 for clip in clips):
        raise ValueError(f"--clips are WxHxF each (F frames); got {args.clips!r}")
    thresholds = [float(t) for t in args.thresholds.split(",")]
    pipe = load_pipeline(args.model)
    pipe.set_progress_bar_config(disable=True)
    info = model_info(pipe, args.model)
    if info.clips is None:
        raise ValueError(f"--model {args.model} makes images; this benchmark takes a video model")
    for height, width, frames in clips:
        why = info.clips.refusal(frames)
        if why:
            raise ValueError(f"--clips: {width}x{height}x{frames}: {why}")
    runner = ModelRunner(pipe, block_cache=BlockCacheConfig(max_reuse=args.max_reuse))
    rows, sheets = [], {}
    for policy, unit in POLICIES.items():
        exact, exact_s, _ = _denoise(runner, clips, 0.0, policy == "patched", args)
        for threshold in thresholds:
            made, seconds, reused = _denoise(runner, clips, threshold, policy == "patched", args)
            ssims = [ssim(a, b) for clip, other in zip(exact, made) for a, b in zip(clip, other)]
            psnrs = [psnr(a, b) for clip, other in zip(exact, made) for a, b in zip(clip, other)]
            rows.append({"policy": policy, "unit": unit, "threshold": threshold, "reused": reused,
                         "frame_ssim_mean": statistics.mean(ssims), "frame_ssim_min": min(ssims),
                         "frame_psnr_mean": statistics.mean(psnrs), "step_s": seconds, "exact_step_s": exact_s,
                         "step_ratio": seconds / exact_s})
            print(f"{policy} t={threshold}: reused {reused:.0%}, frame SSIM {rows[-1]['frame_ssim_mean']:.3f} "
                  f"(min {rows[-1]['frame_ssim_min']:.3f}), step x{rows[-1]['step_ratio']:.2f}", file=sys.stderr)
            sheets[policy] = (exact, made, threshold)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = "gouache bench video " + " ".join(sys.argv[3:])
    shown = ", ".join(f"{w}x{h}x{f}" for h, w, f in clips)
    out.write_text(json.dumps({"command": command.strip(), "model": args.model, "clips": shown, "steps": args.steps,
                               "max_reuse": args.max_reuse, "repeats": args.repeats, "results": rows}, indent=2) + "\n")
    table = format_table(rows)
    out.with_suffix(".md").write_text(f"`{command.strip()}`: clips {shown}, {args.steps} steps\n\n{table}\n")
    _sheet(sheets["patched"], clips, out.with_suffix(".png"))
    print(table)
    print(f"wrote {out}, {out.with_suffix('.md')}, {out.with_suffix('.png')}")
    return 0


def _denoise(runner, clips, threshold: float, patched: bool, args) -> tuple[list[np.ndarray], float, float]:
    """The clips denoised together `repeats` times: their frames [F, H, W, 3] (the last run's, the
    same every run), the median seconds per step, and the share of block runs reused."""
    from gouache.request import ImageRequest
    from gouache.sched.plan import Batch

    times, frames, reused = [], [], 0.0
    for _ in range(args.repeats):
        requests = [ImageRequest(f"clip-{i}", "a red fox running through the snow", w, h, args.steps, 5.0,
                                 seed=args.seed + i, num_frames=f, block_cache=threshold)
                    for i, (h, w, f) in enumerate(clips)]
        for request in requests:
            runner.prepare(request)
        ids = tuple(r.request_id for r in requests)
        before = (runner.cache.reused, runner.cache.computed)
        start = time.perf_counter()
        for _ in range(args.steps):
            runner.execute(Batch(ids, patched=patched))
        times.append((time.perf_counter() - start) / args.steps)
        states = [runner.states[rid] for rid in ids]
        frames = runner.family.decode_many(states, [s.latents for s in states])
        done = runner.cache.reused - before[0], runner.cache.computed - before[1]
        reused = done[0] / max(sum(done), 1)
        for rid in ids:
            runner.release(rid)
    return frames, statistics.median(times), reused


def format_table(rows: list[dict]) -> str:
    lines = ["| policy (unit) | threshold | reused | frame SSIM mean | frame SSIM min | frame PSNR mean | step ms "
             "| exact step ms | step ratio |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['policy']} ({r['unit']}) | {r['threshold']:g} | {r['reused']:.0%} | "
                     f"{r['frame_ssim_mean']:.3f} | {r['frame_ssim_min']:.3f} | {r['frame_psnr_mean']:.1f} | "
                     f"{r['step_s'] * 1e3:.1f} | {r['exact_step_s'] * 1e3:.1f} | {r['step_ratio']:.2f} |")
    return "\n".join(lines)


def _sheet(run: tuple, clips, path: Path) -> None:
    """Each clip's frames in a row: exact, under the block cache, and their difference."""
    exact, made, threshold = run
    most = max(f for _, _, f in clips)
    rows = []
    for (h, w, f), ours, theirs in zip(clips, made, exact):
        rows.append((list(theirs), f"{w}x{h}x{f}: exact"))
        rows.append((list(ours), f"block cache {threshold:g}, per token"))
        rows.append(([difference(a, b) for a, b in zip(theirs, ours)], "difference x4"))
    contact_sheet([f"frame {i}" for i in range(most)], rows, path)
