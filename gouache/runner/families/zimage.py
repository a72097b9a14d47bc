"""Z-Image (`ZImagePipeline`): a single-stream DiT whose forward takes a list of images and a list
of prompt states, each of its own size and length (it pads them to its own multiples of 32 and
masks the padding): one forward takes any mix of sizes as it is, with no packing of ours.

The pipeline's conventions, kept here: latents stay float32 (the denoiser gets them in its
dtype); the model's time runs the other way ((1000 - t) / 1000) and it predicts the negated
velocity; guidance above 0 (not 1) runs CFG, as pos + g (pos - neg); prompts are Qwen3's chat
template, the encoder's second-to-last hidden states of the real tokens only.
"""

from __future__ import annotations

import torch
from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps
from diffusers.pipelines.z_image.pipeline_z_image import get_default_z_image_sigmas

from gouache.block_cache.blocks import CachedForward
from gouache.request import ImageRequest
from gouache.runner.families.base import pad_cat, row_timesteps
from gouache.runner.families.dit import FlowFamily
from gouache.runner.sampler import DenoiseState

SEQ_MULTIPLE = 32  # the transformer pads each image's tokens and each caption to a multiple of this


class ZImageFamily(FlowFamily):
    name = "zimage"

    def encode_text(self, request: ImageRequest, rows: int) -> dict[str, torch.Tensor]:
        """[negative, positive] prompt states padded to the longer, and each row's length."""
        positive, negative = self.encode_prompt(
            request, rows, prompt=request.prompt, device=self.device, do_classifier_free_guidance=rows == 2,
            negative_prompt=request.negative_prompt,
        )
        embeds = [positive[0]] if rows == 1 else [negative[0], positive[0]]
        lengths = [len(e) for e in embeds]
        return {"prompt_embeds": pad_cat(embeds, max(lengths)),
                "text_lengths": torch.tensor(lengths)}  # on the host: each step's forward reads it

    def guide(self, state: DenoiseState, uncond: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        cond, uncond = cond.float(), uncond.float()
        return cond + state.request.guidance_scale * (cond - uncond)

    def set_timesteps(self, state: DenoiseState) -> torch.Tensor:
        steps, config = state.request.num_inference_steps, self.pipe.scheduler.config
        h, w = self.token_shape(state)
        mu = calculate_shift(h * w, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                             config.get("base_shift", 0.5), config.get("max_shift", 1.15))
        timesteps, _ = retrieve_timesteps(state.scheduler, steps, self.device, sigmas=get_default_z_image_sigmas(steps),
                                          mu=mu)
        state.scheduler.set_begin_index(0)
        return timesteps

    def initial_latents(self, state: DenoiseState) -> torch.Tensor:
        """float32 noise after the original's sample, as ZImageInpaintPipeline draws them."""
        r = state.request
        if state.edit is not None:
            image_latents = self.encode_original(state, state.edit.pixels).float()
        noise = self.pipe.prepare_latents(1, self.denoiser.in_channels, r.height, r.width, torch.float32, self.device,
                                          state.generator)
        if state.edit is not None:
            self.finish_edit(state, image_latents, noise, noise.shape[2:])
        return noise

    def token_count(self, state: DenoiseState) -> int:
        return (state.latents.shape[2] // 2) * (state.latents.shape[3] // 2)

    def to_vae_latents(self, latents: torch.Tensor, state: DenoiseState) -> torch.Tensor:
        return self.unscale(latents.to(self.pipe.vae.dtype))

    # -- the forward ------------------------------------------------------------------------

    @torch.no_grad()
    def predict(self, states: list[DenoiseState], patched: bool = False, blocks=None) -> list[torch.Tensor]:
        """One forward of every state, whatever their sizes."""
        outputs = self.denoise(*self.forward_inputs(states))
        out, start = [], 0
        for state in states:
            rows = outputs[start: start + state.rows]
            out.append(-torch.stack(rows).squeeze(2).float())  # the model predicts the negated velocity
            start += state.rows
        return out

    def forward_inputs(self, states: list[DenoiseState]) -> tuple[dict, dict]:
        captions = [e[:n] for s in states for e, n in zip(s.cond["prompt_embeds"], s.cond["text_lengths"].tolist())]
        return ({
            "x": [s.latents[0].to(self.dtype)[:, None] for s in states for _ in range(s.rows)],  # [C, 1, h, w] each
            "t": (1000 - row_timesteps(states)) / 1000,
            "cap_feats": captions,
        }, {})

    def forward(self, states: list[DenoiseState]) -> torch.Tensor:
        return torch.cat(self.predict(states))

    def row_maps(self, states: list[DenoiseState], patched: bool) -> dict[int, torch.Tensor] | None:
        """The forward's rows (its padded batches), and the rows of each image token and caption
        token where the embedders take them all concatenated (each padded to SEQ_MULTIPLE)."""
        rows = [(s, i) for s in states for i in range(s.rows)]
        tokens = [_padded(self.token_count(s)) for s, _ in rows]
        text = [_padded(int(s.cond["text_lengths"][i])) for s, i in rows]
        forward_rows = torch.arange(len(rows))
        maps: dict[int, torch.Tensor] = {}
        for index in (forward_rows, forward_rows.repeat_interleave(torch.tensor(tokens)),
                      forward_rows.repeat_interleave(torch.tensor(text))):
            if not torch.equal(maps.setdefault(len(index), index), index):
                return None  # two kinds of rows of one size: a hook could not tell them apart
        return maps

    def predict_patched(self, states: list[DenoiseState], whole_batches: bool = True,
                        blocks: CachedForward | None = None) -> list[torch.Tensor]:
        return self.predict(states)


def _padded(length: int) -> int:
    return length + (-length) % SEQ_MULTIPLE
