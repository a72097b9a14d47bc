"""`gouache profile-lora`: the loading bound K of bounded asynchronous LoRA loading, as KATZ
finds it (§6): denoise the same prompts and seeds with and without an adapter, take the cosine
similarity of the two latents after every step, and set K to the first step whose mean
similarity falls below a threshold (0.99): the steps before it barely feel the adapter, so a
request may run them while its adapter is still being read.

Writes JSON (per-step similarities, K) and prints `--lora-bound K` for `gouache serve`.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from gouache.data.prompts import Prompt, shapes_prompts
from gouache.files import write_atomic


def add_arguments(p) -> None:
    p.add_argument("--model", default="shapes-unet",
                   help="built-in model name or local directory (default: %(default)s)")
    p.add_argument("--lora", required=True, help="the adapter's .safetensors file")
    p.add_argument("--scale", type=float, default=1.0, help="the adapter's scale (default: %(default)s)")
    p.add_argument("--prompts", type=int, default=8,
                   help="prompts (shapes captions; instruction edits for a model that only edits), each its own seed "
                        "(default: %(default)s)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's)")
    p.add_argument("--size", type=int, default=None, help="pixels per side (default: the model's)")
    p.add_argument("--threshold", type=float, default=0.99,
                   help="similarity below which the adapter counts as felt (default: %(default)s, KATZ's)")
    p.add_argument("--torch-threads", type=int, default=None, help="intra-op threads of torch (default: torch's)")
    p.add_argument("--out", default=None,
                   help="JSON to write (default: benchmarks/results/lora_bound_<model>_<lora>.json)")


def run(args) -> int:
    import torch

    from gouache.config import LoraConfig
    from gouache.models.zoo import load_pipeline
    from gouache.runner.describe import model_info
    from gouache.runner.model_runner import ModelRunner

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    if not 0 < args.threshold <= 1:
        raise ValueError(f"--threshold must be in (0, 1], got {args.threshold}")
    if args.prompts < 1:
        raise ValueError(f"--prompts must be >= 1, got {args.prompts}")
    path = Path(args.lora)
    if path.suffix != ".safetensors" or not path.is_file():
        raise ValueError(f"--lora must be an existing .safetensors file, got {args.lora!r}")
    pipe = load_pipeline(args.model)
    info = model_info(pipe, args.model)
    runner = ModelRunner(pipe, lora=LoraConfig(str(path.parent)))
    steps, size = args.steps or info.default_steps, args.size or info.default_size
    prompts = shapes_prompts(not info.generation, args.prompts, size, random.Random(0))
    similarity = similarities(runner, info, ((path.stem, args.scale),), prompts, steps)
    bound = first_below(similarity, args.threshold)
    result = {"kind": "lora-bound", "command": "gouache profile-lora " + " ".join(sys.argv[2:]), "model": args.model,
              "lora": path.name, "scale": args.scale, "size": size, "steps": steps,
              "prompts": len(prompts),
              "threshold": args.threshold, "similarity": [round(s, 5) for s in similarity], "bound": bound}
    out = Path(args.out or f"benchmarks/results/lora_bound_{args.model}_{path.stem}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, json.dumps(result, indent=2))
    print("step  cosine(with, without)")
    for step, value in enumerate(result["similarity"], 1):
        print(f"{step:4d}  {value:.5f}{'  <' if step - 1 == bound else ''}")
    print(f"wrote {out}; serve with --lora-bound {bound} (the adapter may join as late as step {bound})")
    return 0


def similarities(runner, info, loras, prompts: list[Prompt], steps: int) -> list[float]:
    """Per step, the mean over prompts of the cosine similarity of the latents with `loras` from
    the first step and without any."""
    import torch

    total = torch.zeros(steps)
    for k, prompt in enumerate(prompts):
        pairs = zip(trajectory(runner, info, prompt, f"profile-{k}", steps, loras),
                    trajectory(runner, info, prompt, f"profile-{k}-plain", steps, ()))
        total += torch.stack([torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) for a, b in pairs])
    return (total / len(prompts)).tolist()


def first_below(similarity: list[float], threshold: float) -> int:
    """The loading bound: the first step (0-based) whose latents part below `threshold`; the
    step count if none does."""
    return next((step for step, value in enumerate(similarity) if value < threshold), len(similarity))


def trajectory(runner, info, prompt: Prompt, rid: str, steps: int, loras) -> list:
    """The request's latents after each step, its adapters applied from the first."""
    from gouache.sched.plan import Batch

    runner.prepare(*prompt.prepared(rid, steps, info.default_guidance, loras=loras))
    for name, _ in loras:
        runner.lora_runtime.store.load(name).result()  # the adapter from the first step on
    out = []
    for _ in range(steps):
        step = runner.execute(Batch((rid,)))
        if step.failed:
            raise RuntimeError(f"profiling failed: {step.failed[rid]}")
        out.append(runner.states[rid].latents.clone())
    runner.release(rid)
    return out
