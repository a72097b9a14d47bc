"""Train the shapes DiT (SD3 MMDiT) and its CLIP text encoder together: rectified flow (predict
noise - image) at noise levels drawn logit-normal and shifted like the pipeline's sampler
(shift 3), captions dropped 10 % of the time for classifier-free guidance, and the UNet's token
grounding loss (`grounding.py`) on the image tokens' attention to the text.

The SD3 pipeline appends `max_sequence_length` (256) all-zero T5 tokens to every prompt. Those
tokens stay identical to each other through every block, so attending to 256 of them equals
attending to one with log(256) added to its attention logits: training runs on that one token
(`CollapsedJointAttention`), 2-4x faster, and the weights serve the unmodified pipeline."""

from __future__ import annotations

import inspect
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from diffusers import StableDiffusion3Pipeline
from diffusers.models.attention_processor import Attention

from gouache.models import trained
from gouache.models.zoo import shapes_sd3
from gouache.train.grounding import grounding_loss
from gouache.train.loop import Report, Schedule, flow_sigmas, is_writer, seed_everything, shapes_batch, train
from gouache.train.unet import drop_captions

BATCH = 32
LR = 5e-4
GROUNDING_WEIGHT = 1.0  # the grounding loss's weight against the flow-matching loss, as the UNet's
SHIFT = 3.0  # the training noise levels' shift by default: the pipeline scheduler's (`flow_sigmas`)
# How many zero tokens the pipeline appends in the T5 slot when the model has no T5.
ZERO_TOKENS = inspect.signature(StableDiffusion3Pipeline.encode_prompt).parameters["max_sequence_length"].default


class CollapsedJointAttention:
    """SD3's joint attention (image and text tokens attend to all of both) with an additive bias
    per text key: log(n) on a token that stands for n identical ones, 0 elsewhere. With `record`,
    each call also keeps the image queries' attention probabilities on the text keys, averaged over
    heads ([B, image tokens, text tokens]), for the grounding loss."""

    def __init__(self, record: bool = False) -> None:
        self.maps: list[torch.Tensor] | None = [] if record else None

    def __call__(
        self, attn: Attention, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
        key_bias: torch.Tensor, **_: object,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if any(n is not None for n in (attn.norm_q, attn.norm_k, attn.norm_added_q, attn.norm_added_k)):
            raise ValueError("CollapsedJointAttention has no q/k norms; build the DiT with qk_norm=None")
        batch, image_tokens = hidden_states.shape[:2]

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.view(batch, -1, attn.heads, x.shape[-1] // attn.heads).transpose(1, 2)

        query = torch.cat([heads(attn.to_q(hidden_states)), heads(attn.add_q_proj(encoder_hidden_states))], dim=2)
        key = torch.cat([heads(attn.to_k(hidden_states)), heads(attn.add_k_proj(encoder_hidden_states))], dim=2)
        value = torch.cat([heads(attn.to_v(hidden_states)), heads(attn.add_v_proj(encoder_hidden_states))], dim=2)
        bias = torch.cat([key_bias.new_zeros(image_tokens), key_bias]).view(1, 1, 1, -1)
        if self.maps is None:
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=bias)
        else:
            probs = (query @ key.transpose(-1, -2) * attn.scale + bias).softmax(dim=-1)
            self.maps.append(probs[:, :, :image_tokens, image_tokens:].mean(dim=1))
            out = probs @ value
        out = out.transpose(1, 2).reshape(batch, -1, query.shape[1] * query.shape[-1])
        image, text = out[:, :image_tokens], out[:, image_tokens:]
        image = attn.to_out[1](attn.to_out[0](image))
        if not attn.context_pre_only:
            text = attn.to_add_out(text)
        return image, text


def collapsed_inputs(pipe: StableDiffusion3Pipeline, captions: list[str],
                     device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(prompt embeds with one zero token for the pipeline's ZERO_TOKENS, pooled embeds, key bias)."""
    embeds, _, pooled, _ = pipe.encode_prompt(
        prompt=captions, prompt_2=None, prompt_3=None, device=device, do_classifier_free_guidance=False,
        max_sequence_length=1,
    )
    key_bias = torch.zeros(embeds.shape[1], device=embeds.device)
    key_bias[-1] = math.log(ZERO_TOKENS)
    return embeds, pooled, key_bias


def train_dit(seed: int, steps: int, out: Path, device: str = "cpu", start: int = 0, lr: float = LR,
              shift: float = SHIFT) -> Report:
    """Train shapes-dit into `out`; from data step `start` > 0, on from the weights there. `shift`:
    the training noise levels' (`flow_sigmas`)."""
    generator = seed_everything(seed, device, start)
    vae = trained.load_vae(out).requires_grad_(False).to(device)
    model = torch.nn.ModuleDict(
        {"transformer": trained.dit(), "text_encoder": trained.text_encoder(with_projection=True, layers=3)}
    ).to(device)
    if start:
        trained.load_weights(dict(model.items()), "shapes-dit", out)
    processors = model["transformer"].attn_processors  # the pipeline's own, put back after training
    recorder = CollapsedJointAttention(record=True)
    model["transformer"].set_attn_processor(recorder)
    pipe = shapes_sd3(vae, model["text_encoder"], model["transformer"])
    scale, shift = vae.config.scaling_factor, vae.config.shift_factor

    def loss_of(step: int) -> torch.Tensor:
        batch = shapes_batch(seed, step, BATCH, trained.TRAIN_SIZES, device)
        with torch.no_grad():
            latents = (vae.encode(batch.pixels).latent_dist.sample(generator) - shift) * scale
        captions = drop_captions(batch.captions, generator)
        embeds, pooled, key_bias = collapsed_inputs(pipe, captions, device)
        sigma = flow_sigmas(len(latents), shift, generator, device).view(-1, 1, 1, 1)
        noise = torch.randn(latents.shape, generator=generator, device=device)
        noisy = (1 - sigma) * latents + sigma * noise
        predicted = model["transformer"](
            hidden_states=noisy, encoder_hidden_states=embeds, pooled_projections=pooled,
            timestep=sigma.flatten() * 1000, joint_attention_kwargs={"key_bias": key_bias},
        ).sample
        maps, recorder.maps = recorder.maps, []
        return F.mse_loss(predicted, noise - latents) + GROUNDING_WEIGHT * grounding_loss(maps, batch.pixels, captions)

    kept, report = train("dit", model, loss_of, Schedule(steps=steps, lr=lr), seed, start)
    kept["transformer"].set_attn_processor(processors)
    if is_writer():
        trained.save_weights({"transformer": kept["transformer"], "text_encoder": kept["text_encoder"]},
                             "shapes-dit", out)
    return report
