"""Train the shapes VAE: reconstruction (MSE) plus a small KL term, on 64x64 crops of renders at
64..128 px (the decoder is convolutional, and full 128 px images would cost 4x per step); then
measure the latents' mean and spread for the diffusion models' scale and shift."""

from __future__ import annotations

from pathlib import Path

import torch

from gouache.models import trained
from gouache.train.loop import Report, Schedule, is_writer, seed_everything, shapes_batch, train

CROP = 64
BATCH = 16
LR = 1e-3
KL_WEIGHT = 1e-5  # per latent element, against the per-pixel MSE
STATS_IMAGES = 256


def crops(pixels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A random CROP x CROP window of each image."""
    _, _, h, w = pixels.shape
    ys = torch.randint(0, h - CROP + 1, (len(pixels),), generator=generator, device=generator.device).tolist()
    xs = torch.randint(0, w - CROP + 1, (len(pixels),), generator=generator, device=generator.device).tolist()
    return torch.stack([p[:, y : y + CROP, x : x + CROP] for p, y, x in zip(pixels, ys, xs)])


@torch.no_grad()
def latent_stats(vae, seed: int) -> tuple[float, float]:
    """Mean and standard deviation of latents drawn from the posteriors of STATS_IMAGES full renders
    (drawn, as the diffusion models' training and the pipelines draw them)."""
    generator, values = torch.Generator(vae.device).manual_seed(seed + 1), []
    for step in range(STATS_IMAGES // BATCH):
        batch = shapes_batch(seed + 1, step, BATCH, trained.TRAIN_SIZES, vae.device)  # images training never saw
        values.append(vae.encode(batch.pixels).latent_dist.sample(generator).flatten())
    flat = torch.cat(values)
    return flat.mean().item(), flat.std().item()


def train_vae(seed: int, steps: int, out: Path, device: str = "cpu", lr: float = LR) -> Report:
    generator = seed_everything(seed, device)
    vae = trained.vae().to(device)

    def loss_of(step: int) -> torch.Tensor:
        pixels = crops(shapes_batch(seed, step, BATCH, trained.TRAIN_SIZES, device).pixels, generator)
        posterior = vae.encode(pixels).latent_dist
        reconstruction = vae.decode(posterior.sample(generator)).sample
        kl = posterior.kl().mean() / posterior.mean[0].numel()
        return torch.nn.functional.mse_loss(reconstruction, pixels) + KL_WEIGHT * kl

    kept, report = train("vae", vae, loss_of, Schedule(steps=steps, lr=lr, ema_decay=None), seed)
    if not is_writer():
        return report
    mean, std = latent_stats(kept, seed)
    report.extra.update(latent_mean=mean, latent_std=std)
    trained.save_weights(
        {"vae": kept}, "shapes-vae", out, metadata={"scaling_factor": repr(1 / std), "shift_factor": repr(mean)}
    )
    return report
