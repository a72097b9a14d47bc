"""Family adapters, chosen from the pipeline's denoiser."""

from __future__ import annotations

from gouache.runner.conditioning import ConditioningCache
from gouache.runner.describe import family_of, image_to_video, instruction_edits
from gouache.runner.families.base import Family
from gouache.runner.families.dit import FluxFamily, FluxKontextFamily, StableDiffusion3Family
from gouache.runner.families.flux2 import Flux2Family
from gouache.runner.families.qwen import QwenImageEditFamily, QwenImageFamily
from gouache.runner.families.unet import StableDiffusionFamily, StableDiffusionXLFamily
from gouache.runner.families.wan import WanFamily, WanImageToVideoFamily
from gouache.runner.families.zimage import ZImageFamily

FAMILIES: dict[str, type[Family]] = {
    f.name: f for f in (StableDiffusionFamily, StableDiffusionXLFamily, StableDiffusion3Family, FluxFamily,
                   QwenImageFamily, ZImageFamily, Flux2Family, WanFamily)
}


INSTRUCTION_EDITS = {"flux": FluxKontextFamily, "qwenimage": QwenImageEditFamily}  # FLUX.2's family edits as it is


def family_class(pipe) -> type[Family]:
    family = family_of(pipe)
    if image_to_video(pipe):
        return WanImageToVideoFamily
    return INSTRUCTION_EDITS[family] if family in INSTRUCTION_EDITS and instruction_edits(pipe) else FAMILIES[family]


def make_family(pipe, patch_pixels: int | None, conditioning: ConditioningCache | None = None) -> Family:
    return family_class(pipe)(pipe, patch_pixels, conditioning)
