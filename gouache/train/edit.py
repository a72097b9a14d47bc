"""Train shapes-edit: FLUX.1 Kontext's transformer at toy size with its CLIP and T5 encoders, on
edit pairs of the shapes world (`gouache.data.edits`). Rectified flow on the target's latents
(noise levels logit-normal, shifted by 3 as the pipeline's sampler is), the source's latents
(the VAE's mode, as Kontext encodes an upload) as reference tokens after the target's, their ids'
first coordinate 1 as `FluxKontextPipeline` makes them; the loss on the target's tokens only,
weighted up on the tokens the edit changes (a shape is a few of an image's tokens: unweighted,
copying the source is most of the loss's answer). Each pair is drawn at NOISE_DRAWS noise levels
in its batch, as the UNet's images are: encoding a pair's two images costs about what the
transformer's training step on it does at 128 px."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from gouache.data.edits import sample_edit
from gouache.data.shapes import Scene, render
from gouache.models import trained
from gouache.models.zoo import shapes_kontext
from gouache.train.loop import Report, Schedule, batch_share, flow_sigmas, is_writer, seed_everything, train

BATCH = 32
NOISE_DRAWS = 2  # noise levels per pair in a batch: BATCH // NOISE_DRAWS pairs are encoded
LR = 5e-4
SHIFT = 3.0  # the pipeline scheduler's shift, as the DiT's
CHANGE_WEIGHT = 4.0  # extra loss weight on the tokens where source and target differ


def edit_batch(seed: int, step: int, batch: int, sizes: tuple[tuple[int, int], ...], device: torch.device | str,
               restyle: Callable[[Scene], Scene] | None = None) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """This process's share of batch `step` of run `seed`: (source pixels, target pixels) [B, 3, H, W]
    in [-1, 1] of one size drawn from `sizes` (the targets drawn restyled by `restyle`), and the
    instructions."""
    rng, share = batch_share("train-edit", seed, step, batch)
    width, height = rng.choice(sizes)
    edits = [sample_edit(rng) for _ in range(share)]
    seeds = [rng.getrandbits(32) for _ in edits]

    def pixels(scenes) -> torch.Tensor:
        images = np.stack([render(scene, width, height, k) for scene, k in zip(scenes, seeds)])
        return torch.from_numpy(images).to(device).permute(0, 3, 1, 2).float() / 127.5 - 1.0

    targets = [e.target if restyle is None else restyle(e.target) for e in edits]
    return pixels([e.source for e in edits]), pixels(targets), [e.instruction for e in edits]


def change_weights(source: torch.Tensor, target: torch.Tensor, tokens_hw: tuple[int, int]) -> torch.Tensor:
    """[B, tokens, 1]: 1 + CHANGE_WEIGHT on the tokens whose pixels the edit changed, 1 elsewhere."""
    changed = ((source - target).abs().sum(dim=1, keepdim=True) > 0.1).to(source.dtype)
    return (1 + CHANGE_WEIGHT * F.adaptive_max_pool2d(changed, tokens_hw)).flatten(1).unsqueeze(-1)


def train_edit(seed: int, steps: int, out: Path, device: str = "cpu", start: int = 0, lr: float = LR) -> Report:
    """Train shapes-edit into `out`; from data step `start` > 0, on from the weights there."""
    generator = seed_everything(seed, device, start)
    vae = trained.load_vae(out).requires_grad_(False).to(device)
    clip, t5 = trained.edit_text_encoders()
    model = torch.nn.ModuleDict({"transformer": trained.edit_transformer(), "text_encoder": clip,
                                 "text_encoder_2": t5}).to(device)
    if start:
        trained.load_weights(dict(model.items()), "shapes-edit", out)
    pipe = shapes_kontext(vae, model["text_encoder"], model["text_encoder_2"], model["transformer"])

    def loss_of(step: int) -> torch.Tensor:
        return edit_loss(pipe, *edit_batch(seed, step, BATCH // NOISE_DRAWS, trained.TRAIN_SIZES, device), generator)

    kept, report = train("edit", model, loss_of, Schedule(steps=steps, lr=lr), seed, start)
    if is_writer():
        trained.save_weights(dict(kept.items()), "shapes-edit", out)
    return report


def frozen_edit_pipeline(out: Path, device: str):
    """shapes-edit's pipeline from the weights in `out`, frozen on `device`: what an adapter of its
    transformer trains against."""
    transformer, clip, t5 = trained.load_edit(out)
    pipe = shapes_kontext(trained.load_vae(out), clip, t5, transformer)
    for component in (pipe.vae, clip, t5, transformer):
        component.requires_grad_(False).to(device)
    return pipe


def edit_loss(pipe, source: torch.Tensor, target: torch.Tensor, instructions: list[str],
              generator: torch.Generator) -> torch.Tensor:
    """The rectified-flow loss of `pipe`'s transformer on one batch of edit pairs, each at
    NOISE_DRAWS noise levels (the VAE frozen; the text encoders train when they require grads)."""
    vae, device = pipe.vae, source.device
    scale, shift = vae.config.scaling_factor, vae.config.shift_factor
    with torch.no_grad():
        reference = (vae.encode(source).latent_dist.mode() - shift) * scale
        latents = (vae.encode(target).latent_dist.sample(generator) - shift) * scale
    repeat = (NOISE_DRAWS, 1, 1, 1)
    source, target, reference, latents = (x.repeat(repeat) for x in (source, target, reference, latents))
    instructions = instructions * NOISE_DRAWS
    b, c, h, w = latents.shape
    embeds, pooled, text_ids = pipe.encode_prompt(prompt=instructions, prompt_2=None, device=device,
                                                  max_sequence_length=trained.EDIT_TEXT_LENGTH)
    sigma = flow_sigmas(b, SHIFT, generator, device).view(-1, 1, 1, 1)
    noise = torch.randn(latents.shape, generator=generator, device=device)
    noisy = pipe._pack_latents((1 - sigma) * latents + sigma * noise, b, c, h, w)
    ids = pipe._prepare_latent_image_ids(b, h // 2, w // 2, device, latents.dtype)
    reference_ids = ids.clone()
    reference_ids[:, 0] = 1
    predicted = pipe.transformer(
        hidden_states=torch.cat([noisy, pipe._pack_latents(reference, b, c, h, w)], dim=1),
        timestep=sigma.flatten(), guidance=None, pooled_projections=pooled, encoder_hidden_states=embeds,
        txt_ids=text_ids, img_ids=torch.cat([ids, reference_ids]), return_dict=False,
    )[0][:, : noisy.shape[1]]
    error = (predicted - pipe._pack_latents(noise - latents, b, c, h, w)).pow(2)
    return (error * change_weights(source, target, (h // 2, w // 2))).mean()
