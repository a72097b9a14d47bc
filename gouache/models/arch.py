"""Published full-size denoisers (SDXL, SD3, Flux) with seeded random weights: for benchmarks
and memory planning, without downloading anything (`zoo.arch_pipeline` puts one in a pipeline)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from diffusers import FluxTransformer2DModel, SD3Transformer2DModel, UNet2DConditionModel

from gouache.errors import UnknownModelError
from gouache.models.seeds import SEED_DENOISER, seeded, torch_dtype

# Published denoiser configs (diffusers format), with random weights: for memory and speed
# planning without downloading anything.
ARCH_CONFIGS: dict[str, tuple[type[torch.nn.Module], dict]] = {
    "sdxl-arch": (  # stabilityai/stable-diffusion-xl-base-1.0, unet/config.json
        UNet2DConditionModel,
        dict(
            sample_size=128, in_channels=4, out_channels=4, block_out_channels=(320, 640, 1280),
            layers_per_block=2, transformer_layers_per_block=(1, 2, 10),
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
            attention_head_dim=(5, 10, 20), cross_attention_dim=2048, use_linear_projection=True,
            addition_embed_type="text_time", addition_time_embed_dim=256,
            projection_class_embeddings_input_dim=2816, norm_num_groups=32,
        ),
    ),
    "sd3-arch": (  # stabilityai/stable-diffusion-3-medium-diffusers, transformer/config.json
        SD3Transformer2DModel,
        dict(
            sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24,
            attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
            caption_projection_dim=1536, pooled_projection_dim=2048, pos_embed_max_size=192,
        ),
    ),
    "flux-arch": (  # black-forest-labs/FLUX.1-dev, transformer/config.json
        FluxTransformer2DModel,
        dict(
            patch_size=1, in_channels=64, num_layers=19, num_single_layers=38,
            attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
            pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56),
        ),
    ),
}


def arch_description(name: str) -> str:
    """One line for `gouache models`: which published denoiser `name` is and what it is for."""
    published = {"sdxl-arch": "SDXL base 1.0", "sd3-arch": "SD3 medium", "flux-arch": "FLUX.1-dev"}
    return (f"benchmark model (`gouache bench fullsize`, `batching`): full-size {published[name]} "
            f"{ARCH_CONFIGS[name][0].__name__}, random weights, small text encoders, no download")


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Create parameters directly in `dtype`: a 12B model in fp32 first would need 48 GB."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_arch(name: str, device: str = "meta", dtype: str = "bfloat16") -> torch.nn.Module:
    """A full-size denoiser with seeded random weights; on `meta` it allocates nothing."""
    if name not in ARCH_CONFIGS:
        raise UnknownModelError(
            f"unknown architecture {name!r}; expected one of {', '.join(ARCH_CONFIGS)}",
            param="model",
        )
    cls, config = ARCH_CONFIGS[name]
    with torch.device(device), default_dtype(torch_dtype(dtype)):
        return seeded(SEED_DENOISER, lambda: cls(**config).eval())
