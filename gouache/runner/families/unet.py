"""SD1.5-style and SDXL UNets, text-to-image and 9-channel inpainting."""

from __future__ import annotations

import inspect
import itertools

import torch
from diffusers.utils.torch_utils import randn_tensor

from gouache.block_cache.blocks import CachedForward, cached_blocks
from gouache.config import CompileConfig
from gouache.request import ImageRequest
from gouache.runner.compiled import CompiledDenoiser, Graph
from gouache.runner.families.base import Family, by_state, cat_cond, row_timesteps
from gouache.runner.patch_ops import patch_inputs, patched_unet_forward, run_patches
from gouache.runner.sampler import DenoiseState
from gouache.templates.replay import ReplayForward
from gouache.templates.unet import example_layout, masked_blocks, replay_layout, replayable, unet_template_blocks


class StableDiffusionFamily(Family):
    name = "sd"
    passes_step_kwargs = True

    def __init__(self, pipe, patch_pixels: int | None = None, conditioning=None):
        super().__init__(pipe, patch_pixels, conditioning)
        self.unet = pipe.unet
        self.native_inpaint = self.needs_image = self.unet.config.in_channels == 9

    @property
    def patch_factor(self) -> int:
        return 2 ** self.pipe.unet.num_upsamplers  # a patch halves whole at every level down
    @property
    def blends_edits(self) -> bool:
        return not self.native_inpaint

    def encode_text(self, request: ImageRequest, rows: int) -> dict[str, torch.Tensor]:
        positive, negative = self.encode_prompt(
            request, rows, request.prompt, self.device, 1, rows == 2, request.negative_prompt
        )
        return {"prompt_embeds": torch.cat([negative, positive]) if rows == 2 else positive}

    def set_timesteps(self, state: DenoiseState) -> torch.Tensor:
        state.scheduler.set_timesteps(state.request.num_inference_steps, device=self.device)
        return state.scheduler.timesteps

    def initial_latents(self, state: DenoiseState) -> torch.Tensor:
        r = state.request
        shape = (1, self.pipe.vae.config.latent_channels, r.height // self.vae_scale, r.width // self.vae_scale)
        # The inpaint pipelines encode the original before drawing the noise when they blend it
        # back (4 channels); a 9-channel UNet at strength 1 needs no such latents, and its
        # pipeline draws the noise first, then encodes the image with the hole.
        image_latents = None
        if state.edit is not None and not self.native_inpaint:
            image_latents = self.encode_original(state, state.edit.pixels)
        noise = randn_tensor(shape, generator=state.generator, device=self.device, dtype=self.dtype)
        if state.edit is not None:
            self.finish_edit(state, image_latents, noise, shape[2:])
            if self.native_inpaint:
                state.edit.masked_image_latents = self.encode_pixels(state.edit.hole(), state.generator)
        return noise * state.scheduler.init_noise_sigma

    @property
    def token_pixels(self) -> int:
        return self.vae_scale  # a latent pixel

    def replay(self, states: list[DenoiseState], replay: ReplayForward) -> list[torch.Tensor]:
        """Under --compile, a replay that records nothing and computes every block alike runs
        compiled, its layout as data (`CompiledDenoiser.replayed`); else eagerly."""
        latent_hw = tuple(states[0].latents.shape[2:])
        rows, shared = self.forward_inputs(states)

        def eager() -> torch.Tensor:
            with masked_blocks(self.unet, replay, latent_hw):
                if self.compiled is not None:
                    return self.compiled.eager(rows, shared)
                return self.unet(**rows, **shared, return_dict=False)[0]

        if self.compiled is None:
            out = eager()
        else:
            layout, why = replay_layout(self.unet, replay, latent_hw, self.dtype)
            out = (self.compiled.run(None, eager, past=why) if layout is None
                   else self.compiled.replayed(layout, rows, shared, eager))
        return list(out.split([s.rows for s in states]))

    def replay_graphs(self, states: list[DenoiseState]) -> list[Graph]:
        """The compiled replays of edits of `states`' sizes (one a size) at every row bucket, to
        compile before they are met (`CompiledDenoiser.replayed`: one graph serves every mask)."""
        if self.compiled is None or "template" not in self.compiled.holds:
            return []
        return self.compiled.replay_graphs(
            [self.forward_inputs([state]) for state in states],
            lambda rows: example_layout(self.unet, len(rows["sample"]), tuple(rows["sample"].shape[2:]), self.dtype))

    def template_blocks(self) -> list[str]:
        return [key for _, _, key in unet_template_blocks(self.unet)]

    def token_count(self, state: DenoiseState) -> int:
        return state.latents.shape[2] * state.latents.shape[3]

    def forward(self, states: list[DenoiseState], control=None) -> torch.Tensor:
        """The UNet over every row of `states`; `control(states, sample, timesteps, kwargs)`
        gives the ControlNet residual arguments of those rows."""
        rows, shared = self.forward_inputs(states)
        if control is not None:
            rows.update(control(states, rows["sample"], rows["timestep"], rows))
        return self.denoise(rows, shared)

    def forward_inputs(self, states: list[DenoiseState]) -> tuple[dict, dict]:
        return {"sample": torch.cat([self._model_input(s) for s in states]), "timestep": row_timesteps(states),
                "encoder_hidden_states": cat_cond(states, "prompt_embeds"),
                "added_cond_kwargs": self.added_cond(states)}, {}

    def predict(self, states: list[DenoiseState], patched: bool = False,
                blocks: CachedForward | None = None) -> list[torch.Tensor]:
        """Where the compiled UNet holds the block cache (on a GPU), a forward whose blocks reuse
        cached outputs per image runs each block on its computed rows compiled
        (`CompiledDenoiser.block`: pieces of the forward, the cache's decisions between them);
        per patch (mixed sizes), eagerly. A patched step of one latent shape is the model's own
        batch (its row graph where compiled)."""
        patched = patched and len({s.latents.shape for s in states}) > 1
        if blocks is None or self.compiled is None or "block_cache" not in self.compiled.holds:
            return super().predict(states, patched, blocks)
        if patched:
            eager = super().predict
            return self.compiled.run(None, lambda: eager(states, patched, blocks), past="block_cache per patch")
        rows, shared = self.forward_inputs(states)
        with cached_blocks(self.unet, blocks.begin(), run=self.compiled.block):
            out = self.compiled.eager(rows, shared)  # its blocks compiled, each on the rows it computes
        return list(out.split([s.rows for s in states]))

    def predict_patched(self, states: list[DenoiseState], whole_batches: bool = True,
                        blocks: CachedForward | None = None) -> list[torch.Tensor]:
        samples = [row for s in states for row in self._model_input(s)]
        layout = self.layout(samples)
        args = (row_timesteps(states), cat_cond(states, "prompt_embeds"), self.added_cond(states))
        if self.compiled is not None and blocks is None and whole_batches and len({x.shape for x in samples}) > 1:
            inputs = patch_inputs(layout, samples, *args)
            patches = self.compiled.patched(layout, inputs, lambda: run_patches(self.unet, layout, inputs))
            outputs = layout.merge(patches)
        else:
            outputs = patched_unet_forward(self.unet, layout, samples, *args, whole_batches, blocks)
        return by_state(outputs, states)

    def patched_graphs(self, states: list[DenoiseState]) -> list[Graph]:
        """The patched forwards that mixes of `states` (one a size) make, to compile before they
        are met: every pair of sizes and all of them together, repeated to each row bucket, one
        graph a patch side and patch bucket (the runner keeps as many as `--compile-graphs` leaves)."""
        compiled = self.compiled
        if compiled is None or "mixed_sizes" not in compiled.holds or len(states) < 2:
            return []
        mixes = [list(pair) for pair in itertools.combinations(states, 2)] + ([states] if len(states) > 2 else [])
        graphs: dict[tuple, Graph] = {}
        for mix, rows in itertools.product(mixes, compiled.buckets):
            members = list(itertools.islice(itertools.cycle(mix), max(len(mix), -(-rows // mix[0].rows))))
            samples = [row for s in members for row in self._model_input(s)]
            layout = self.layout(samples)
            inputs = patch_inputs(layout, samples, row_timesteps(members), cat_cond(members, "prompt_embeds"),
                                  self.added_cond(members))
            graph = compiled.graph(inputs, {}, layout)
            graphs.setdefault(graph.key, graph)
        return list(graphs.values())

    def compile(self, compiled: CompiledDenoiser, config: CompileConfig) -> None:
        """A patched forward of mixed sizes compiles too (`CompiledDenoiser.patched`), a template
        replay (`CompiledDenoiser.replayed`) where the UNet's blocks take one, a CFG-parallel
        step's half of the rows (`gouache.parallel.cfg`), and on a GPU a block cache's computed
        rows, block by block (`predict`)."""
        super().compile(compiled, config)
        holds = {"mixed_sizes", "parallel"} | ({"template"} if replayable(self.unet) else set())
        # block pieces: measured slower than eager blocks on a CPU, where a compiled UNet gains
        # from fusing across blocks; on a GPU they take an eager step's launches away (untested)
        if self.device.type == "cuda":
            holds.add("block_cache")
        compiled.holds = frozenset(holds)

    @classmethod
    def unused_graphs(cls, config: CompileConfig) -> str | None:
        if len(set(config.sizes)) < 2:
            return ("--compile-graphs would be ignored: patched forwards of mixed sizes compile at start where "
                    "--compile-sizes lists two sizes or more")
        return None

    def _model_input(self, state: DenoiseState) -> torch.Tensor:
        x = state.scheduler.scale_model_input(torch.cat([state.latents] * state.rows), state.t)
        if self.native_inpaint:
            edit = state.edit
            extra = torch.cat([edit.latent_mask, edit.masked_image_latents], dim=1)
            x = torch.cat([x, extra.expand(state.rows, -1, -1, -1)], dim=1)
        return x

    def added_cond(self, states: list[DenoiseState]) -> dict | None:
        return None

    def encode_pixels(self, pixels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return self.latent_dist(pixels).sample(generator) * self.pipe.vae.config.scaling_factor

    def renoise(self, scheduler, clean, noise, t):
        return scheduler.add_noise(clean, noise, t.reshape(1))

    def to_vae_latents(self, latents: torch.Tensor, state: DenoiseState) -> torch.Tensor:
        return latents / self.pipe.vae.config.scaling_factor


class StableDiffusionXLFamily(StableDiffusionFamily):
    name = "sdxl"

    def encode_text(self, request: ImageRequest, rows: int) -> dict[str, torch.Tensor]:
        positive, negative, pooled, negative_pooled = self.encode_prompt(
            request, rows,
            prompt=request.prompt,
            device=self.device,
            num_images_per_prompt=1,
            do_classifier_free_guidance=rows == 2,
            negative_prompt=request.negative_prompt,
        )
        time_ids, negative_time_ids = self._time_ids(request, positive.dtype)
        if rows == 1:
            return {"prompt_embeds": positive, "text_embeds": pooled, "time_ids": time_ids}
        return {
            "prompt_embeds": torch.cat([negative, positive]),
            "text_embeds": torch.cat([negative_pooled, pooled]),
            "time_ids": torch.cat([negative_time_ids, time_ids]),
        }

    def _time_ids(self, request: ImageRequest, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """SDXL's size conditioning, as the text-to-image or the inpaint pipeline builds it."""
        size = (request.height, request.width)
        projection_dim = self.pipe.text_encoder_2.config.projection_dim
        if "aesthetic_score" in inspect.signature(self.pipe._get_add_time_ids).parameters:
            # img2img/inpaint pipelines: the defaults of their __call__ (aesthetic scores 6.0 / 2.5)
            ids, negative = self.pipe._get_add_time_ids(size, (0, 0), size, 6.0, 2.5, size, (0, 0), size, dtype,
                                                        projection_dim)
        else:
            ids = negative = self.pipe._get_add_time_ids(size, (0, 0), size, dtype=dtype,
                                                         text_encoder_projection_dim=projection_dim)
        return ids.to(self.device), negative.to(self.device)

    def encode_original(self, state: DenoiseState, pixels: torch.Tensor) -> torch.Tensor:
        """SDXL's Img2Img pipeline normalises by the VAE's latents_mean / latents_std where its
        config has them (its inpaint pipeline scales only)."""
        mean, std = self._latents_stats(pixels)
        if state.request.strength is None or mean is None:
            return super().encode_original(state, pixels)
        sample = self.latent_dist(pixels).sample(state.generator)
        return (sample - mean) * self.pipe.vae.config.scaling_factor / std

    def _latents_stats(self, like: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        config = self.pipe.vae.config
        mean, std = getattr(config, "latents_mean", None), getattr(config, "latents_std", None)
        if mean is None or std is None:
            return None, None
        return torch.tensor(mean).view(1, -1, 1, 1).to(like), torch.tensor(std).view(1, -1, 1, 1).to(like)

    def added_cond(self, states: list[DenoiseState]) -> dict:
        return {"text_embeds": cat_cond(states, "text_embeds"), "time_ids": cat_cond(states, "time_ids")}

    def to_vae_latents(self, latents: torch.Tensor, state: DenoiseState) -> torch.Tensor:
        mean, std = self._latents_stats(latents)
        if mean is None:
            return latents / self.pipe.vae.config.scaling_factor
        return latents * std / self.pipe.vae.config.scaling_factor + mean

