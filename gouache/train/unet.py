"""Train the shapes UNet and its CLIP text encoder together: velocity prediction on the SD1.5 noise
schedule the pipeline samples with, min-SNR weighting, captions dropped 10 % of the time for
classifier-free guidance, a little offset noise so that plain black and white backgrounds are
reachable from zero-mean noise. Each image is drawn at NOISE_DRAWS noise levels in its batch: the
VAE encoder costs as much as the UNet's training step at 128 px, and this halves its share."""

from __future__ import annotations

from pathlib import Path

import torch

from gouache.runner import trained
from gouache.runner.models import shapes_sd
from gouache.train.loop import Report, Schedule, seed_everything, shapes_batch, train

BATCH = 32
NOISE_DRAWS = 2  # noise levels per image in a batch: BATCH // NOISE_DRAWS images are encoded
LR = 1e-3
UNCONDITIONAL = 0.1  # share of captions replaced by "" (the pipelines' negative prompt)
OFFSET_NOISE = 0.1  # std of a per-image, per-channel constant added to the noise
MIN_SNR = 5.0  # loss weight min(SNR, MIN_SNR) / (SNR + 1) for velocity, / SNR for noise (Hang et al. 2023)


def drop_captions(captions: list[str], generator: torch.Generator) -> list[str]:
    keep = torch.rand(len(captions), generator=generator) >= UNCONDITIONAL
    return [c if k else "" for c, k in zip(captions, keep.tolist())]


def denoising_loss(
    unet: torch.nn.Module, latents: torch.Tensor, embeds: torch.Tensor, alphas: torch.Tensor,
    generator: torch.Generator, condition: torch.Tensor | None = None,
) -> torch.Tensor:
    """Min-SNR-weighted velocity loss (epsilon loss where trained.UNET_PREDICTION says so) at uniform
    timesteps; `condition` (channels the UNet reads after the noisy latents, as an inpainting UNet
    does) is concatenated as given."""
    noise = torch.randn(latents.shape, generator=generator)
    noise += OFFSET_NOISE * torch.randn((*latents.shape[:2], 1, 1), generator=generator)
    t = torch.randint(0, len(alphas), (len(latents),), generator=generator)
    alpha = alphas[t].view(-1, 1, 1, 1)
    noisy = alpha.sqrt() * latents + (1 - alpha).sqrt() * noise
    inputs = noisy if condition is None else torch.cat([noisy, condition], dim=1)
    predicted = unet(inputs, t, encoder_hidden_states=embeds).sample
    target, weight = prediction_target(latents, noise, alphas[t])
    return (weight * (predicted - target).pow(2).mean(dim=(1, 2, 3))).mean()


def prediction_target(latents: torch.Tensor, noise: torch.Tensor, alpha: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the UNet should output for `latents` noised by `noise` at cumulative alphas `alpha`
    [B] (trained.UNET_PREDICTION: the velocity or the noise), and each item's min-SNR loss weight."""
    snr = alpha / (1 - alpha)
    if trained.UNET_PREDICTION == "v_prediction":
        a = alpha.view(-1, 1, 1, 1)
        return a.sqrt() * noise - (1 - a).sqrt() * latents, snr.clamp(max=MIN_SNR) / (snr + 1)
    return noise, snr.clamp(max=MIN_SNR) / snr


def encoded_batch(vae, seed: int, step: int, generator: torch.Generator) -> tuple[torch.Tensor, list[str]]:
    """Batch `step`'s latents (scaled as the pipeline's) and captions: BATCH // NOISE_DRAWS
    images, each repeated NOISE_DRAWS times."""
    batch = shapes_batch(seed, step, BATCH // NOISE_DRAWS, trained.TRAIN_SIZES)
    with torch.no_grad():
        latents = vae.encode(batch.pixels).latent_dist.sample(generator) * vae.config.scaling_factor
    return latents.repeat(NOISE_DRAWS, 1, 1, 1), batch.captions * NOISE_DRAWS


def train_unet(seed: int, steps: int, out: Path) -> Report:
    generator = seed_everything(seed)
    vae = trained.load_vae(out).requires_grad_(False)
    model = torch.nn.ModuleDict(
        {"unet": trained.unet(), "text_encoder": trained.text_encoder(with_projection=False, layers=2)}
    )
    pipe = shapes_sd(vae, model["text_encoder"], model["unet"])
    alphas = pipe.scheduler.alphas_cumprod

    def loss_of(step: int) -> torch.Tensor:
        latents, captions = encoded_batch(vae, seed, step, generator)
        embeds = pipe.encode_prompt(drop_captions(captions, generator), "cpu", 1, False)[0]
        return denoising_loss(model["unet"], latents, embeds, alphas, generator)

    kept, report = train("unet", model, loss_of, Schedule(steps=steps, lr=LR), seed)
    trained.save_weights({"unet": kept["unet"], "text_encoder": kept["text_encoder"]}, "shapes-unet", out)
    return report
