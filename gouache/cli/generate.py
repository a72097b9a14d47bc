"""`gouache generate`: one image, offline, without a server (`gouache.offline`)."""

from __future__ import annotations

import argparse

from gouache.cli.model_args import add_model_args
from gouache.cli_flags import size_arg


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt")
    add_model_args(p)
    p.add_argument("--size", type=size_arg, default=None, help="WxH in pixels (default: the model's)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's)")
    p.add_argument("--guidance", type=float, default=None, help="guidance scale (default: the model's)")
    p.add_argument("--negative-prompt", default=None,
                   help="what to steer away from; needs classifier-free guidance (--guidance > 1; Z-Image: > 0; "
                        "not FLUX) (default: none)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial noise (default: %(default)s)")
    p.add_argument("-o", "--output", default="out.png",
                   help="output file; its extension picks png / jpeg / webp (default: %(default)s)")


def run(args) -> int:
    from gouache.offline import run_offline

    run_offline(args)
    return 0
