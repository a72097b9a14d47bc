"""`gouache edit`: `gouache generate` with an image and a mask, repainting where the mask is
transparent; on an instruction-edit model (shapes-edit, FLUX.1 Kontext, ...) without a mask, the
prompt says what to change."""

from __future__ import annotations

import argparse

from gouache.cli import generate


def add_arguments(p: argparse.ArgumentParser) -> None:
    generate.add_arguments(p)
    p.add_argument("--image", required=True, help="the image to edit (PNG, JPEG or WebP)")
    p.add_argument("--mask", default=None,
                   help="PNG of the image's size whose fully transparent pixels are repainted (default: the "
                        "image's own transparent pixels, else the whole image; on an instruction-edit model, "
                        "none: the prompt is an instruction such as 'make the red circle green')")


def run(args) -> int:
    return generate.run(args)  # `gouache.offline` edits when args.image is set
