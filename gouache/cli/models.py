"""`gouache models`: the built-in models and the full-size benchmark architectures, one a line."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`models` takes no flags."""


def run(args) -> int:
    from gouache.models.arch import ARCH_CONFIGS, arch_description
    from gouache.models.zoo import BUILTIN_MODELS

    for name, spec in BUILTIN_MODELS.items():
        print(f"{name:20s} {spec.description}")
    for name in ARCH_CONFIGS:
        print(f"{name:20s} {arch_description(name)}")
    return 0
