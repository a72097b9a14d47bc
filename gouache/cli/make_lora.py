"""`gouache make-lora`: a random LoRA of a model's denoiser, for tests and benchmarks."""

from __future__ import annotations

import argparse

from gouache.cli.model_args import add_model_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--out", required=True, help="the .safetensors file to write")
    p.add_argument("--rank", type=int, default=4, help="rank of each layer's update (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of its random weights (default: %(default)s)")


def run(args) -> int:
    from safetensors.torch import save

    from gouache.files import write_atomic
    from gouache.lora.files import random_lora
    from gouache.models.zoo import load_pipeline

    if args.rank < 1:
        raise ValueError(f"--rank must be >= 1, got {args.rank}")
    if not args.out.endswith(".safetensors"):
        raise ValueError(f"--out must name a .safetensors file, got {args.out!r}")
    weights = random_lora(load_pipeline(args.model, args.dtype, args.device), args.rank, args.seed)
    write_atomic(args.out, save(weights))
    print(f"wrote {args.out}: {len(weights) // 2} layers of rank {args.rank} for {args.model}")
    return 0
