"""`gouache make-controlnet`: a random ControlNet of a UNet model, as a diffusers directory, for
tests and benchmarks."""

from __future__ import annotations

import argparse

from gouache.cli.model_args import add_model_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--out", required=True, help="the directory to write (a name in --controlnet-dir)")
    p.add_argument("--seed", type=int, default=0, help="seed of its random weights (default: %(default)s)")


def run(args) -> int:
    from gouache.controlnet.model import random_controlnet, supports_controlnets
    from gouache.models.zoo import load_pipeline

    pipe = load_pipeline(args.model, args.dtype, args.device)
    why = supports_controlnets(pipe)
    if why:
        raise ValueError(f"{args.model}: {why}")
    random_controlnet(pipe, args.seed).save_pretrained(args.out)
    print(f"wrote {args.out}: a random ControlNet of {args.model}'s UNet")
    return 0
