"""Flow-matching transformers: SD3 (MMDiT with CFG) and Flux (guidance-distilled, packed latents)."""

from __future__ import annotations

from abc import abstractmethod

import numpy as np
import torch
from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

from gouache.block_cache.blocks import CachedForward, cacheable_blocks, cached_blocks
from gouache.config import CompileConfig
from gouache.parallel.ulysses import installed
from gouache.request import ImageRequest
from gouache.runner import pieces_flux, pieces_sd3
from gouache.runner.compiled import CompiledDenoiser
from gouache.runner.describe import UNSERVED
from gouache.runner.families.base import Family, by_state, cat_cond, per_group, row_timesteps
from gouache.runner.pack_dit import Packing
from gouache.runner.pack_flux import packed_flux_forward
from gouache.runner.pack_sd3 import packed_sd3_forward
from gouache.runner.pieces import budget
from gouache.runner.pieces_flux import FluxPieces
from gouache.runner.pieces_sd3 import SD3Pieces
from gouache.runner.sampler import DenoiseState
from gouache.templates.replay import ReplayForward
from gouache.uploads import Upload


class FlowFamily(Family):
    """What SD3 and Flux share: VAE shift/scale, flow-matching re-noising of kept regions, and
    one forward over mixed sizes by packing tokens (`runner/pack_dit.py`, `pack_flux.py`), not patches."""

    patches = False

    @property
    def token_pixels(self) -> int:
        return self.vae_scale * 2  # SD3 patches 2x2 latents into a token; Flux packs them

    def replay(self, states: list[DenoiseState], replay: ReplayForward) -> list[torch.Tensor]:
        if "template" in UNSERVED.get(self.name, {}):
            return super().replay(states, replay)
        return self.predict_patched(states, whole_batches=False, blocks=replay)  # the packed forward's token subsets

    def predict(self, states: list[DenoiseState], patched: bool = False,
                blocks: CachedForward | None = None) -> list[torch.Tensor]:
        """Under --compile a Ulysses step (`compiled.shards`: where the family's pieces shard a
        forward) runs in compiled pieces on this rank's shard (`PackedPieces.sharded`), and
        eagerly, the Ulysses processors installed, where they cannot run it."""
        shards = None if self.compiled is None else self.compiled.shards
        if shards is None:
            return super().predict(states, patched, blocks)
        if blocks is None and not patched:
            outputs = self.pieces.forward(*self.piece_inputs(states), shards=shards)
            if outputs is not None:
                return self.piece_outputs(outputs, states)
        with installed(self.pipe.transformer, shards):
            return super().predict(states, patched, blocks)

    def piece_inputs(self, states: list[DenoiseState]) -> tuple:
        """What the family's pieces' `forward` takes for a forward of `states`' rows."""
        raise NotImplementedError(f"{type(self).__name__} runs no compiled pieces")

    def piece_outputs(self, outputs: list[torch.Tensor], states: list[DenoiseState]) -> list[torch.Tensor]:
        """Per state, its rows' predictions from the pieces' outputs."""
        raise NotImplementedError(f"{type(self).__name__} runs no compiled pieces")

    def template_blocks(self) -> list[str]:
        return [key for _, _, key in cacheable_blocks(self.pipe.transformer)]

    single_stream = False  # blocks that run text and image rows as one sequence (Flux's single blocks)

    def row_maps(self, states: list[DenoiseState], patched: bool) -> dict[int, torch.Tensor] | None:
        """A packed forward's rows: images (conditioning), image tokens, text rows (and both
        joined, for single-stream blocks), each by its image's forward row."""
        if not patched or len({self.token_layout(s) for s in states}) == 1:
            return super().row_maps(states, False)
        shapes = [self.token_layout(s) for s in states for _ in range(s.rows)]
        packing = Packing.build(shapes, states[0].cond["prompt_embeds"].shape[1], torch.device("cpu"))
        indices = [torch.arange(len(shapes)), packing.image_index, packing.text_index]
        if self.single_stream:
            indices.append(torch.cat([packing.text_index, packing.image_index]))
        maps: dict[int, torch.Tensor] = {}
        for index in indices:
            if not torch.equal(maps.setdefault(len(index), index), index):
                return None  # two kinds of rows of one size: a hook could not tell them apart
        return maps

    def token_shape(self, state: DenoiseState) -> tuple[int, int]:
        """The token grid of the state's images."""
        return state.request.height // self.token_pixels, state.request.width // self.token_pixels

    def token_layout(self, state: DenoiseState) -> tuple[int, ...]:
        """The state's tokens in a packed forward (`Packing.shapes`)."""
        return self.token_shape(state)

    def layout_tokens(self, sizes: tuple[tuple[int, int], ...]) -> list[int]:
        """The token counts an image of each of `sizes` (h, w) takes in a packed forward."""
        return [h * w // self.token_pixels ** 2 for h, w in sizes]

    def encode_pixels(self, pixels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        config = self.pipe.vae.config
        latents = self.latent_dist(pixels).sample(generator)
        return (latents - config.shift_factor) * config.scaling_factor

    def renoise(self, scheduler, clean, noise, t):
        return scheduler.scale_noise(clean, t.reshape(1), noise)

    def unscale(self, latents: torch.Tensor) -> torch.Tensor:
        config = self.pipe.vae.config
        return latents / config.scaling_factor + config.shift_factor

    def latent_hw(self, request: ImageRequest) -> tuple[int, int]:
        return request.height // self.vae_scale, request.width // self.vae_scale


class StableDiffusion3Family(FlowFamily):
    name = "sd3"
    replays_in_pieces = True

    def token_count(self, state: DenoiseState) -> int:
        patch = self.pipe.transformer.config.patch_size
        return (state.latents.shape[2] // patch) * (state.latents.shape[3] // patch)

    def encode_text(self, request: ImageRequest, rows: int) -> dict[str, torch.Tensor]:
        positive, negative, pooled, negative_pooled = self.encode_prompt(
            request, rows,
            prompt=request.prompt,
            prompt_2=None,
            prompt_3=None,
            negative_prompt=request.negative_prompt,
            do_classifier_free_guidance=rows == 2,
            device=self.device,
            num_images_per_prompt=1,
        )
        if rows == 1:
            return {"prompt_embeds": positive, "pooled": pooled}
        return {"prompt_embeds": torch.cat([negative, positive]), "pooled": torch.cat([negative_pooled, pooled])}

    def set_timesteps(self, state: DenoiseState) -> torch.Tensor:
        config, kwargs = self.pipe.scheduler.config, {}
        if config.get("use_dynamic_shifting", None):
            h, w = self.latent_hw(state.request)
            patch = self.pipe.transformer.config.patch_size
            kwargs["mu"] = calculate_shift(
                (h // patch) * (w // patch),
                config.get("base_image_seq_len", 256),
                config.get("max_image_seq_len", 4096),
                config.get("base_shift", 0.5),
                config.get("max_shift", 1.16),
            )
        timesteps, _ = retrieve_timesteps(state.scheduler, state.request.num_inference_steps, self.device, **kwargs)
        return timesteps

    def initial_latents(self, state: DenoiseState) -> torch.Tensor:
        r = state.request
        if state.edit is not None:
            image_latents = self.encode_original(state, state.edit.pixels)
        channels = self.pipe.transformer.config.in_channels
        noise = self.pipe.prepare_latents(1, channels, r.height, r.width, self.dtype, self.device, state.generator)
        if state.edit is not None:
            self.finish_edit(state, image_latents, noise, noise.shape[2:])
        return noise

    def forward_inputs(self, states: list[DenoiseState]) -> tuple[dict, dict]:
        return ({
            "hidden_states": torch.cat([torch.cat([s.latents] * s.rows) for s in states]),
            "timestep": row_timesteps(states),
            "encoder_hidden_states": cat_cond(states, "prompt_embeds"),
            "pooled_projections": cat_cond(states, "pooled"),
        }, {})

    def predict_patched(self, states: list[DenoiseState], whole_batches: bool = True,
                        blocks: CachedForward | None = None) -> list[torch.Tensor]:
        if whole_batches and len({self.token_layout(s) for s in states}) == 1:  # the model's own batch (its row graph)
            return self.predict(states, False, blocks)
        inputs = self.piece_inputs(states)
        outputs = None
        if self.pieces is not None and isinstance(blocks, ReplayForward):
            outputs = self.pieces.forward(*inputs, replay=blocks)
        elif self.pieces is not None and blocks is None and whole_batches:  # sizes mixed (one returned above)
            outputs = self.pieces.forward(*inputs)
        if outputs is None:
            outputs = packed_sd3_forward(self.pipe.transformer, *inputs, whole_batches, blocks)
        return by_state(outputs, states)

    def piece_inputs(self, states: list[DenoiseState]) -> tuple:
        samples = [s.latents[0] for s in states for _ in range(s.rows)]
        return samples, row_timesteps(states), cat_cond(states, "prompt_embeds"), cat_cond(states, "pooled")

    def piece_outputs(self, outputs: list[torch.Tensor], states: list[DenoiseState]) -> list[torch.Tensor]:
        return by_state(outputs, states)

    def make_pieces(self, compiled: CompiledDenoiser, config: CompileConfig) -> SD3Pieces | None:
        if not pieces_sd3.supports(self.pipe.transformer):
            return None
        buckets = budget(compiled, config, self.layout_tokens(config.sizes), replays=self.replays_in_pieces,
                         request_rows=self.request_rows())
        return SD3Pieces(self.pipe.transformer, compiled, buckets)

    def to_vae_latents(self, latents: torch.Tensor, state: DenoiseState) -> torch.Tensor:
        return self.unscale(latents)


class PackedFamily(FlowFamily):
    """What the families of packed latents share (FLUX.1, Qwen-Image, FLUX.2: [1, tokens, C], each
    token 2x2 latent pixels): the schedule shifted by the image's token count, the initial noise
    after an edit's original (the inpaint pipelines' order), an edit's mask packed like its
    latents."""

    def set_timesteps(self, state: DenoiseState) -> torch.Tensor:
        steps, config = state.request.num_inference_steps, self.pipe.scheduler.config
        sigmas = None if config.get("use_flow_sigmas", False) else np.linspace(1.0, 1 / steps, steps)
        timesteps, _ = retrieve_timesteps(state.scheduler, steps, self.device, sigmas=sigmas, mu=self.shift(state))
        state.scheduler.set_begin_index(0)
        return timesteps

    def shift(self, state: DenoiseState) -> float:
        """The schedule's shift (mu) for the state's image, from its token count."""
        config = self.pipe.scheduler.config
        h, w = self.token_shape(state)
        return calculate_shift(h * w, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                               config.get("base_shift", 0.5), config.get("max_shift", 1.15))

    def initial_latents(self, state: DenoiseState) -> torch.Tensor:
        if state.edit is not None:
            image_latents = self.pack(self.encode_original(state, state.edit.pixels))
        noise = self.noise(state, self.pipe.transformer.config.in_channels // 4)
        if state.edit is not None:
            self.finish_edit(state, image_latents, noise, self.latent_hw(state.request))
        return noise

    @abstractmethod
    def noise(self, state: DenoiseState, channels: int) -> torch.Tensor:
        """The request's packed initial noise as the pipeline draws it (its tokens' ids, where the
        model takes them, to `state.cond["image_ids"]`)."""

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        """[1, C, h, w] latents as the pipeline packs them into tokens."""
        b, c, h, w = latents.shape
        return self.pipe._pack_latents(latents, b, c, h, w)

    def latent_layout(self, grid: torch.Tensor) -> torch.Tensor:
        """Packed as the latents are, one copy per latent channel."""
        return self.pack(grid.expand(-1, self.pipe.transformer.config.in_channels // 4, -1, -1))

    def token_count(self, state: DenoiseState) -> int:
        return state.latents.shape[1]


class FluxFamily(PackedFamily):
    """Guidance-distilled: guidance_scale feeds the guidance embedding; no CFG rows."""

    name = "flux"

    single_stream = True
    replays_in_pieces = True

    def uses_cfg(self, request: ImageRequest) -> bool:
        return False

    def text_tokens(self) -> int:
        """The T5 tokens a prompt is padded to: its tokenizer's length, at most FLUX.1's 512 (a
        model trained on short prompts, as shapes-edit, declares its length there)."""
        return min(self.pipe.tokenizer_2.model_max_length, 512)

    def encode_text(self, request: ImageRequest, rows: int) -> dict[str, torch.Tensor]:
        embeds, pooled, text_ids = self.encode_prompt(
            request, rows, prompt=request.prompt, prompt_2=None, device=self.device, num_images_per_prompt=1,
            max_sequence_length=self.text_tokens(),
        )
        cond = {"prompt_embeds": embeds, "pooled": pooled, "text_ids": text_ids}
        if self.pipe.transformer.config.guidance_embeds:
            cond["guidance"] = torch.full([1], request.guidance_scale, device=self.device, dtype=torch.float32)
        return cond

    def noise(self, state: DenoiseState, channels: int) -> torch.Tensor:
        r = state.request
        noise, state.cond["image_ids"] = self.pipe.prepare_latents(1, channels, r.height, r.width, self.dtype,
                                                                   self.device, state.generator)
        return noise

    def forward_inputs(self, states: list[DenoiseState]) -> tuple[dict, dict]:
        first = states[0]  # one latent shape per forward: ids are shared by the whole group
        guidance = cat_cond(states, "guidance") if "guidance" in first.cond else None
        return ({
            "hidden_states": torch.cat([s.latents for s in states]),
            "timestep": row_timesteps(states).to(self.dtype) / 1000,
            "guidance": guidance,
            "pooled_projections": cat_cond(states, "pooled"),
            "encoder_hidden_states": cat_cond(states, "prompt_embeds"),
        }, {"txt_ids": first.cond["text_ids"], "img_ids": first.cond["image_ids"]})

    def predict_patched(self, states: list[DenoiseState], whole_batches: bool = True,
                        blocks: CachedForward | None = None) -> list[torch.Tensor]:
        if whole_batches and len({self.token_layout(s) for s in states}) == 1:  # the model's own batch (its row graph)
            return self.predict(states, False, blocks)
        inputs = self.piece_inputs(states)
        outputs = None
        if self.pieces is not None and isinstance(blocks, ReplayForward):
            outputs = self.pieces.forward(*inputs, replay=blocks)
        elif self.pieces is not None and blocks is None and whole_batches:  # sizes mixed (one returned above)
            outputs = self.pieces.forward(*inputs)
        if outputs is None:
            outputs = packed_flux_forward(self.pipe.transformer, *inputs, whole_batches, blocks)
        return self.piece_outputs(outputs, states)

    def piece_inputs(self, states: list[DenoiseState]) -> tuple:
        guidance = cat_cond(states, "guidance") if "guidance" in states[0].cond else None
        return ([self.token_grid(s) for s in states], row_timesteps(states).to(self.dtype) / 1000, guidance,
                cat_cond(states, "pooled"), cat_cond(states, "prompt_embeds"), states[0].cond["text_ids"])

    def piece_outputs(self, outputs: list[torch.Tensor], states: list[DenoiseState]) -> list[torch.Tensor]:
        return [out.flatten(1).T[None] for out in outputs]  # back to packed tokens [1, h*w, C]

    def make_pieces(self, compiled: CompiledDenoiser, config: CompileConfig) -> FluxPieces | None:
        if not pieces_flux.supports(self.pipe.transformer):
            return None
        buckets = budget(compiled, config, self.layout_tokens(config.sizes), replays=self.replays_in_pieces,
                         request_rows=self.request_rows())
        return FluxPieces(self.pipe.transformer, compiled, buckets)

    def token_grid(self, state: DenoiseState) -> torch.Tensor:
        """Packed latents [1, h*w, C] (raster order) as a grid [C, h, w] of tokens."""
        h, w = self.latent_hw(state.request)
        return state.latents[0].T.reshape(-1, h // 2, w // 2)

    def to_vae_latents(self, latents: torch.Tensor, state: DenoiseState) -> torch.Tensor:
        r = state.request
        return self.unscale(self.pipe._unpack_latents(latents, r.height, r.width, self.vae_scale))


class FluxKontextFamily(FluxFamily):
    """FLUX.1 Kontext (`FluxKontextPipeline`): a generation is FLUX.1's; an edit without a mask is
    an instruction edit, the upload's latents (the VAE's mode, drawing nothing from the
    generator) entering after the image's own tokens as reference tokens whose ids start with 1.
    The reference keeps the request's size (the pipeline with `_auto_resize=False`: the API has
    resized the upload to it). A forward's requests must agree on their tokens, so a step runs
    one forward per image size and reference (each its own block pass, whole images; LoRA sets
    then apply per forward) under a policy that does not mix sizes; else the packed forward
    carries each image's reference after its tokens (`pack_flux`; the block cache's units are its
    tokens, the reference's too), and edits that replay a template replay it as the template's
    unmasked tokens."""

    @torch.no_grad()
    def prepare(self, request: ImageRequest, upload: Upload | None = None, text=()) -> DenoiseState:
        """A masked edit is `FluxKontextInpaintPipeline`'s: FLUX.1's blending, the original its
        own reference."""
        if upload is None or request.strength is not None:
            return super().prepare(request, upload, text)
        # the encoding draws nothing: the noise is a generation's
        state = super().prepare(request, upload.masked(), text)
        if state.edit is not None:  # a masked edit encoded its original already
            reference = state.edit.image_latents
        else:
            reference = self.pack(self.encode_original(state, self.edit_pixels(upload.image)))
        h, w = self.latent_hw(request)
        ids = self.pipe._prepare_latent_image_ids(1, h // 2, w // 2, self.device, self.dtype)
        ids[..., 0] = 1
        state.cond["reference"] = reference
        state.cond["image_ids"] = torch.cat([state.cond["image_ids"], ids])
        return state

    def encode_original(self, state: DenoiseState, pixels: torch.Tensor) -> torch.Tensor:
        """The VAE's mode, as Kontext's pipelines encode (no draw from the generator)."""
        config = self.pipe.vae.config
        return (self.latent_dist(pixels).mode() - config.shift_factor) * config.scaling_factor

    def token_grid(self, state: DenoiseState) -> torch.Tensor:
        """[C, h, w], or [C, 2, h, w] with the reference's grid after the image's own."""
        grid = super().token_grid(state)
        if "reference" not in state.cond:
            return grid
        return torch.stack([grid, state.cond["reference"][0].T.reshape(grid.shape)], dim=1)

    def token_layout(self, state: DenoiseState) -> tuple[int, ...]:
        shape = self.token_shape(state)
        return (2, *shape) if "reference" in state.cond else shape

    def layout_tokens(self, sizes: tuple[tuple[int, int], ...]) -> list[int]:
        return [n * t for t in super().layout_tokens(sizes) for n in (1, 2)]  # an edit's reference doubles them

    def token_count(self, state: DenoiseState) -> int:
        return state.latents.shape[1] * (2 if "reference" in state.cond else 1)

    def noise(self, state: DenoiseState, channels: int) -> torch.Tensor:
        r = state.request
        noise, _, state.cond["image_ids"], _ = self.pipe.prepare_latents(None, 1, channels, r.height, r.width,
                                                                         self.dtype, self.device, state.generator)
        return noise

    @torch.no_grad()
    def predict(self, states: list[DenoiseState], patched: bool = False, blocks=None) -> list[torch.Tensor]:
        if not patched and any("reference" in s.cond for s in states):  # one forward per image size and reference
            return per_group(states, _tokens, lambda group: self.cached_forward(group, blocks))
        return super().predict(states, patched, blocks)

    def cached_forward(self, states: list[DenoiseState], blocks: CachedForward | None) -> torch.Tensor:
        """`forward` through the block pass of its own images (`blocks`: the step's)."""
        own = blocks and CachedForward.of(states, blocks.cache)
        with cached_blocks(self.denoiser, own and own.begin()):
            return self.forward(states)

    def forward(self, states: list[DenoiseState]) -> torch.Tensor:
        """The forward of states of one image size and reference: each prediction's own tokens only."""
        return self.denoise(*self.forward_inputs(states))[:, : states[0].latents.shape[1]]

    def forward_inputs(self, states: list[DenoiseState]) -> tuple[dict, dict]:
        rows, shared = super().forward_inputs(states)
        if "reference" in states[0].cond:
            rows["hidden_states"] = torch.cat([torch.cat([s.latents, s.cond["reference"]], dim=1) for s in states])
        return rows, shared

    def row_maps(self, states: list[DenoiseState], patched: bool) -> dict[int, torch.Tensor] | None:
        if not patched and any("reference" in s.cond for s in states):
            if len({_tokens(s) for s in states}) > 1:
                return None  # several forwards: adapters apply per forward
            return {sum(s.rows for s in states): torch.arange(sum(s.rows for s in states))}
        return super().row_maps(states, patched)


def _tokens(state: DenoiseState) -> tuple:
    """What a Kontext forward's requests must share: the image's size (packed latents of 96x64 and
    64x96 have one shape, not one grid) and whether a reference follows it (of that size)."""
    return state.request.height, state.request.width, "reference" in state.cond
