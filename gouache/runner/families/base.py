"""A model family: how one diffusers pipeline's denoiser is driven step by step.

The adapter calls the pipeline's own public pieces (encode_prompt, prepare_latents, the
scheduler, the VAE) so results match the plain pipeline, and batches the denoiser forward
over any number of requests of one latent shape, each at its own step.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable

import numpy as np
import torch

from gouache.block_cache.blocks import CachedForward, cached_blocks
from gouache.config import DEFAULT_PATCH_PIXELS, CompileConfig
from gouache.lora.text import TextAdapters, text_adapters, text_key
from gouache.model_info import img2img_start
from gouache.request import ImageRequest
from gouache.runner.compiled import CompiledDenoiser, Graph
from gouache.runner.conditioning import ConditioningCache
from gouache.runner.describe import CFG_FROM, UNSERVED, vae_scale
from gouache.runner.layout import PatchLayout
from gouache.runner.pieces import PackedPieces
from gouache.runner.sampler import DenoiseState, EditInputs
from gouache.templates.replay import ReplayForward
from gouache.uploads import Upload


class Family(ABC):
    name: str
    # scheduler.step gets the pipeline's extra kwargs (generator, eta) as SD/SDXL pipelines pass them
    passes_step_kwargs = False
    # one forward over mixed sizes cuts latents into patches (UNets); DiTs pack tokens instead
    patches = True
    # the denoiser takes an image as input (9-channel inpainting), so generations need one too
    needs_image = False
    # a patched step's mixed sizes share one forward (patched UNet, packed DiT); else one forward per size
    mixes_sizes = True

    def __init__(self, pipe, patch_pixels: int | None = None, conditioning: ConditioningCache | None = None):
        """`patch_pixels`: the largest patch side of a patched forward (None: DEFAULT_PATCH_PIXELS);
        families that do not cut images into patches ignore it. `conditioning`: where prompts'
        encodings and uploads' latent distributions are kept (None: nowhere)."""
        self.pipe = pipe
        self.conditioning = conditioning or ConditioningCache()
        self.device = pipe.device
        self.dtype = pipe.dtype
        self.vae_scale = vae_scale(pipe)  # pixels per latent pixel
        self.patch_pixels = DEFAULT_PATCH_PIXELS if patch_pixels is None else patch_pixels
        step = self.vae_scale * self.patch_factor
        if self.patches and self.patch_pixels % step:
            raise ValueError(f"patch size must be a multiple of {step} pixels (the size step) for this {self.name} "
                             f"model, got {self.patch_pixels}")
        self.patch = self.patch_pixels // self.vae_scale  # the largest patch side in latent pixels
        self.compiled: CompiledDenoiser | None = None  # the compiled forward, under --compile
        self.pieces: PackedPieces | None = None  # its packed forward of mixed sizes in compiled pieces, if any
        self._text_key: tuple = ()  # the text-encoder adapters of the prompt being encoded (`text_key`)

    def compile(self, compiled: CompiledDenoiser, config: CompileConfig) -> None:
        """Run the denoiser through `compiled` (--compile), and the packed forward of mixed sizes,
        template replays and Ulysses shards in compiled pieces where the family has them
        (`make_pieces`; the first two where the budget gives them token buckets). A family that
        runs mixed sizes one forward per size (`mixes_sizes` False) holds them: each is a row graph."""
        self.compiled = compiled
        self.pieces = self.make_pieces(compiled, config)
        compiled.holds = frozenset() if self.mixes_sizes else frozenset({"mixed_sizes"})
        if self.pieces is not None:
            kinds = {kind.split()[0] for kind in self.pieces.buckets.by_kind}  # packed "tokens", "replay"
            compiled.holds |= {"parallel"} | {name for kind, name in (("tokens", "mixed_sizes"), ("replay", "template"))
                               if kind in kinds}


    def patched_graphs(self, states: list[DenoiseState]) -> list[Graph]:
        """The compiled patched forwards of mixed sizes that mixes of `states` (one per size the
        server compiles) make, where the family's patched forward compiles whole (a UNet's)."""
        return []

    def replay_graphs(self, states: list[DenoiseState]) -> list[Graph]:
        """The compiled template replays of edits of `states`' sizes, where the family's replay
        compiles whole (a UNet's)."""
        return []

    def make_pieces(self, compiled: CompiledDenoiser, config: CompileConfig) -> PackedPieces | None:
        """The family's packed forward in compiled pieces (`gouache.runner.pieces`), if it has one."""
        return None

    replays_in_pieces = False  # whether template replays run in its compiled pieces (`PackedPieces.replay`)

    @classmethod
    def unused_graphs(cls, config: CompileConfig) -> str | None:
        """Why a --compile-graphs given to this family's server would change nothing (None: it
        bounds the graphs of its forwards of mixed sizes or template replays)."""
        if cls.make_pieces is Family.make_pieces:
            return (f"--compile-graphs would be ignored: it bounds the graphs of packed forwards of mixed sizes, "
                    f"which {cls.name} models do not compile (UNet, SD3 and FLUX.1 models do)")
        if not config.sizes or (not cls.replays_in_pieces and len({h * w for h, w, *_ in config.sizes}) < 2):
            return ("--compile-graphs would be ignored: packed forwards of mixed sizes compile where "
                    "--compile-sizes lists sizes of two or more pixel counts, template replays where it lists any")
        return None

    @property
    def patch_factor(self) -> int:
        """What a patch's latent side must be a multiple of (for a UNet: its downsamplings)."""
        return 1

    # -- preparation (prep thread) --------------------------------------------------------

    @torch.no_grad()
    def prepare(self, request: ImageRequest, upload: Upload | None = None, text: TextAdapters = ()) -> DenoiseState:
        """Text encoding (with `text`, the request's text-encoder adapters), sampler, initial
        noise and (for edits) the original's latents. An upload's further images (`references`)
        are read only by the families that take several (admission keeps them from others)."""
        scheduler = self.pipe.scheduler.__class__.from_config(self.pipe.scheduler.config)
        generator = torch.Generator(device="cpu").manual_seed(request.seed)
        rows = 2 if self.uses_cfg(request) else 1
        state = DenoiseState(
            request=request, scheduler=scheduler, timesteps=torch.empty(0), latents=torch.empty(0),
            generator=generator, rows=rows,
        )
        with text_adapters(self.pipe, text):
            self._text_key = text_key(text)
            try:
                state.cond = self.encode_text(request, rows)
            finally:
                self._text_key = ()
        if upload is None and self.needs_image:  # a generation repaints all of a blank image
            upload = Upload.blank(request.height, request.width)
        if upload is not None:
            state.edit = EditInputs(self.edit_pixels(upload.image), upload.region())
        state.timesteps = self.set_timesteps(state)  # before the noise: init_noise_sigma depends on it
        if request.strength is not None:
            self._start_img2img(state)
        state.latents = self.initial_latents(state)
        if request.strength is not None:  # the original, noised to where its schedule starts
            state.latents = self.renoise(scheduler, state.edit.image_latents, state.edit.noise, state.timesteps[0])
        if self.passes_step_kwargs:  # reads only the scheduler class's signature
            state.step_kwargs = self.pipe.prepare_extra_step_kwargs(generator, 0.0)
        return state

    def _start_img2img(self, state: DenoiseState) -> None:
        """Drop the steps an img2img request skips, as the family's Img2Img pipeline does."""
        order = state.scheduler.order
        start = img2img_start(self.name, state.request.num_inference_steps, state.request.strength) * order
        state.timesteps = state.timesteps[start:]
        if hasattr(state.scheduler, "set_begin_index"):
            state.scheduler.set_begin_index(start)

    def encode_original(self, state: DenoiseState, pixels: torch.Tensor) -> torch.Tensor:
        """The edit's original as clean latents (`encode_pixels`), sampled with the request's generator."""
        return self.encode_pixels(pixels, state.generator)

    def encode_prompt(self, request: ImageRequest, rows: int, *args, **kwargs):
        """The pipeline's `encode_prompt(*args, **kwargs)` for the request's prompts and guidance,
        from the conditioning cache when an earlier request asked the same with the same
        text-encoder adapters."""
        return self.cached_text(request, rows, lambda: self.pipe.encode_prompt(*args, **kwargs))

    def cached_text(self, request: ImageRequest, rows: int, encode):
        """`encode()` of the request's prompts and guidance, or what it gave an earlier request
        that asked the same with the same text-encoder adapters (the conditioning cache)."""
        key = (request.prompt, request.negative_prompt, rows == 2, self._text_key)
        return self.conditioning.text(key, encode)

    def latent_dist(self, pixels: torch.Tensor):
        """The VAE's latent distribution of `pixels`, from the conditioning cache when the same
        pixels were encoded before; the caller samples it with its request's generator."""
        return self.conditioning.latent_dist(pixels, lambda: self.pipe.vae.encode(pixels).latent_dist)

    def uses_cfg(self, request: ImageRequest) -> bool:
        return request.guidance_scale > CFG_FROM.get(self.name, 1.0)

    def request_rows(self) -> int:
        """The rows a guided request takes (2 with CFG), as the warm-up's requests are."""
        return 2 if self.uses_cfg(ImageRequest("rows", "rows", 64, 64, 2, 5.0, seed=0)) else 1

    def edit_pixels(self, image: np.ndarray) -> torch.Tensor:
        """An upload's uint8 [H, W, 3] as [1, 3, H, W] in [-1, 1] on the device."""
        pixels = torch.from_numpy(image.copy()).permute(2, 0, 1)[None].to(self.device, torch.float32) / 127.5 - 1.0
        return pixels.to(self.dtype)

    def finish_edit(self, state: DenoiseState, image_latents, noise: torch.Tensor, latent_hw) -> None:
        """An edit's latent-space data: its original's latents and its initial noise, and its mask
        at the latent grid `latent_hw`, laid out as the latents are, in the noise's dtype."""
        edit = state.edit
        edit.image_latents, edit.noise = image_latents, noise
        edit.latent_mask = self.latent_layout(edit.mask.latent(latent_hw, self.device, noise.dtype))

    def latent_layout(self, grid: torch.Tensor) -> torch.Tensor:
        """A [1, 1, h, w] tensor at the latent grid laid out to broadcast against the latents."""
        return grid

    # -- denoising (engine thread) --------------------------------------------------------

    @property
    def denoiser(self) -> torch.nn.Module:
        return self.pipe.unet if hasattr(self.pipe, "unet") else self.pipe.transformer

    @torch.no_grad()
    def predict(self, states: list[DenoiseState], patched: bool = False,
                blocks: CachedForward | None = None) -> list[torch.Tensor]:
        """Per state, its rows' noise predictions from one batched forward: of requests of one
        latent shape, or of any mix of shapes cut into patches. `blocks`: the block pass the
        denoiser's blocks run through (the block cache's reuse, per patch when patched).
        Changes no state."""
        if patched:
            return self.predict_patched(states, blocks=blocks)
        with cached_blocks(self.denoiser, blocks and blocks.begin()):
            return list(self.forward(states).split([s.rows for s in states]))

    def denoise(self, rows: dict, shared: dict) -> torch.Tensor:
        """The denoiser's prediction from inputs with one row per forward row (`rows`; tensors,
        or dicts of them) and inputs shared by all (`shared`): compiled under --compile where
        the step allows it (`gouache.runner.compiled`)."""
        if self.compiled is not None:
            return self.compiled(rows, shared)
        return self.denoiser(**rows, **shared, return_dict=False)[0]

    @torch.no_grad()
    def advance(self, state: DenoiseState, prediction: torch.Tensor) -> None:
        """One sampler step of `state` from its rows' `prediction` (guidance applied here)."""
        if state.rows == 2:
            prediction = self.guide(state, *prediction.chunk(2))
        state.latents = state.scheduler.step(prediction, state.t, state.latents, **state.step_kwargs,
                                             return_dict=False)[0]
        state.step += 1
        if state.edit is not None and self.blends_edits and state.request.strength is None:  # img2img keeps nothing
            self._blend(state)

    def guide(self, state: DenoiseState, uncond: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """Classifier-free guidance of a request's two rows' predictions."""
        return uncond + state.request.guidance_scale * (cond - uncond)

    @property
    def blends_edits(self) -> bool:
        """4/16-channel denoisers keep the unmasked region by re-noising the original each step."""
        return True

    def _blend(self, state: DenoiseState) -> None:
        edit = state.edit
        kept = edit.image_latents
        if not state.done:
            kept = self.renoise(state.scheduler, kept, edit.noise, state.timesteps[state.step])
        state.latents = (1 - edit.latent_mask) * kept + edit.latent_mask * state.latents

    # -- post-processing (post thread) ----------------------------------------------------

    def decode(self, state: DenoiseState, latents: torch.Tensor) -> np.ndarray:
        """The image of `latents` as uint8 [H, W, 3]; edits keep the original's pixels."""
        return self.decode_many([state], [latents])[0]

    @torch.no_grad()
    def decode_many(self, states: list[DenoiseState], latents: list[torch.Tensor]) -> list[np.ndarray]:
        """The images of `latents[i]` (of `states[i]`), as `decode` gives each: one VAE call per
        latent shape (the VAE's rows are independent: each image within one uint8 level of its
        own decode, the float difference of a batched forward)."""
        unpacked = [self.to_vae_latents(x, state) for x, state in zip(latents, states)]
        shapes: dict[tuple[int, ...], list[int]] = {}  # by the VAE's shape: 96x64 and 64x96 pack to one
        for i, x in enumerate(unpacked):
            shapes.setdefault(tuple(x.shape), []).append(i)
        out: list[np.ndarray] = [None] * len(states)
        for group in shapes.values():
            images = self.vae_decode(torch.cat([unpacked[i] for i in group]))
            for i, image in zip(group, images):
                out[i] = self._pixels(states[i], image[None])
        return out

    def vae_decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Images [B, 3, H, W] in [-1, 1] of VAE latents (`to_vae_latents`)."""
        return self.pipe.vae.decode(latents, return_dict=False)[0]

    def _pixels(self, state: DenoiseState, image: torch.Tensor) -> np.ndarray:
        """A decoded [1, 3, H, W] image in [-1, 1] as uint8 [H, W, 3], an edit's kept pixels restored."""
        image = (image.float() / 2 + 0.5).clamp(0, 1)
        if state.edit is not None:
            original = (state.edit.pixels.float() / 2 + 0.5).clamp(0, 1)
            m = state.edit.mask.pixel(self.device, torch.float32)
            image = original * (1 - m) + image * m
        return (image[0].permute(1, 2, 0).cpu().numpy() * 255).round().astype(np.uint8)

    # -- what each family defines ---------------------------------------------------------

    @abstractmethod
    def encode_text(self, request: ImageRequest, rows: int) -> dict[str, torch.Tensor]:
        """Conditioning tensors with `rows` rows each ([negative, positive] with CFG)."""

    @abstractmethod
    def initial_latents(self, state: DenoiseState) -> torch.Tensor:
        """Initial noise from the request's generator; an edit's latent-space data with it
        (`finish_edit`), from its original's pixels (`state.edit.pixels`)."""

    @abstractmethod
    def set_timesteps(self, state: DenoiseState) -> torch.Tensor:
        """Configure the request's scheduler as its pipeline would; return its timesteps."""

    def forward(self, states: list[DenoiseState]) -> torch.Tensor:
        """The denoiser's prediction for all rows of all states, concatenated in order."""
        return self.denoise(*self.forward_inputs(states))

    @abstractmethod
    def forward_inputs(self, states: list[DenoiseState]) -> tuple[dict, dict]:
        """The denoiser's keyword inputs for all rows of `states`: those with one row per forward
        row, and those shared by the whole forward (`denoise`)."""

    @abstractmethod
    def predict_patched(self, states: list[DenoiseState], whole_batches: bool = True,
                        blocks: CachedForward | None = None) -> list[torch.Tensor]:
        """Per state, its rows' predictions, from one forward over all of them (patched UNet,
        packed DiT); one size runs as the model's own batch unless `whole_batches` is False.
        `blocks`: the block pass, per patch / token (per image in a plain batch): the block
        cache's reuse, or a template's replay (`gouache.templates.replay.ReplayForward`)."""

    def row_maps(self, states: list[DenoiseState], patched: bool) -> dict[int, torch.Tensor] | None:
        """For a forward of `predict(states, patched)`: for each size a leading dimension of its
        layers' inputs takes, the forward row (row of a state, in order) of each index; None
        where those cannot be told apart (patches of mixed sizes). Adapters of several sets
        apply to their own rows by it (`gouache.lora.apply.segmented`)."""
        rows = sum(s.rows for s in states)
        if patched and len(by_shape(states)) > 1:
            return None
        return {rows: torch.arange(rows)}

    def replay(self, states: list[DenoiseState], replay: ReplayForward) -> list[torch.Tensor]:
        """Per state, its rows' predictions from one forward in which `replay`'s edits compute
        their masked tokens only (`gouache.templates.replay`); a family that serves no templates
        (`describe.UNSERVED`: admission keeps their edits away) raises."""
        raise ValueError(f"{self.name} models serve no templates: {UNSERVED[self.name]['template']}")

    @abstractmethod
    def template_blocks(self) -> list[str]:
        """Keys of the blocks whose outputs a template records, in forward order."""

    @property
    @abstractmethod
    def token_pixels(self) -> int:
        """Pixels per side of one token of `token_mask`."""

    def token_mask(self, state: DenoiseState) -> torch.Tensor:
        """[tokens] bool, in the forward's order: the image's tokens in raster order that an edit's
        mask repaints (a UNet's token is a latent pixel), then its reference's, if any, none
        repainted (a template replays them: FLUX.1 Kontext's reference is its original)."""
        r = state.request
        tokens = state.edit.mask.tokens((r.height // self.vae_scale, r.width // self.vae_scale),
                                        self.token_pixels // self.vae_scale, self.device)
        references = self.token_count(state) - len(tokens)
        return torch.cat([tokens, tokens.new_zeros(references)]) if references else tokens

    @abstractmethod
    def token_count(self, state: DenoiseState) -> int:
        """Tokens of one of the state's images."""

    def layout(self, samples: list[torch.Tensor]) -> PatchLayout:
        """The forward's patches: the largest side up to `patch` that cuts every image whole (a
        multiple of `patch_factor`; every size the model takes is one), so mixing sizes never
        narrows the sizes served."""
        shapes = [tuple(x.shape[-2:]) for x in samples]
        common = math.gcd(*(side for shape in shapes for side in shape))
        top = self.patch - self.patch % self.patch_factor
        side = next(p for p in range(top, 0, -self.patch_factor) if common % p == 0)
        return PatchLayout.build(shapes, side)

    @abstractmethod
    def encode_pixels(self, pixels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Clean latents of an image, in the denoiser's layout."""

    @abstractmethod
    def renoise(self, scheduler, clean: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Noise clean latents to timestep t, as the family's inpaint pipeline does."""

    @abstractmethod
    def to_vae_latents(self, latents: torch.Tensor, state: DenoiseState) -> torch.Tensor:
        """Undo scaling (and packing) so the VAE can decode."""


def by_shape(states: list[DenoiseState]) -> dict[tuple[int, ...], list[DenoiseState]]:
    groups: dict[tuple[int, ...], list[DenoiseState]] = {}
    for state in states:
        groups.setdefault(tuple(state.latents.shape), []).append(state)
    return groups


def per_group(states: list[DenoiseState], key: Callable[[DenoiseState], Hashable],
              forward: Callable[[list[DenoiseState]], torch.Tensor]) -> list[torch.Tensor]:
    """Per state, its rows of `forward(group)`: one forward per group of states of one `key`."""
    groups: dict[Hashable, list[DenoiseState]] = {}
    for state in states:
        groups.setdefault(key(state), []).append(state)
    out: dict[int, torch.Tensor] = {}
    for group in groups.values():
        out.update(zip(map(id, group), forward(group).split([s.rows for s in group])))
    return [out[id(s)] for s in states]


def latent_statistics(vae, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A Wan-type 3D VAE's (Qwen-Image's, Wan's) per-channel latent mean and 1/std, shaped
    [1, C, 1, 1, 1] as their pipelines use them, in `latents`' device and dtype."""
    config = vae.config
    shape = (1, config.z_dim, 1, 1, 1)
    mean = torch.tensor(config.latents_mean).view(shape).to(latents.device, latents.dtype)
    inverse_std = 1.0 / torch.tensor(config.latents_std).view(shape).to(latents.device, latents.dtype)
    return mean, inverse_std


def pad_cat(rows: list[torch.Tensor], length: int) -> torch.Tensor:
    """[L_i, D] rows zero-padded to [len(rows), length, D]."""
    return torch.stack([torch.cat([r, r.new_zeros(length - len(r), r.shape[-1])]) for r in rows])


def by_state(outputs: list[torch.Tensor], states: list[DenoiseState]) -> list[torch.Tensor]:
    """Per-row outputs (in state order) stacked back into one [rows, ...] tensor per state."""
    out, start = [], 0
    for state in states:
        out.append(torch.stack(outputs[start : start + state.rows]))
        start += state.rows
    return out


def row_timesteps(states: list[DenoiseState]) -> torch.Tensor:
    """[sum rows] timesteps: each state's own, repeated for its rows."""
    return torch.cat([s.t.expand(s.rows) for s in states])


def cat_cond(states: list[DenoiseState], key: str) -> torch.Tensor:
    """One conditioning input for a batched forward: every state's rows, in order."""
    return torch.cat([s.cond[key] for s in states])
