"""Random conditioning for a bare denoiser, so full-size architectures (`sdxl-arch`,
`sd3-arch`, `flux-arch`: real configs, random weights, no text encoders or VAE) can be timed
grouped and in one forward (patched UNets, packed DiTs) on a GPU. Shapes follow each model's config."""

from __future__ import annotations

import torch
from diffusers import FluxPipeline, FluxTransformer2DModel, SD3Transformer2DModel

from gouache.runner.layout import PatchLayout
from gouache.runner.pack_flux import packed_flux_forward
from gouache.runner.pack_sd3 import packed_sd3_forward
from gouache.runner.patch_ops import patched_unet_forward

TEXT_TOKENS = {"unet": 77, "sd3": 333, "flux": 512}  # the pipelines' defaults


def family_of_denoiser(model) -> str:
    if isinstance(model, FluxTransformer2DModel):
        return "flux"
    return "sd3" if isinstance(model, SD3Transformer2DModel) else "unet"


class DenoiserBench:
    """One image per latent shape (h, w) in latent pixels; `grouped()` runs one forward per
    shape, `one_forward(layout)` one forward over all of them."""

    def __init__(self, model, shapes: list[tuple[int, int]], seed: int = 0):
        self.model, self.family, self.shapes = model, family_of_denoiser(model), shapes
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.gen = torch.Generator(device="cpu").manual_seed(seed)
        n = len(shapes)
        c = model.config
        unit = 2 if self.family == "flux" else 1  # Flux works on 2x2-packed token grids
        channels = c.in_channels
        self.samples = [self._rand(channels, h // unit, w // unit) for h, w in shapes]
        self.timestep = (torch.rand(n, generator=self.gen).to(self.device, self.dtype)
                         * (1 if self.family == "flux" else 999))
        text_dim = c.cross_attention_dim if self.family == "unet" else c.joint_attention_dim
        self.text = self._rand(n, TEXT_TOKENS[self.family], text_dim)
        if self.family == "unet":
            time_dim = c.addition_time_embed_dim
            added = c.projection_class_embeddings_input_dim
            self.added = None if time_dim is None else {
                "text_embeds": self._rand(n, added - 6 * time_dim), "time_ids": self._rand(n, 6).abs() * 1024}
        else:
            self.pooled = self._rand(n, c.pooled_projection_dim)
        if self.family == "flux":
            self.guidance = torch.full((n,), 3.5, device=self.device, dtype=self.dtype) if c.guidance_embeds else None
            self.txt_ids = torch.zeros(TEXT_TOKENS["flux"], 3, device=self.device, dtype=self.dtype)

    def _rand(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(self.device, self.dtype)

    def grouped(self) -> None:
        groups: dict[tuple[int, int], list[int]] = {}
        for i, shape in enumerate(self.shapes):
            groups.setdefault(shape, []).append(i)
        for index in groups.values():
            self._forward(index)

    def _forward(self, index: list[int]) -> torch.Tensor:
        x = torch.stack([self.samples[i] for i in index])
        t, text = self.timestep[index], self.text[index]
        if self.family == "unet":
            added = None if self.added is None else {k: v[index] for k, v in self.added.items()}
            return self.model(x, t, encoder_hidden_states=text, added_cond_kwargs=added, return_dict=False)[0]
        if self.family == "sd3":
            return self.model(hidden_states=x, timestep=t, encoder_hidden_states=text,
                              pooled_projections=self.pooled[index], return_dict=False)[0]
        _, _, h, w = x.shape
        img_ids = FluxPipeline._prepare_latent_image_ids(1, h, w, self.device, self.dtype)
        guidance = None if self.guidance is None else self.guidance[index]
        return self.model(hidden_states=x.flatten(2).transpose(1, 2), timestep=t, guidance=guidance,
                          pooled_projections=self.pooled[index], encoder_hidden_states=text,
                          txt_ids=self.txt_ids, img_ids=img_ids, return_dict=False)[0]

    def layout(self, patch: int) -> PatchLayout:
        return PatchLayout.build([tuple(x.shape[-2:]) for x in self.samples], patch)

    def one_forward(self, layout: PatchLayout | None, whole_batches: bool = True) -> list[torch.Tensor]:
        """Every image in one forward: patched by `layout` (UNets), packed by tokens (DiTs)."""
        if self.family == "unet":
            return patched_unet_forward(self.model, layout, self.samples, self.timestep, self.text, self.added,
                                        whole_batches)
        if self.family == "sd3":
            return packed_sd3_forward(self.model, self.samples, self.timestep, self.text, self.pooled, whole_batches)
        return packed_flux_forward(self.model, self.samples, self.timestep, self.guidance, self.pooled, self.text,
                                   self.txt_ids, whole_batches)
