"""Qwen-Image (`QwenImagePipeline`): an MMDiT over 2x2-packed latents like Flux's, conditioned on
a Qwen2.5-VL's hidden states, with true classifier-free guidance and a 3D VAE of one frame.

Prompts encode to as many tokens as they have (the pipeline keeps no padding), so a forward's
rows pad their text to the longest and mask the padding (`encoder_hidden_states_mask`, which the
model's attention takes; a forward of one length passes none, as the pipeline does; under
--compile the text is padded to a multiple of `TEXT_BUCKET`). The model's
RoPE is one image size's, so a step runs one forward per image size: mixed sizes share a step
but not a forward, and no packing, block cache, templates or sequence parallelism apply yet
(`UNSERVED`; docs/architecture.md).
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

from gouache.block_cache.blocks import CachedForward
from gouache.request import ImageRequest
from gouache.runner.families.base import pad_cat, per_group, row_timesteps
from gouache.runner.families.dit import FlowFamily
from gouache.runner.sampler import DenoiseState

# What the pipeline's true CFG needs and a request may leave out: its examples' negative prompt
DEFAULT_NEGATIVE = " "
# Under --compile a forward's text is padded to a multiple of this many tokens: prompts of
# every length up to it share the warmed graphs (one per bucket of rows and of text)
TEXT_BUCKET = 64


class QwenImageFamily(FlowFamily):
    name = "qwenimage"
    mixes_sizes = False

    def encode_text(self, request: ImageRequest, rows: int) -> dict[str, torch.Tensor]:
        """[negative, positive] prompt states padded to the longer, and each row's length."""
        prompts = [request.prompt] if rows == 1 else [request.negative_prompt or DEFAULT_NEGATIVE, request.prompt]
        embeds = self.cached_text(request, rows, lambda: tuple(
            self.pipe.encode_prompt(prompt=p, device=self.device, num_images_per_prompt=1)[0] for p in prompts))
        lengths = [e.shape[1] for e in embeds]
        return {"prompt_embeds": pad_cat([e[0] for e in embeds], max(lengths)),
                "text_lengths": torch.tensor(lengths, device=self.device)}

    def guide(self, state: DenoiseState, uncond: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """The pipeline's true CFG: the guided prediction rescaled per token to the positive's norm."""
        combined = super().guide(state, uncond, cond)
        return combined * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True))

    def set_timesteps(self, state: DenoiseState) -> torch.Tensor:
        steps, config = state.request.num_inference_steps, self.pipe.scheduler.config
        h, w = self.token_shape(state)
        mu = calculate_shift(h * w, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                             config.get("base_shift", 0.5), config.get("max_shift", 1.15))
        timesteps, _ = retrieve_timesteps(state.scheduler, steps, self.device,
                                          sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
        state.scheduler.set_begin_index(0)
        return timesteps

    def initial_latents(self, state: DenoiseState, pixels, pixel_mask) -> torch.Tensor:
        """The noise after the original's sample, as QwenImageInpaintPipeline draws them."""
        r = state.request
        if pixels is not None:
            image_latents = self.pack(self.encode_original(state, pixels))
        channels = self.pipe.transformer.config.in_channels // 4
        noise = self.pipe.prepare_latents(1, channels, r.height, r.width, self.dtype, self.device, state.generator)
        if pixels is not None:
            state.edit = self.make_edit(pixels, pixel_mask, image_latents, noise, self.latent_hw(r))
            state.edit.latent_mask = self.pack(state.edit.latent_mask.expand(-1, channels, -1, -1))
        return noise

    def encode_pixels(self, pixels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """[1, C, h, w] normalised latents of [1, 3, H, W] pixels (a one-frame video to the VAE)."""
        latents = self.latent_dist(pixels[:, :, None]).sample(generator)
        mean, inverse_std = self._statistics(latents)
        return ((latents - mean) * inverse_std)[:, :, 0]

    def to_vae_latents(self, latents: torch.Tensor, state: DenoiseState) -> torch.Tensor:
        r = state.request
        latents = self.pipe._unpack_latents(latents, r.height, r.width, self.vae_scale)
        mean, inverse_std = self._statistics(latents)
        return latents / inverse_std + mean

    def vae_decode(self, latents: torch.Tensor) -> torch.Tensor:
        return self.pipe.vae.decode(latents, return_dict=False)[0][:, :, 0]  # the one frame

    def _statistics(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The VAE's per-channel latent mean and 1/std, shaped [1, C, 1, 1, 1] as the pipelines use them."""
        config = self.pipe.vae.config
        mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        inverse_std = 1.0 / torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1).to(latents.device,
                                                                                                latents.dtype)
        return mean, inverse_std

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        b, c, h, w = latents.shape
        return self.pipe._pack_latents(latents, b, c, h, w)

    def token_mask(self, state: DenoiseState) -> torch.Tensor:
        return state.edit.latent_mask[0].amax(-1) > 0  # packed [1, tokens, C]

    def token_count(self, state: DenoiseState) -> int:
        return state.latents.shape[1]

    # -- the forward ------------------------------------------------------------------------

    @torch.no_grad()
    def predict(self, states: list[DenoiseState], patched: bool = False, cache=None, templates=None
                ) -> list[torch.Tensor]:
        """One forward per token grid (`forward`)."""
        return per_group(states, self.token_shape, self.forward)

    def forward_inputs(self, states: list[DenoiseState]) -> tuple[dict, dict]:
        """Inputs of one token grid's forward; text padded to the longest row, the padding masked."""
        lengths = torch.cat([s.cond["text_lengths"] for s in states])
        longest = int(lengths.max())
        if self.compiled is not None:  # a graph per text bucket, not per prompt length
            longest = -(-longest // TEXT_BUCKET) * TEXT_BUCKET
        text = pad_cat([e for s in states for e in s.cond["prompt_embeds"]], longest)
        mask = None
        if bool((lengths < longest).any()):
            mask = torch.arange(longest, device=lengths.device)[None] < lengths[:, None]
        h, w = self.token_shape(states[0])
        return ({
            "hidden_states": torch.cat([torch.cat([s.latents] * s.rows) for s in states]),
            "timestep": row_timesteps(states).to(self.dtype) / 1000,
            "encoder_hidden_states": text,
            "encoder_hidden_states_mask": mask,
            "img_shapes": [[(1, h, w)]] * len(text),
        }, {})

    def row_maps(self, states: list[DenoiseState], patched: bool) -> dict[int, torch.Tensor] | None:
        if len({self.token_shape(s) for s in states}) > 1:
            return None  # several forwards: adapters apply per forward
        return super().row_maps(states, False)

    def predict_patched(self, states: list[DenoiseState], whole_batches: bool = True,
                        cache: CachedForward | None = None) -> list[torch.Tensor]:
        return self.predict(states)


