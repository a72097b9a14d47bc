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
from diffusers import QwenImageEditPlusPipeline
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions
from PIL import Image

from gouache.block_cache.blocks import CachedForward
from gouache.request import ImageRequest
from gouache.runner.conditioning import pixels_digest
from gouache.runner.families.base import latent_statistics, pad_cat, per_group, row_timesteps
from gouache.runner.families.dit import PackedFamily
from gouache.runner.sampler import DenoiseState
from gouache.uploads import Upload

# What the pipeline's true CFG needs and a request may leave out: its examples' negative prompt
DEFAULT_NEGATIVE = " "
# Under --compile a forward's text is padded to a multiple of this many tokens: prompts of
# every length up to it share the warmed graphs (one per bucket of rows and of text)
TEXT_BUCKET = 64
REFERENCE_AREA = 1024 * 1024  # the edit pipelines' reference images, and Edit's vision input, in pixels
EDIT_PLUS_VISION_AREA = 384 * 384  # Edit-Plus's vision input, in pixels


class QwenImageFamily(PackedFamily):
    name = "qwenimage"
    mixes_sizes = False

    def encode_text(self, request: ImageRequest, rows: int) -> dict[str, torch.Tensor]:
        """[negative, positive] prompt states padded to the longer, and each row's length."""
        prompts = [request.prompt] if rows == 1 else [request.negative_prompt or DEFAULT_NEGATIVE, request.prompt]
        embeds = self.cached_text(request, rows, lambda: tuple(self.encode_one(p) for p in prompts))
        lengths = [e.shape[1] for e in embeds]
        return {"prompt_embeds": pad_cat([e[0] for e in embeds], max(lengths)),
                "text_lengths": torch.tensor(lengths)}  # on the host: each step's layout reads it

    def encode_one(self, prompt: str) -> torch.Tensor:
        """One prompt's states [1, L, D], as the pipeline's `encode_prompt` gives them."""
        return self.pipe.encode_prompt(prompt=prompt, device=self.device, num_images_per_prompt=1)[0]

    def guide(self, state: DenoiseState, uncond: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """The pipeline's true CFG: the guided prediction rescaled per token to the positive's norm."""
        combined = super().guide(state, uncond, cond)
        return combined * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True))

    def noise(self, state: DenoiseState, channels: int) -> torch.Tensor:
        r = state.request
        return self.pipe.prepare_latents(1, channels, r.height, r.width, self.dtype, self.device, state.generator)

    def encode_pixels(self, pixels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """[1, C, h, w] normalised latents of [1, 3, H, W] pixels (a one-frame video to the VAE)."""
        latents = self.latent_dist(pixels[:, :, None]).sample(generator)
        mean, inverse_std = latent_statistics(self.pipe.vae, latents)
        return ((latents - mean) * inverse_std)[:, :, 0]

    def to_vae_latents(self, latents: torch.Tensor, state: DenoiseState) -> torch.Tensor:
        r = state.request
        latents = self.pipe._unpack_latents(latents, r.height, r.width, self.vae_scale)
        mean, inverse_std = latent_statistics(self.pipe.vae, latents)
        return latents / inverse_std + mean

    def vae_decode(self, latents: torch.Tensor) -> torch.Tensor:
        return self.pipe.vae.decode(latents, return_dict=False)[0][:, :, 0]  # the one frame

    # -- the forward ------------------------------------------------------------------------

    @torch.no_grad()
    def predict(self, states: list[DenoiseState], patched: bool = False, blocks=None) -> list[torch.Tensor]:
        """One forward per token layout (`forward`)."""
        return per_group(states, self.forward_key, self.forward)

    def forward_key(self, state: DenoiseState) -> tuple:
        """What a forward's requests must share: their token grids (one RoPE a forward)."""
        return self.token_shape(state)

    def tokens(self, state: DenoiseState) -> torch.Tensor:
        """A row's image tokens [1, S, C] (an edit's reference tokens after its own)."""
        return state.latents

    def img_shapes(self, state: DenoiseState) -> list[tuple[int, int, int]]:
        """The (frames, height, width) token grid of each image in a row's tokens."""
        return [(1, *self.token_shape(state))]

    def forward(self, states: list[DenoiseState]) -> torch.Tensor:
        """The forward of states of one token layout: each prediction's own tokens."""
        return self.denoise(*self.forward_inputs(states))[:, : states[0].latents.shape[1]]

    def forward_inputs(self, states: list[DenoiseState]) -> tuple[dict, dict]:
        """Inputs of one token layout's forward; text padded to the longest row, the padding masked."""
        lengths = torch.cat([s.cond["text_lengths"] for s in states])
        longest = int(lengths.max())
        if self.compiled is not None:  # a graph per text bucket, not per prompt length
            longest = -(-longest // TEXT_BUCKET) * TEXT_BUCKET
        text = pad_cat([e for s in states for e in s.cond["prompt_embeds"]], longest)
        valid = None  # True at each row's real text tokens
        if bool((lengths < longest).any()):
            valid = torch.arange(longest, device=self.device)[None] < lengths.to(self.device)[:, None]
        return ({
            "hidden_states": torch.cat([torch.cat([self.tokens(s)] * s.rows) for s in states]),
            "timestep": row_timesteps(states).to(self.dtype) / 1000,
            "encoder_hidden_states": text,
            "encoder_hidden_states_mask": valid,
            # one list for every row (a forward's rows share one layout): what the compiled graph was traced with
            "img_shapes": [self.img_shapes(states[0])] * len(text),
        }, {})

    def row_maps(self, states: list[DenoiseState], patched: bool) -> dict[int, torch.Tensor] | None:
        if len({self.forward_key(s) for s in states}) > 1:
            return None  # several forwards: adapters apply per forward
        return super().row_maps(states, False)

    def predict_patched(self, states: list[DenoiseState], whole_batches: bool = True,
                        blocks: CachedForward | None = None) -> list[torch.Tensor]:
        return self.predict(states)


class QwenImageEditFamily(QwenImageFamily):
    """Qwen-Image-Edit (`QwenImageEditPipeline`) and Edit-Plus (`QwenImageEditPlusPipeline`, up to
    3 images): instruction edits. The Qwen2.5-VL encoder reads the prompt with the uploads (each at
    a megapixel for Edit, at 384x384's area for Edit-Plus, keeping its aspect); each upload's VAE
    mode at a megapixel enters as reference tokens after the image's own, a grid of its own in the
    model's RoPE. A masked edit is QwenImageEditInpaintPipeline's: Qwen-Image's blending, the
    original's sampled latents (at the request's size) its first reference. A "generation" (the
    server's warm-up and probe; the API refuses them) edits a black image."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._vision: list[Image.Image] = []  # the uploads the VL encoder reads with the prompt being encoded
        self.plus = isinstance(self.pipe, QwenImageEditPlusPipeline)

    @torch.no_grad()
    def prepare(self, request: ImageRequest, upload: Upload | None = None, text=()) -> DenoiseState:
        if upload is None:
            upload = Upload(np.zeros((request.height, request.width, 3), np.uint8))
        pictures = [Image.fromarray(picture) for picture in (upload.image, *upload.references)]
        vision_area = EDIT_PLUS_VISION_AREA if self.plus else REFERENCE_AREA
        self._vision = [self.pipe.image_processor.resize(p, *_dimensions(vision_area, p)) for p in pictures]
        try:
            state = super().prepare(request, upload.masked(), text)
        finally:
            self._vision = []
        latents, shapes = [], []
        for k, picture in enumerate(pictures):
            if k == 0 and state.edit is not None:  # a masked edit: its sampled original, at the request's size
                latents.append(state.edit.image_latents)
                shapes.append(self.token_shape(state))
                continue
            height, width = _dimensions(REFERENCE_AREA, picture)
            source = picture if self.plus else self.pipe.image_processor.resize(picture, height, width)
            pixels = self.pipe.image_processor.preprocess(source, height, width).unsqueeze(2)
            encoded = self.pipe._encode_vae_image(pixels.to(self.device, self.pipe.vae.dtype), state.generator)
            latents.append(self.pack(encoded[:, :, 0]))  # the mode: no draw
            shapes.append((height // self.token_pixels, width // self.token_pixels))
        state.cond["reference"] = torch.cat(latents, dim=1)
        state.cond["reference_shapes"] = torch.tensor(shapes)  # on the host: each step's layout reads it
        return state

    def noise(self, state: DenoiseState, channels: int) -> torch.Tensor:
        r = state.request  # the edit pipelines' draw the noise alone when given no image to encode
        return self.pipe.prepare_latents(None, 1, channels, r.height, r.width, self.dtype, self.device,
                                         state.generator)[0]

    def encode_one(self, prompt: str) -> torch.Tensor:
        vision = self._vision if self.plus else self._vision[0]
        return self.pipe.encode_prompt(prompt=prompt, image=vision, device=self.device, num_images_per_prompt=1)[0]

    def cached_text(self, request: ImageRequest, rows: int, encode):
        """The text's states depend on the uploads the encoder reads too: they join the key."""
        digest = tuple(pixels_digest(torch.from_numpy(np.array(p))) for p in self._vision)
        return self.conditioning.text((request.prompt, request.negative_prompt, rows == 2, self._text_key, digest),
                                      encode)

    def forward_key(self, state: DenoiseState) -> tuple:
        return self.token_shape(state), tuple(map(tuple, state.cond["reference_shapes"].tolist()))

    def tokens(self, state: DenoiseState) -> torch.Tensor:
        return torch.cat([state.latents, state.cond["reference"]], dim=1)

    def img_shapes(self, state: DenoiseState) -> list[tuple[int, int, int]]:
        return [(1, h, w) for h, w in [self.token_shape(state), *state.cond["reference_shapes"].tolist()]]


def _dimensions(area: int, picture: Image.Image) -> tuple[int, int]:
    """(height, width) of `area` pixels in the picture's aspect, as the edit pipelines size them."""
    width, height, _ = calculate_dimensions(area, picture.width / picture.height)
    return height, width
