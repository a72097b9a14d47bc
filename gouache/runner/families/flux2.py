"""FLUX.2 [klein] (`Flux2KleinPipeline`): an MMDiT over 2x2-patchified latents packed as tokens
with 4-axis ids (time, row, column, layer), a Qwen3 text encoder (three hidden states stacked,
every prompt padded to 512 tokens), CFG against an empty prompt unless the model is
step-distilled.

Edits use reference images as the pipeline does: every upload of an edit, the first at the
request's size and the others at their own (at most 1 MP, cropped to the size step), enters as
reference tokens after the image's own (the VAE's mode, normalised by its batch-norm statistics;
ids at times 10, 20, ...). An edit without a mask is an instruction edit; one with a mask is
`Flux2KleinInpaintPipeline`'s, the original its own first reference. A forward's requests must
agree on their tokens, so a step runs one forward per image size and reference layout.
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu
from PIL import Image

from gouache.request import ImageRequest
from gouache.runner.families.base import per_group, row_timesteps
from gouache.runner.families.dit import PackedFamily
from gouache.runner.sampler import DenoiseState
from gouache.uploads import Upload

REFERENCE_AREA = 1024 * 1024  # a larger reference is scaled down to this many pixels, as the pipeline does


class Flux2Family(PackedFamily):
    name = "flux2"
    mixes_sizes = False

    def uses_cfg(self, request: ImageRequest) -> bool:
        return request.guidance_scale > 1.0 and not self.pipe.config.is_distilled

    @torch.no_grad()
    def prepare(self, request: ImageRequest, upload: Upload | None = None, text=()) -> DenoiseState:
        """A masked edit blends as FLUX.1's do; any edit's uploads become its reference tokens."""
        state = super().prepare(request, upload and upload.masked(), text)
        if upload is not None:
            pictures = [self._condition(picture) for picture in (upload.image, *upload.references)]
            latents = [self.pipe._encode_vae_image(p, state.generator) for p in pictures]  # the mode: no draw
            ids = self.pipe._prepare_image_ids(latents).to(self.device)
            state.cond["reference"] = torch.cat([self.pipe._pack_latents(x) for x in latents], dim=1)
            state.cond["image_ids"] = torch.cat([state.cond["image_ids"], ids], dim=1)
            # the references' token grids, in order (what their ids follow), on the host: each step's layout reads it
            state.cond["reference_shapes"] = torch.tensor([tuple(x.shape[-2:]) for x in latents])
        return state

    def _condition(self, picture: np.ndarray) -> torch.Tensor:
        """An upload as the pipeline conditions on it: at most REFERENCE_AREA pixels, cropped to the
        size step, [1, 3, h, w] in [-1, 1]."""
        pil = Image.fromarray(picture)
        if pil.width * pil.height > REFERENCE_AREA:
            pil = self.pipe.image_processor._resize_to_target_area(pil, REFERENCE_AREA)
        step = self.vae_scale * 2
        height, width = pil.height // step * step, pil.width // step * step
        pixels = self.pipe.image_processor.preprocess(pil, height=height, width=width, resize_mode="crop")
        return pixels.to(self.device, self.pipe.vae.dtype)

    def encode_text(self, request: ImageRequest, rows: int) -> dict[str, torch.Tensor]:
        """[negative, positive] prompt states (the negative the pipeline's empty prompt unless the
        request names one) and the text's ids."""
        prompts = [request.prompt] if rows == 1 else [request.negative_prompt or "", request.prompt]
        embeds = self.cached_text(request, rows, lambda: tuple(
            self.pipe.encode_prompt(prompt=p, device=self.device, num_images_per_prompt=1)[0] for p in prompts))
        return {"prompt_embeds": torch.cat(embeds),
                "text_ids": self.pipe._prepare_text_ids(embeds[0]).to(self.device)}

    def shift(self, state: DenoiseState) -> float:
        h, w = self.token_shape(state)
        return compute_empirical_mu(image_seq_len=h * w, num_steps=state.request.num_inference_steps)

    def noise(self, state: DenoiseState, channels: int) -> torch.Tensor:
        r = state.request
        noise, state.cond["image_ids"] = self.pipe.prepare_latents(1, channels, r.height, r.width, self.dtype,
                                                                   self.device, state.generator)
        return noise

    def encode_original(self, state: DenoiseState, pixels: torch.Tensor) -> torch.Tensor:
        """The VAE's mode, patchified and normalised (no draw from the generator)."""
        return self.pipe._encode_vae_image(pixels, state.generator)

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        return self.pipe._pack_latents(latents)

    def latent_layout(self, grid: torch.Tensor) -> torch.Tensor:
        channels = self.pipe.transformer.config.in_channels // 4
        return self.pack(self.pipe._patchify_latents(grid.expand(-1, channels, -1, -1)))

    def to_vae_latents(self, latents: torch.Tensor, state: DenoiseState) -> torch.Tensor:
        """The pipeline's latent output: unpacked by the ids, de-normalised, unpatchified."""
        h, w = self.token_shape(state)
        tokens = state.latents.shape[1]
        grid = self.pipe._unpack_latents_with_ids(latents, state.cond["image_ids"][:, :tokens], h, w)
        vae = self.pipe.vae
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(grid.device, grid.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(grid.device, grid.dtype)
        return self.pipe._unpatchify_latents(grid * std + mean).to(vae.dtype)

    # -- the forward ------------------------------------------------------------------------

    @torch.no_grad()
    def predict(self, states: list[DenoiseState], patched: bool = False, blocks=None) -> list[torch.Tensor]:
        """One forward per image size and reference layout (`forward`)."""
        return per_group(states, _tokens, self.forward)

    def forward(self, states: list[DenoiseState]) -> torch.Tensor:
        """The forward of states of one image size and reference layout: their own tokens' predictions."""
        return self.denoise(*self.forward_inputs(states))[:, : states[0].latents.shape[1]]

    def forward_inputs(self, states: list[DenoiseState]) -> tuple[dict, dict]:
        def tokens(s: DenoiseState) -> torch.Tensor:
            return s.latents if "reference" not in s.cond else torch.cat([s.latents, s.cond["reference"]], dim=1)

        return ({
            "hidden_states": torch.cat([tokens(s) for s in states for _ in range(s.rows)]).to(self.dtype),
            "timestep": row_timesteps(states).to(self.dtype) / 1000,
            "encoder_hidden_states": torch.cat([s.cond["prompt_embeds"] for s in states]),
            "txt_ids": torch.cat([s.cond["text_ids"].expand(s.rows, -1, -1) for s in states]),
            "img_ids": torch.cat([s.cond["image_ids"].expand(s.rows, -1, -1) for s in states]),
        }, {"guidance": None})

    def row_maps(self, states: list[DenoiseState], patched: bool) -> dict[int, torch.Tensor] | None:
        if len({_tokens(s) for s in states}) > 1:
            return None  # several forwards: adapters apply per forward
        return super().row_maps(states, False)

    def predict_patched(self, states: list[DenoiseState], whole_batches: bool = True,
                        blocks=None) -> list[torch.Tensor]:
        return self.predict(states)


def _tokens(state: DenoiseState) -> tuple:
    """What a forward's requests must share: the image's size and its references' grids, in order
    (their tokens' ids)."""
    shapes = state.cond.get("reference_shapes")
    return state.request.height, state.request.width, None if shapes is None else tuple(map(tuple, shapes.tolist()))
