"""What the runner holds for one request while it denoises: latents, its own sampler, conditioning.

Every request owns a fresh diffusers scheduler instance (its step index and sigmas are its
own) and its own `torch.Generator`, so what else is in the batch never changes its result.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from diffusers import SchedulerMixin

    from gouache.controlnet.runtime import ControlUse
    from gouache.lora.runtime import LoraUse
    from gouache.request import ImageRequest
    from gouache.templates.replay import TemplateUse
    from gouache.uploads import EditMask


@dataclass
class EditInputs:
    """An edit's original image and mask, in pixel and latent space. Mask value 1 = repaint."""

    pixels: torch.Tensor  # [1, 3, H, W] original image in [-1, 1]
    mask: EditMask  # where it repaints (its pixel form makes the final composite over the original)
    # the rest is set with the initial latents (`Family.finish_edit`):
    # clean latents of the original, in the denoiser's latent layout (None: 9-channel UNets, which never blend)
    image_latents: torch.Tensor | None = None
    latent_mask: torch.Tensor | None = None  # the mask's latent form in the denoiser's layout (broadcasts to latents)
    noise: torch.Tensor | None = None  # the initial noise; re-noising the kept region uses the same noise
    masked_image_latents: torch.Tensor | None = None  # 9-channel UNets: latents of the image with the hole

    def hole(self) -> torch.Tensor:
        """The original with its repainted region zeroed (what a 9-channel UNet encodes)."""
        return self.pixels * (self.mask.pixel(self.pixels.device, self.pixels.dtype) < 0.5)


@dataclass
class DenoiseState:
    request: ImageRequest
    scheduler: SchedulerMixin  # this request's own sampler instance
    timesteps: torch.Tensor  # [num_steps]
    latents: torch.Tensor  # [1, C, h, w]; Flux: packed [1, h*w/4, 4C]
    generator: torch.Generator  # seeded with request.seed; the only source of randomness
    rows: int  # forward rows: 2 with classifier-free guidance ([uncond, cond]), else 1
    # family-specific inputs, each [rows, ...]; "reference": an instruction edit's reference tokens
    cond: dict[str, torch.Tensor] = field(default_factory=dict)
    step_kwargs: dict = field(default_factory=dict)  # extra kwargs of scheduler.step (generator, eta)
    edit: EditInputs | None = None
    template: TemplateUse | None = None  # an edit that reuses a template's activations
    lora: LoraUse | None = None  # the request's LoRA adapters
    control: ControlUse | None = None  # the request's ControlNets and their conditioning images
    step: int = 0  # denoising steps done

    def nbytes(self) -> int:
        """Bytes of its tensors (latents, conditioning, an edit's inputs, ControlNet images and
        residuals): about what parking it moves to host memory."""
        from gouache.runner.conditioning import tensor_bytes

        return tensor_bytes([self.latents, self.timesteps, self.cond, self.edit, self.template, self.control])

    @property
    def t(self) -> torch.Tensor:
        return self.timesteps[self.step]

    @property
    def done(self) -> bool:
        return self.step >= len(self.timesteps)


@dataclass(frozen=True)
class Parked:
    """A paused request's `DenoiseState` in host memory (`ModelRunner.park`): pickled, so its
    tensors are copied off the device, whose copies go with the state object; `restore` puts
    them back on the devices they came from. Sampler, generator and step count travel with it,
    so the request resumes exactly where it stopped."""

    blob: bytes

    @classmethod
    def of(cls, state: DenoiseState) -> Parked:
        return cls(pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL))

    def restore(self) -> DenoiseState:
        return pickle.loads(self.blob)
