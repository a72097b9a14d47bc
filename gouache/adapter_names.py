"""The adapter directories by name, and the errors of adapters; no torch, so the API can
check names.

A name is `[A-Za-z0-9][A-Za-z0-9._-]{0,63}`. A LoRA's stands for `<--lora-dir>/<name>.safetensors`
only, a ControlNet's for the diffusers directory `<--controlnet-dir>/<name>/` (its
`config.json` and weights): no name reaches outside its directory.
"""

from __future__ import annotations

import re
from pathlib import Path

NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"
SUFFIX = ".safetensors"
CONFIG = "config.json"  # what makes a subdirectory of --controlnet-dir a ControlNet


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


class ControlNetError(ValueError):
    """A ControlNet (or its conditioning) that cannot serve this request: the message says why
    (the API answers 400)."""


class ControlNetUnavailable(ControlNetError):
    """The service worker of a ControlNet is gone (it is being restarted): the server's failure,
    not the request's."""


class UnknownControlNet(ControlNetError):
    """No such ControlNet in the directory."""


def controlnet_path(directory: Path | None, name: object) -> Path:
    """The directory of ControlNet `name`; ControlNetError for a bad name, UnknownControlNet
    for a missing one."""
    if not isinstance(name, str) or not re.fullmatch(NAME, name):
        raise ControlNetError(f"ControlNet name {name!r} must match {NAME} (a directory's name)")
    if directory is None:
        raise UnknownControlNet(f"unknown ControlNet {name!r}: this server has no --controlnet-dir")
    path = directory / name
    if not (path / CONFIG).is_file():
        raise UnknownControlNet(f"unknown ControlNet {name!r}: no {name}/{CONFIG} in the ControlNet directory "
                                "(GET /v1/controlnets lists them)")
    return path


def controlnet_names(directory: Path | None) -> list[str]:
    if directory is None or not directory.is_dir():
        return []
    return sorted(p.name for p in directory.iterdir() if re.fullmatch(NAME, p.name) and (p / CONFIG).is_file())
