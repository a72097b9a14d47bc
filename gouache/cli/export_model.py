"""`gouache export-model NAME DIRECTORY`: a built-in model written as a diffusers directory."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name")
    p.add_argument("directory")


def run(args) -> int:
    from gouache.models.zoo import export_model

    export_model(args.name, args.directory)
    print(f"wrote {args.name} to {args.directory}")
    return 0
