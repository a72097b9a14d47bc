"""Fine-tune the shapes UNet into a 9-channel inpainting UNet (SD1.5-inpainting's layout: noisy
latents, the mask at latent resolution, the VAE latents of the image with the mask's region
blanked). It starts from the trained UNet, whose input convolution gets zero weights for the five
new channels, so step 0 already generates; the masks are random rectangles (and, one time in
ten, the whole image: a plain generation), the caption describes the whole target image."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from gouache.models import trained
from gouache.models.zoo import shapes_sd
from gouache.train.loop import Report, Schedule, is_writer, seed_everything, shapes_batch, train
from gouache.train.unet import BATCH, denoising_loss, drop_captions

LR = 2e-4
WHOLE_IMAGE = 0.1  # share of masks that repaint everything


def random_masks(batch: int, height: int, width: int, generator: torch.Generator) -> torch.Tensor:
    """[B, 1, H, W] of 0 (keep) and 1 (repaint): a rectangle of 1/6 to 2/3 of each side, or all."""
    device = generator.device
    masks = torch.zeros(batch, 1, height, width, device=device)
    for mask in masks:
        if torch.rand((), generator=generator, device=device) < WHOLE_IMAGE:
            mask.fill_(1.0)
            continue
        h = int(height * (1 / 6 + torch.rand((), generator=generator, device=device).item() / 2))
        w = int(width * (1 / 6 + torch.rand((), generator=generator, device=device).item() / 2))
        top = int(torch.randint(0, height - h + 1, (), generator=generator, device=device))
        left = int(torch.randint(0, width - w + 1, (), generator=generator, device=device))
        mask[:, top : top + h, left : left + w] = 1.0
    return masks


def widened_unet(source: torch.nn.Module) -> torch.nn.Module:
    """A 9-channel UNet with `source`'s weights; the new input channels start at zero."""
    unet = trained.unet(in_channels=9)
    state = source.state_dict()
    conv = state["conv_in.weight"]
    state["conv_in.weight"] = torch.cat([conv, conv.new_zeros(conv.shape[0], 5, *conv.shape[2:])], dim=1)
    unet.load_state_dict(state)
    return unet


def train_inpaint(seed: int, steps: int, out: Path, device: str = "cpu", lr: float = LR) -> Report:
    generator = seed_everything(seed, device)
    vae = trained.load_vae(out).requires_grad_(False).to(device)
    source, text_encoder = trained.load_unet(out)
    model = torch.nn.ModuleDict({"unet": widened_unet(source),
                                 "text_encoder": text_encoder.requires_grad_(True)}).to(device)
    pipe = shapes_sd(vae, model["text_encoder"], model["unet"])
    alphas = pipe.scheduler.alphas_cumprod.to(device)
    scale = vae.config.scaling_factor

    def loss_of(step: int) -> torch.Tensor:
        batch = shapes_batch(seed, step, BATCH, trained.TRAIN_SIZES, device)
        pixels = batch.pixels
        masks = random_masks(len(pixels), pixels.shape[2], pixels.shape[3], generator)
        with torch.no_grad():
            latents = vae.encode(pixels).latent_dist.sample(generator) * scale
            kept = vae.encode(pixels * (masks < 0.5)).latent_dist.sample(generator) * scale
        small_masks = F.interpolate(masks, size=latents.shape[2:])
        embeds = pipe.encode_prompt(drop_captions(batch.captions, generator), device, 1, False)[0]
        return denoising_loss(model["unet"], latents, embeds, alphas, generator, torch.cat([small_masks, kept], dim=1))

    kept_model, report = train("inpaint", model, loss_of, Schedule(steps=steps, lr=lr, warmup=100), seed)
    if is_writer():
        trained.save_weights(
            {"unet": kept_model["unet"], "text_encoder": kept_model["text_encoder"]}, "shapes-unet-inpaint", out
        )
    return report
