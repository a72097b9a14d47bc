"""What the runner serves of a loaded pipeline (`ModelInfo`): its family, the pixel step its
sizes take, its defaults. Reading sizes off the VAE's scale is the runner's business: only the
runner turns pixels into latents."""

from __future__ import annotations

import torch
from diffusers import (
    DiffusionPipeline,
    Flux2KleinPipeline,
    Flux2Transformer2DModel,
    FluxKontextPipeline,
    FluxTransformer2DModel,
    QwenImageEditPipeline,
    QwenImageEditPlusPipeline,
    QwenImageTransformer2DModel,
    SD3Transformer2DModel,
    UNet2DConditionModel,
    WanImageToVideoPipeline,
    WanTransformer3DModel,
    ZImageTransformer2DModel,
)

from gouache.errors import UnknownModelError
from gouache.model_info import ClipRules, ModelInfo
from gouache.models.zoo import BUILTIN_MODELS, DEFAULT_GUIDANCE, DEFAULT_STEPS, TINY_DEFAULT_STEPS

# Techniques (`gouache.techniques`) a family does not serve, each with why: admission refuses a
# request that asks for one, the server a flag that would apply one (docs/architecture.md)
UNSERVED: dict[str, dict[str, str]] = {
    family: {"block_cache": "its transformer takes no cached block outputs yet",
             "template": "no template replay is built for its transformer yet"}
    for family in ("qwenimage", "zimage", "flux2")
}
UNSERVED["wan"] = {"template": "a template replays an image edit's unmasked tokens; Wan makes clips, not edits"}
CFG_FROM = {"zimage": 0.0}  # guidance_scale above which classifier-free guidance runs, where not 1
# Least steps a family's schedule takes, where more than 1: Qwen-Image's stretches its sigmas to end
# at its shift_terminal, which one step divides by zero (its pipelines give NaN)
MIN_STEPS = {"qwenimage": 2}
# Families whose forward --compile refuses, and why
UNCOMPILED = {"zimage": "its forward takes each prompt at its own length, which places the image's tokens, so a "
                        "static graph would be compiled anew for most prompts"}
DEFAULT_SIZE = {"wan": 480}  # pixels a side where the pipeline's own default is not square (Wan 2.1: 832x480)
FPS = {"wan": 16}  # a video family's frames per second (Wan 2.1's clips: 81 frames, 5 s)
MAX_FRAMES = 161  # gouache's bound on a clip's frames (10 s at 16 fps, twice Wan 2.1's 81)


def denoiser(pipe: DiffusionPipeline) -> torch.nn.Module:
    """The UNet or transformer: the module run once per step."""
    return pipe.unet if getattr(pipe, "unet", None) is not None else pipe.transformer


def family_of(pipe: DiffusionPipeline) -> str:
    """sd | sdxl | sd3 | flux | qwenimage | zimage | flux2 | wan, read off the denoiser (so
    img2img/inpaint variants agree)."""
    net = denoiser(pipe)
    if isinstance(net, WanTransformer3DModel):
        return "wan"
    if isinstance(net, FluxTransformer2DModel):
        return "flux"
    if isinstance(net, QwenImageTransformer2DModel):
        return "qwenimage"
    if isinstance(net, ZImageTransformer2DModel):
        return "zimage"
    if isinstance(net, Flux2Transformer2DModel):
        if not isinstance(pipe, Flux2KleinPipeline):
            raise UnknownModelError(f"{type(pipe).__name__} is not served: of FLUX.2, gouache serves [klein] "
                                    "(Flux2KleinPipeline, a Qwen3 text encoder)", param="model")
        return "flux2"
    if isinstance(net, SD3Transformer2DModel):
        return "sd3"
    if isinstance(net, UNet2DConditionModel):
        return "sdxl" if net.config.addition_embed_type == "text_time" else "sd"
    raise UnknownModelError(f"unsupported denoiser {type(net).__name__}", param="model")


def instruction_edits(pipe: DiffusionPipeline) -> bool:
    """Whether an edit without a mask follows its prompt with the upload as a reference (FLUX.1
    Kontext, FLUX.2, Qwen-Image-Edit)."""
    return isinstance(pipe, FluxKontextPipeline | QwenImageEditPipeline | QwenImageEditPlusPipeline) or \
        isinstance(denoiser(pipe), Flux2Transformer2DModel)


def max_input_images(pipe: DiffusionPipeline) -> int:
    """Uploads one edit takes: FLUX.2 up to 4 (gouache's bound), Qwen-Image-Edit-Plus 3 (the model's)."""
    if isinstance(denoiser(pipe), Flux2Transformer2DModel):
        return 4
    return 3 if isinstance(pipe, QwenImageEditPlusPipeline) else 1


def image_to_video(pipe: DiffusionPipeline) -> bool:
    """Whether the model makes a clip from its first frame (Wan's image-to-video), which each
    request then sends (`input_reference`)."""
    return isinstance(pipe, WanImageToVideoPipeline)


def generations(pipe: DiffusionPipeline) -> bool:
    """Whether the model makes images from text alone (Qwen-Image-Edit's pipelines need an image)."""
    return not isinstance(pipe, QwenImageEditPipeline | QwenImageEditPlusPipeline)


def vae_scale(pipe: DiffusionPipeline) -> int:
    """Pixels per latent pixel a side (Wan's pipelines name it for space beside time)."""
    scale = getattr(pipe, "vae_scale_factor", None)
    return scale if scale is not None else pipe.vae_scale_factor_spatial


def size_step(pipe: DiffusionPipeline, family: str) -> int:
    """Pixels that width and height must be multiples of for the denoiser to accept them."""
    scale = vae_scale(pipe)
    config = denoiser(pipe).config
    if family in ("sd", "sdxl"):
        # each UNet down block but the last halves the latent; the up path must undo it exactly
        return scale * 2 ** (len(config.down_block_types) - 1)
    if family == "sd3":
        return scale * config.patch_size
    return scale * 2  # Flux, Qwen-Image, Z-Image and Wan make one token of 2x2 latent pixels


def default_size(pipe: DiffusionPipeline) -> int:
    """The pipeline's own default: the denoiser's sample size in pixels (Flux, Qwen-Image: 128 latents)."""
    sample_size = getattr(denoiser(pipe).config, "sample_size", None)
    if sample_size is None:
        sample_size = getattr(pipe, "default_sample_size", 128)
    return int(sample_size) * vae_scale(pipe)


def clip_rules(pipe: DiffusionPipeline, family: str) -> ClipRules | None:
    """A video model's clip rules (None: the model makes images): frames of 1 + a multiple of the
    VAE's temporal stride, up to what the transformer's RoPE places (and MAX_FRAMES)."""
    if family != "wan":
        return None
    step = pipe.vae_scale_factor_temporal
    placed = 1 + step * (denoiser(pipe).config.rope_max_seq_len - 1)
    return ClipRules(frame_step=step, max_frames=min(placed, MAX_FRAMES), fps=FPS[family],
                     from_image=image_to_video(pipe))


def model_info(pipe: DiffusionPipeline, name: str) -> ModelInfo:
    family = family_of(pipe)
    builtin = BUILTIN_MODELS.get(name)
    net = denoiser(pipe)
    return ModelInfo(
        name=name,
        family=family,
        size_step=size_step(pipe, family),
        default_size=builtin.default_size if builtin else DEFAULT_SIZE.get(family) or default_size(pipe),
        default_steps=TINY_DEFAULT_STEPS if builtin else DEFAULT_STEPS[family],
        default_guidance=(builtin.default_guidance if builtin and builtin.default_guidance is not None
                          else DEFAULT_GUIDANCE[family]),
        # FLUX.1-dev is guidance-distilled (guidance is an input); a step-distilled FLUX.2 runs no CFG
        uses_cfg=family != "flux" and not getattr(pipe.config, "is_distilled", False),
        inpaint_channels=family in ("sd", "sdxl") and net.config.in_channels == 9,
        instruction_edit=instruction_edits(pipe),
        unserved=tuple(UNSERVED.get(family, {}).items()),
        cfg_from=CFG_FROM.get(family, 1.0),
        token_pixels=vae_scale(pipe) if family in ("sd", "sdxl") else size_step(pipe, family),
        max_input_images=max_input_images(pipe),
        generation=generations(pipe) and (builtin.generation if builtin else True),
        min_steps=MIN_STEPS.get(family, 1),
        clips=clip_rules(pipe, family),
    )
