"""`gouache` command line: one module per command, each with `add_arguments(parser)` and
`run(args) -> int`, assembled here from `commands()`."""

from __future__ import annotations

import argparse
import sys
from types import ModuleType

from gouache.errors import GouacheError
from gouache.heap import keep_freed_memory


def commands() -> dict[str, tuple[ModuleType, str]]:
    """command -> (its module, its line in `gouache --help`), in that help's order. Imported here,
    not at the top, so that importing `gouache.cli` stays light."""
    from gouache.cli import bench, edit, export_model, generate, make_controlnet, make_lora, models, serve
    from gouache.profile import lora as profile_lora
    from gouache.profile import step as profile
    from gouache.sim import command as simulate
    from gouache.sim import reproduce
    from gouache.train import command as train

    return {
        "serve": (serve, "run the OpenAI-compatible image server"),
        "generate": (generate, "make one image offline, without a server"),
        "edit": (edit, "edit an image offline: repaint where the mask is transparent"),
        "models": (models, "list the built-in models and the full-size benchmark architectures"),
        "export-model": (export_model, "write a built-in model as a diffusers directory"),
        "make-lora": (make_lora, "write a random LoRA of a model's denoiser (for tests and benchmarks)"),
        "make-controlnet": (make_controlnet, "write a random ControlNet of a UNet model, a diffusers directory (for "
                                             "tests and benchmarks)"),
        "train": (train, "train a shapes model (vae, unet, dit, edit) or an adapter of one from a seed"),
        "profile": (profile, "measure this device and fit the step-cost model"),
        "profile-lora": (profile_lora,
                         "the step by which an adapter must join (KATZ's bound for asynchronous LoRA loading)"),
        "simulate": (simulate, "run scheduling policies on a simulated clock"),
        "reproduce": (reproduce, "the papers' scheduling experiments, in one run"),
        "bench": (bench, "benchmarks"),
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gouache", description="A serving engine for diffusion models.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help) in commands().items():
        module.add_arguments(subparsers.add_parser(name, help=help))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        keep_freed_memory()
        return commands()[args.command][0].run(args)
    except (ValueError, OSError, GouacheError) as error:  # configuration mistakes: say what to fix
        print(f"gouache: error: {error}", file=sys.stderr)
        return 2
