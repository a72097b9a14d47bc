"""The flags that pick a model, shared by the commands that load one."""

from __future__ import annotations

import argparse

from gouache.config import ModelConfig


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=ModelConfig.model,
                   help="built-in model name (see `gouache models`) or local diffusers directory "
                        "(default: %(default)s)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                   help="weights and activations (default: %(default)s)")
    p.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1 (default: %(default)s)")
