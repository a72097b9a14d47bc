"""The tiny Z-Image built-in: Z-Image's pipeline (a single-stream DiT over 2x2 latent patches that
takes a list of images and prompts of any sizes, a Qwen3 text encoder, FLUX.1's 16-channel VAE)
shrunk to toy size, seeded random weights, tokenizer and chat template built in code."""

from __future__ import annotations

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
from transformers import Qwen3Model

from gouache.models.qwen import QWEN3_HIDDEN, qwen3_text_encoder
from gouache.models.seeds import SEED_DENOISER, SEED_TEXT, seeded


def tiny_zimage_transformer() -> ZImageTransformer2DModel:
    def build() -> ZImageTransformer2DModel:
        net = ZImageTransformer2DModel(
            all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=64, n_layers=2, n_refiner_layers=1,
            n_heads=2, n_kv_heads=2, cap_feat_dim=QWEN3_HIDDEN,
            axes_dims=[8, 12, 12],  # must sum to dim / n_heads
            axes_lens=[1024, 128, 128],  # text positions; up to 128 tokens (2048 px) a side
        ).eval()
        for token in (net.x_pad_token, net.cap_pad_token):  # built as zeros; trained ones are not
            torch.nn.init.normal_(token.data)
        return net

    return seeded(SEED_DENOISER, build)


def build_tiny_zimage(vae) -> ZImagePipeline:
    """Z-Image around `vae` (FLUX.1's layout: the zoo's tiny one), with Z-Image-Turbo's schedule
    (a fixed shift of 3)."""
    text_encoder, tokenizer = qwen3_text_encoder(SEED_TEXT, Qwen3Model)
    return ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False),
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=tiny_zimage_transformer(),
    )
