"""Wan (`WanPipeline`): a text-to-video DiT over 1x2x2 patches of a causal 3D VAE's latents, with
3D RoPE over frames, rows and columns, cross-attention to UMT5's states of the prompt (zero-padded
to 512 rows, all of them attended), true CFG and a UniPC sampler that keeps state per request.

Wan 2.1's image-to-video (`WanImageToVideoPipeline`, `WanImageToVideoFamily`) takes the clip's first
frame as well: its VAE latents and a mask beside the noise (36 input channels), its CLIP states
attended beside the text.

A request's clip is `num_frames` frames (1 + 4k: the VAE makes one latent frame of the first and
of every 4 after it); its latents stay float32 as the pipeline's do (the denoiser gets them in its
dtype). The model's RoPE is read off its input's shape, so a plain step runs one forward per clip
shape; a packed one (the patched policies) runs clips of every shape in one forward (`pack_wan`).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch
from PIL import Image

from gouache.block_cache.blocks import CachedForward, cached_blocks
from gouache.request import ImageRequest
from gouache.runner.families.base import by_state, cat_cond, latent_statistics, per_group, row_timesteps
from gouache.runner.families.dit import FlowFamily
from gouache.runner.pack_wan import packed_wan_forward
from gouache.runner.sampler import DenoiseState
from gouache.uploads import Upload

TEXT_LENGTH = 512  # rows of text each prompt's states are padded to (the pipeline's max_sequence_length)


class WanFamily(FlowFamily):
    name = "wan"

    def __init__(self, pipe, *args, **kwargs):
        """Refuses the Wan pipelines whose steps this family does not make: Wan 2.2 A14B's second
        expert (`transformer_2`, switched to at a boundary timestep) and Wan 2.2 TI2V's per-token
        timesteps (`expand_timesteps`)."""
        if getattr(pipe, "transformer_2", None) is not None or getattr(pipe.config, "expand_timesteps", False):
            raise ValueError("this Wan pipeline is Wan 2.2's (a second expert, transformer_2, or per-token "
                             "timesteps, expand_timesteps), which gouache does not serve yet; a Wan 2.1 "
                             "text-to-video directory is served")
        super().__init__(pipe, *args, **kwargs)

    def encode_text(self, request: ImageRequest, rows: int) -> dict[str, torch.Tensor]:
        """[negative, positive] prompt states, [rows, 512, D]."""
        positive, negative = self.encode_prompt(
            request, rows, prompt=request.prompt, negative_prompt=request.negative_prompt,
            do_classifier_free_guidance=rows == 2, num_videos_per_prompt=1, max_sequence_length=TEXT_LENGTH,
            device=self.device,
        )
        return {"prompt_embeds": positive if rows == 1 else torch.cat([negative, positive])}

    def set_timesteps(self, state: DenoiseState) -> torch.Tensor:
        state.scheduler.set_timesteps(state.request.num_inference_steps, device=self.device)
        state.scheduler.set_begin_index(0)
        return state.scheduler.timesteps

    def initial_latents(self, state: DenoiseState) -> torch.Tensor:
        """float32 noise [1, 16, latent frames, h, w] from the request's generator."""
        if state.edit is not None:
            raise ValueError("Wan models make clips from text only: edits are not served")
        r = state.request
        return self.pipe.prepare_latents(1, self.denoiser.config.in_channels, r.height, r.width, r.num_frames,
                                         torch.float32, self.device, state.generator)

    def token_count(self, state: DenoiseState) -> int:
        return math.prod(self.token_layout(state))

    def to_vae_latents(self, latents: torch.Tensor, state: DenoiseState) -> torch.Tensor:
        """The pipeline's de-normalisation: latents / (1 / std) + mean, per channel."""
        latents = latents.to(self.pipe.vae.dtype)
        mean, inverse_std = latent_statistics(self.pipe.vae, latents)
        return latents / inverse_std + mean

    def _pixels(self, state: DenoiseState, video: torch.Tensor) -> np.ndarray:
        """A decoded [1, 3, F, H, W] clip in [-1, 1] as uint8 [F, H, W, 3] ([H, W, 3] of one frame)."""
        frames = (video[0].float() / 2 + 0.5).clamp(0, 1).permute(1, 2, 3, 0)
        pixels = (frames.cpu().numpy() * 255).round().astype(np.uint8)
        return pixels if state.request.num_frames > 1 else pixels[0]

    # -- the forward ------------------------------------------------------------------------

    @torch.no_grad()
    def predict(self, states: list[DenoiseState], patched: bool = False,
                blocks: CachedForward | None = None) -> list[torch.Tensor]:
        """One forward per clip shape (the model's RoPE is one shape's), or packed: one for all.
        `blocks`: the block cache's reuse, per clip (per token when packed)."""
        if patched:
            return self.predict_patched(states, blocks=blocks)
        if blocks is None:
            return per_group(states, self.token_layout, self.forward)
        first = dict(zip(map(id, states), itertools.accumulate((s.rows for s in states), initial=0)))

        def forward(group: list[DenoiseState]) -> torch.Tensor:  # a cache pass over the shape's rows
            rows = [first[id(s)] + row for s in group for row in range(s.rows)]
            with cached_blocks(self.denoiser, blocks.begin(order=rows)):
                return self.forward(group)

        return per_group(states, self.token_layout, forward)

    @torch.no_grad()
    def predict_patched(self, states: list[DenoiseState], whole_batches: bool = True,
                        blocks: CachedForward | None = None) -> list[torch.Tensor]:
        """One forward over clips of every shape (`pack_wan`)."""
        samples = [sample for s in states for sample in self.model_input(s)]
        outputs = packed_wan_forward(self.denoiser, samples, row_timesteps(states), cat_cond(states, "prompt_embeds"),
                                     whole_batches, blocks, self.image_states(states))
        return by_state(outputs, states)

    def forward_inputs(self, states: list[DenoiseState]) -> tuple[dict, dict]:
        image = self.image_states(states)
        return ({
            "hidden_states": torch.cat([self.model_input(s) for s in states]),
            "timestep": row_timesteps(states),
            "encoder_hidden_states": cat_cond(states, "prompt_embeds"),
            **({} if image is None else {"encoder_hidden_states_image": image}),
        }, {})

    def model_input(self, state: DenoiseState) -> torch.Tensor:
        """A clip's rows of the transformer's input [rows, C, F, h, w]: its latents."""
        return state.latents.to(self.dtype).expand(state.rows, -1, -1, -1, -1)

    def image_states(self, states: list[DenoiseState]) -> torch.Tensor | None:
        """The rows' image states the transformer attends to beside the text (None: text only)."""
        return None

    def token_layout(self, state: DenoiseState) -> tuple[int, ...]:
        """A clip's token grid (latent frames, rows, columns): its place in a packed forward."""
        frames, height, width = state.latents.shape[2:]
        return frames, height // 2, width // 2

    def row_maps(self, states: list[DenoiseState], patched: bool) -> dict[int, torch.Tensor] | None:
        if not patched and len({self.token_layout(s) for s in states}) > 1:
            return None  # a forward per clip shape: adapters apply per forward
        return super().row_maps(states, patched)  # packed: per clip row, per token


class WanImageToVideoFamily(WanFamily):
    """Wan 2.1 image-to-video (`WanImageToVideoPipeline`): a clip made from its first frame (the
    request's upload, at the clip's size; a black one for the server's own warm-up and probe). Its
    pixels, followed by zero frames, are encoded by the VAE (the mode) into a condition of 16
    latent channels, beside a 4-channel mask that keeps the first frame; each step's input is the
    noise with the condition after it. The CLIP vision encoder's states of it (the last layer but
    one's) are attended beside the prompt's through each cross-attention's own projections."""

    def __init__(self, pipe, *args, **kwargs):
        """Refuses the image-to-video pipelines whose steps this family does not make: Wan 2.2's
        (no CLIP encoder: the image enters through the latents alone) and FLF2V's, whose image
        embedder takes a first and a last frame."""
        super().__init__(pipe, *args, **kwargs)
        if getattr(pipe, "image_encoder", None) is None or self.denoiser.config.image_dim is None:
            raise ValueError("this image-to-video pipeline has no CLIP image encoder (Wan 2.2's); gouache serves "
                             "Wan 2.1's image-to-video, whose transformer attends to the first frame's CLIP states")
        if self.denoiser.config.pos_embed_seq_len is not None:
            raise ValueError("this is Wan 2.1's first-last-frame model (FLF2V), which takes a last frame as well; "
                             "gouache serves image-to-video from a first frame")
        self._first_frame: Image.Image | None = None  # the upload of the request being prepared

    @torch.no_grad()
    def prepare(self, request: ImageRequest, upload: Upload | None = None, text=()) -> DenoiseState:
        """The first frame is the upload: no edit's blending or mask applies."""
        pixels = upload.image if upload is not None else np.zeros((request.height, request.width, 3), np.uint8)
        self._first_frame = Image.fromarray(pixels)
        try:
            state = super().prepare(request, None, text)
        finally:
            self._first_frame = None
        return state

    def initial_latents(self, state: DenoiseState) -> torch.Tensor:
        """The pipeline's noise, drawn from the request's generator, and beside it (in `cond`, a
        view per row) the first frame's condition and its CLIP states, which draw nothing."""
        r, frame = state.request, self._first_frame
        pixels = self.pipe.video_processor.preprocess(frame, height=r.height, width=r.width)
        latents, condition = self.pipe.prepare_latents(
            pixels.to(self.device, torch.float32), 1, self.pipe.vae.config.z_dim, r.height, r.width, r.num_frames,
            torch.float32, self.device, state.generator)
        state.cond["condition"] = condition.expand(state.rows, -1, -1, -1, -1)
        image_states = self.pipe.encode_image(frame, self.device).to(self.dtype)
        state.cond["image_states"] = image_states.expand(state.rows, -1, -1)
        return latents

    def model_input(self, state: DenoiseState) -> torch.Tensor:
        """Its rows' noise with the condition after it [rows, 36, F, h, w], as the pipeline
        concatenates them."""
        latents = state.latents.expand(state.rows, -1, -1, -1, -1)
        return torch.cat([latents, state.cond["condition"]], dim=1).to(self.dtype)

    def image_states(self, states: list[DenoiseState]) -> torch.Tensor:
        return cat_cond(states, "image_states")
