"""`gouache train vae|unet|inpaint|dit`: reproduce one shapes model from a seed, with a progress bar, a
loss curve (PNG + JSON) and the weights as safetensors. Train the VAE first: the others encode
their images with the VAE found in `--out`."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

# kind -> steps that fit in 30 minutes on a 2-core CPU (see benchmarks/results/train_*.json)
DEFAULT_STEPS = {"vae": 3000, "unet": 4600, "inpaint": 1500, "dit": 3300}


def default_out() -> Path:
    from gouache.runner.trained import WEIGHTS_DIR

    return WEIGHTS_DIR


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("kind", choices=list(DEFAULT_STEPS),
                   help="which model: vae first, then unet or dit; inpaint fine-tunes the trained unet")
    p.add_argument("--seed", type=int, default=0, help="seeds the weights, the data and the noise (default: %(default)s)")
    p.add_argument("--steps", type=int, default=None,
                   help="optimiser steps (default: " + ", ".join(f"{k} {v}" for k, v in DEFAULT_STEPS.items()) + ")")
    p.add_argument("--out", type=Path, default=None,
                   help="directory of the weights read (the VAE) and written (default: the built-in models' own)")
    p.add_argument("--report", type=Path, default=Path("benchmarks/results"),
                   help="directory for train_<kind>.json and .png (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    from gouache.train.dit import train_dit
    from gouache.train.inpaint import train_inpaint
    from gouache.train.unet import train_unet
    from gouache.train.vae import train_vae

    steps = args.steps if args.steps is not None else DEFAULT_STEPS[args.kind]
    if steps < 1:
        raise ValueError(f"--steps must be at least 1, got {steps}")
    out = args.out if args.out is not None else default_out()
    trainer = {"vae": train_vae, "unet": train_unet, "inpaint": train_inpaint, "dit": train_dit}[args.kind]
    report = trainer(args.seed, steps, out)
    command = shlex.join(["gouache", "train", args.kind, "--seed", str(args.seed), "--steps", str(steps)])
    json_path, png_path = report.write(args.report, command)
    print(f"trained {args.kind} in {report.seconds / 60:.1f} min: loss {report.smoothed()[-1]:.4f}; "
          f"weights in {out}, curve in {png_path}", file=sys.stderr)
    return 0
