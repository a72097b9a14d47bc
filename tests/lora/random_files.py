"""Directories of random LoRA files, for the tests that serve adapters."""

from pathlib import Path

from safetensors.torch import save_file

from gouache.lora.files import random_lora
from gouache.models.zoo import load_pipeline


def random_loras(directory: Path, model: str, names: tuple[str, ...] = ("ink", "paper")) -> Path:
    """One random adapter of `model`'s denoiser per name (seeds 0, 1, ...), as <name>.safetensors."""
    pipe = load_pipeline(model)
    for seed, name in enumerate(names):
        save_file(random_lora(pipe, seed=seed), str(directory / f"{name}.safetensors"))
    return directory
