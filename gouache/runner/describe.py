"""What the runner serves of a loaded pipeline (`ModelInfo`): its family, the pixel step its
sizes take, its defaults. Reading sizes off the VAE's scale is the runner's business: only the
runner turns pixels into latents."""

from __future__ import annotations

import torch
from diffusers import DiffusionPipeline, FluxKontextPipeline, FluxTransformer2DModel, SD3Transformer2DModel, UNet2DConditionModel

from gouache.errors import UnknownModelError
from gouache.model_info import ModelInfo
from gouache.models.zoo import BUILTIN_MODELS, DEFAULT_GUIDANCE, DEFAULT_STEPS, TINY_DEFAULT_STEPS


def denoiser(pipe: DiffusionPipeline) -> torch.nn.Module:
    """The UNet or transformer: the module run once per step."""
    return pipe.unet if getattr(pipe, "unet", None) is not None else pipe.transformer


def family_of(pipe: DiffusionPipeline) -> str:
    """sd | sdxl | sd3 | flux, read off the denoiser (so img2img/inpaint variants agree)."""
    net = denoiser(pipe)
    if isinstance(net, FluxTransformer2DModel):
        return "flux"
    if isinstance(net, SD3Transformer2DModel):
        return "sd3"
    if isinstance(net, UNet2DConditionModel):
        return "sdxl" if net.config.addition_embed_type == "text_time" else "sd"
    raise UnknownModelError(f"unsupported denoiser {type(net).__name__}", param="model")


def instruction_edits(pipe: DiffusionPipeline) -> bool:
    """Whether an edit without a mask follows its prompt with the upload as a reference (FLUX.1 Kontext)."""
    return isinstance(pipe, FluxKontextPipeline)


def size_step(pipe: DiffusionPipeline, family: str) -> int:
    """Pixels that width and height must be multiples of for the denoiser to accept them."""
    vae_scale = pipe.vae_scale_factor
    config = denoiser(pipe).config
    if family in ("sd", "sdxl"):
        # each UNet down block but the last halves the latent; the up path must undo it exactly
        return vae_scale * 2 ** (len(config.down_block_types) - 1)
    if family == "sd3":
        return vae_scale * config.patch_size
    return vae_scale * 2  # Flux packs 2x2 latent patches into one token


def default_size(pipe: DiffusionPipeline) -> int:
    """The pipeline's own default: the denoiser's sample size in pixels (Flux: 128 latents)."""
    sample_size = getattr(denoiser(pipe).config, "sample_size", None)
    if sample_size is None:
        sample_size = getattr(pipe, "default_sample_size", 128)
    return int(sample_size) * pipe.vae_scale_factor


def model_info(pipe: DiffusionPipeline, name: str) -> ModelInfo:
    family = family_of(pipe)
    builtin = BUILTIN_MODELS.get(name)
    net = denoiser(pipe)
    return ModelInfo(
        name=name,
        family=family,
        size_step=size_step(pipe, family),
        default_size=builtin.default_size if builtin else default_size(pipe),
        default_steps=TINY_DEFAULT_STEPS if builtin else DEFAULT_STEPS[family],
        default_guidance=builtin.default_guidance if builtin and builtin.default_guidance is not None else DEFAULT_GUIDANCE[family],
        uses_cfg=family != "flux",  # FLUX.1-dev is guidance-distilled: guidance is an input
        inpaint_channels=family in ("sd", "sdxl") and net.config.in_channels == 9,
        instruction_edit=instruction_edits(pipe),
    )
