"""The adapter directory (`--lora-dir`) by name, and the errors of adapters; no torch, so the
API can check names.

A name is `[A-Za-z0-9][A-Za-z0-9._-]{0,63}` and stands for `<dir>/<name>.safetensors` only:
no name reaches outside the directory.
"""

from __future__ import annotations

import re
from pathlib import Path

NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"
SUFFIX = ".safetensors"


class LoraError(ValueError):
    """A LoRA that cannot apply to this model: the message says why (the API answers 400)."""


class UnknownLora(LoraError):
    """No such adapter in the directory."""


def lora_path(directory: Path | None, name: object) -> Path:
    """The file of adapter `name`; LoraError for a bad name, UnknownLora for a missing file."""
    if not isinstance(name, str) or not re.fullmatch(NAME, name) or name.endswith(SUFFIX):
        raise LoraError(f"LoRA name {name!r} must match {NAME} (the file's name without {SUFFIX})")
    if directory is None:
        raise UnknownLora(f"unknown LoRA {name!r}: this server has no --lora-dir")
    path = directory / f"{name}{SUFFIX}"
    if not path.is_file():
        raise UnknownLora(f"unknown LoRA {name!r}: no {name}{SUFFIX} in the LoRA directory (GET /v1/loras lists them)")
    return path


def lora_names(directory: Path | None) -> list[str]:
    if directory is None or not directory.is_dir():
        return []
    names = (p.name[: -len(SUFFIX)] for p in directory.glob(f"*{SUFFIX}") if p.is_file())
    return sorted(name for name in names if re.fullmatch(NAME, name))
