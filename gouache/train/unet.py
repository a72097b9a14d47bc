"""Train the shapes UNet and its CLIP text encoder together, on the zero-terminal-SNR schedule the
pipeline samples with (`models.euler_scheduler`): velocity prediction, timesteps drawn toward the
noisy end where a picture's layout is decided, extra loss weight where the shapes are, captions
dropped 10 % of the time for classifier-free guidance, and the token grounding loss
(`grounding.py`) that ties each phrase of a caption to its shape. Each image is drawn at
NOISE_DRAWS noise levels in its batch: the VAE encoder costs as much as the UNet's training step at
128 px, and this halves its share."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from gouache.models import trained
from gouache.models.zoo import shapes_sd
from gouache.train.grounding import grounding_loss, record_cross_attention
from gouache.train.loop import Report, Schedule, is_writer, seed_everything, shapes_batch, train

BATCH = 32
NOISE_DRAWS = 2  # noise levels per image in a batch: BATCH // NOISE_DRAWS images are encoded
LR = 1e-3
UNCONDITIONAL = 0.1  # share of captions replaced by "" (the pipelines' negative prompt)
NOISY_END = 0.7  # timesteps are T * u ** NOISY_END for uniform u: 1 in 4 lands in the noisiest 14 %
FOREGROUND_WEIGHT = 4.0  # extra loss weight on latent pixels under a shape (shapes cover ~10 % of an image)
GROUNDING_WEIGHT = 1.0  # the grounding loss's weight against the velocity loss


def frozen_pipeline(out: Path, device: str):
    """The trained shapes VAE, UNet and text encoder as a pipeline, frozen on `device`: what an
    adapter of the UNet trains against."""
    vae = trained.load_vae(out).requires_grad_(False).to(device)
    unet, text_encoder = trained.load_unet(out)
    return shapes_sd(vae, text_encoder.requires_grad_(False).to(device), unet.requires_grad_(False).to(device))


def drop_captions(captions: list[str], generator: torch.Generator) -> list[str]:
    keep = torch.rand(len(captions), generator=generator, device=generator.device) >= UNCONDITIONAL
    return [c if k else "" for c, k in zip(captions, keep.tolist())]


def denoising_loss(
    unet: torch.nn.Module, latents: torch.Tensor, embeds: torch.Tensor, alphas: torch.Tensor,
    generator: torch.Generator, condition: torch.Tensor | None = None, weights: torch.Tensor | None = None,
    control=None,
) -> torch.Tensor:
    """Velocity loss at timesteps drawn toward the noisy end; `condition` (channels the UNet reads
    after the noisy latents, as an inpainting UNet does) is concatenated as given; `weights`
    ([B, 1, h, w]) weigh each latent pixel's error; `control(noisy, t, embeds)` gives the UNet's
    extra arguments (a ControlNet's residuals)."""
    noise = torch.randn(latents.shape, generator=generator, device=latents.device)
    u = torch.rand(len(latents), generator=generator, device=latents.device)
    t = ((len(alphas) - 1) * u**NOISY_END).round().long()
    alpha = alphas[t].view(-1, 1, 1, 1)
    noisy = alpha.sqrt() * latents + (1 - alpha).sqrt() * noise
    inputs = noisy if condition is None else torch.cat([noisy, condition], dim=1)
    extra = control(noisy, t, embeds) if control is not None else {}
    predicted = unet(inputs, t, encoder_hidden_states=embeds, **extra).sample
    error = (predicted - velocity(latents, noise, alphas[t])).pow(2)
    return (error if weights is None else error * weights).mean()


def velocity(latents: torch.Tensor, noise: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """What the UNet should output for `latents` noised by `noise` at cumulative alphas `alpha` [B]."""
    a = alpha.view(-1, 1, 1, 1)
    return a.sqrt() * noise - (1 - a).sqrt() * latents


def foreground_weights(pixels: torch.Tensor, latent_size: tuple[int, int]) -> torch.Tensor:
    """[B, 1, h, w]: 1 + FOREGROUND_WEIGHT on latent pixels that cover any pixel unlike the image's
    corner (always background: shapes keep a margin inside their cells), 1 elsewhere."""
    foreground = ((pixels - pixels[:, :, :1, :1]).abs().sum(dim=1, keepdim=True) > 0.1).to(pixels.dtype)
    return 1 + FOREGROUND_WEIGHT * F.adaptive_max_pool2d(foreground, latent_size)


def encoded_batch(vae, seed: int, step: int,
                  generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Batch `step`'s pixels, latents (scaled as the pipeline's) and captions: this process's
    share of BATCH // NOISE_DRAWS images, each repeated NOISE_DRAWS times."""
    batch = shapes_batch(seed, step, BATCH // NOISE_DRAWS, trained.TRAIN_SIZES, vae.device)
    with torch.no_grad():
        latents = vae.encode(batch.pixels).latent_dist.sample(generator) * vae.config.scaling_factor
    repeat = (NOISE_DRAWS, 1, 1, 1)
    return batch.pixels.repeat(repeat), latents.repeat(repeat), batch.captions * NOISE_DRAWS


def train_unet(seed: int, steps: int, out: Path, device: str = "cpu", start: int = 0, lr: float = LR) -> Report:
    """Train shapes-unet into `out`; from data step `start` > 0, on from the weights there."""
    generator = seed_everything(seed, device, start)
    vae = trained.load_vae(out).requires_grad_(False).to(device)
    model = torch.nn.ModuleDict(
        {"unet": trained.unet(), "text_encoder": trained.text_encoder(with_projection=False, layers=2)}
    ).to(device)
    if start:
        trained.load_weights(dict(model.items()), "shapes-unet", out)
    processors = model["unet"].attn_processors  # the pipeline's own, put back after training
    recorder = record_cross_attention(model["unet"])
    pipe = shapes_sd(vae, model["text_encoder"], model["unet"])
    alphas = pipe.scheduler.alphas_cumprod.to(device)

    def loss_of(step: int) -> torch.Tensor:
        pixels, latents, captions = encoded_batch(vae, seed, step, generator)
        captions = drop_captions(captions, generator)
        embeds = pipe.encode_prompt(captions, device, 1, False)[0]
        weights = foreground_weights(pixels, tuple(latents.shape[2:]))
        loss = denoising_loss(model["unet"], latents, embeds, alphas, generator, weights=weights)
        maps, recorder.maps = recorder.maps, []
        return loss + GROUNDING_WEIGHT * grounding_loss(maps, pixels, captions)

    kept, report = train("unet", model, loss_of, Schedule(steps=steps, lr=lr), seed, start)
    kept["unet"].set_attn_processor(processors)
    if is_writer():
        trained.save_weights({"unet": kept["unet"], "text_encoder": kept["text_encoder"]}, "shapes-unet", out)
    return report
