"""Train a ControlNet of the shapes UNet on layout maps: a request names its shapes and colours
in the prompt without saying where ('a red circle and a blue square on a white background'), and
the conditioning image says where each goes and what it is (`layout_map`: each shape's silhouette
in the grey of its place in the caption, on black). The base UNet never saw a caption without
positions, so where its shapes land is the ControlNet's doing, and the checker can count it:
a shape of the asked colour and kind found in the cell the map put it in.

The ControlNet starts as diffusers starts one (`ControlNetModel.from_unet`: the UNet's encoder
weights, zero-initialised output convolutions) and trains on the base model's own loss with
the UNet and its text encoder frozen. It is written as a diffusers directory, as any ControlNet
a user brings, to `<out>/controlnets/shapes-unet/layout` (a `--controlnet-dir`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from gouache.data.shapes import unplaced_caption
from gouache.models import trained
from gouache.train.loop import Report, Schedule, is_writer, seed_everything, shapes_batch, train
from gouache.train.unet import denoising_loss, drop_captions, foreground_weights, frozen_pipeline

BATCH = 16
LR = 3e-4
NAME = "layout"


def controlnet_dir(model: str, directory: Path = trained.WEIGHTS_DIR) -> Path:
    """Where the trained ControlNets of a built-in shapes model are: a `--controlnet-dir`."""
    return directory / "controlnets" / model


def train_controlnet(seed: int, steps: int, out: Path, device: str = "cpu", lr: float = LR) -> Report:
    from diffusers import ControlNetModel

    generator = seed_everything(seed, device)
    pipe = frozen_pipeline(out, device)
    vae, unet = pipe.vae, pipe.unet
    alphas = pipe.scheduler.alphas_cumprod.to(device)
    controlnet = ControlNetModel.from_unet(unet, conditioning_channels=3).to(device)

    def loss_of(step: int) -> torch.Tensor:
        batch = shapes_batch(seed, step, BATCH, trained.TRAIN_SIZES, device, captioned=unplaced_caption, layouts=True)
        with torch.no_grad():
            latents = vae.encode(batch.pixels).latent_dist.sample(generator) * vae.config.scaling_factor
            embeds = pipe.encode_prompt(drop_captions(batch.captions, generator), device, 1, False)[0]
        weights = foreground_weights(batch.pixels, tuple(latents.shape[2:]))

        def control(noisy, t, embeds):
            down, mid = controlnet(noisy, t, encoder_hidden_states=embeds, controlnet_cond=batch.layouts,
                                   return_dict=False)
            return {"down_block_additional_residuals": down, "mid_block_additional_residual": mid}

        return denoising_loss(unet, latents, embeds, alphas, generator, weights=weights, control=control)

    kept, report = train("controlnet", controlnet, loss_of, Schedule(steps=steps, lr=lr, warmup=100), seed)
    if is_writer():
        path = controlnet_dir("shapes-unet", out) / NAME
        kept.save_pretrained(str(path))
        report.extra.update(parameters=sum(p.numel() for p in kept.parameters()), directory=str(path))
    return report
