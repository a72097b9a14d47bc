"""Family adapters, chosen from the pipeline's denoiser."""

from __future__ import annotations

from gouache.runner.families.base import Family
from gouache.runner.families.dit import FluxFamily, StableDiffusion3Family
from gouache.runner.families.unet import StableDiffusionFamily, StableDiffusionXLFamily

FAMILIES: dict[str, type[Family]] = {
    f.name: f for f in (StableDiffusionFamily, StableDiffusionXLFamily, StableDiffusion3Family, FluxFamily)
}


def family_name(pipe) -> str:
    """sd | sdxl | sd3 | flux, from the pipeline's components."""
    if hasattr(pipe, "transformer") and pipe.transformer is not None:
        return "flux" if "Flux" in type(pipe.transformer).__name__ else "sd3"
    return "sdxl" if getattr(pipe, "text_encoder_2", None) is not None else "sd"


def make_family(pipe) -> Family:
    return FAMILIES[family_name(pipe)](pipe)
