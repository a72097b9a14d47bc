"""Train a LoRA of the shapes UNet in a style the base model does not know: its palette turned
by one (red shapes drawn green, green blue, ..., cyan red: `STYLE`), captions unchanged; or the
same style as a LoRA of the edit model (shapes-edit), as a style LoRA of FLUX.1 Kontext is: the
instruction carried out and the whole result drawn in the style, the upload as it is. It is a
style adapter, as most adapters are: no word of its own, the same prompts with another look,
in colours the shapes VAE can draw (it cannot draw one it never saw: a pink comes back orange).
Only the adapter's low-rank weights train (the denoiser, its text encoders and the VAE are
frozen), on the base model's own loss (the UNet's velocity loss with extra weight on shapes; the
edit model's flow loss with extra weight where the target differs from the upload: restyled,
every shape). The checker counts the effect: a red shape asked, a green one found (`gouache
bench adapters`).

The file is in diffusers' (peft) keys, like any adapter a user brings.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save
from torch import nn

from gouache.data.edits import Edit
from gouache.data.shapes import Scene, Shape
from gouache.files import write_atomic
from gouache.models import trained
from gouache.train import edit
from gouache.train.loop import Report, Schedule, is_writer, seed_everything, shapes_batch, train
from gouache.train.unet import BATCH, denoising_loss, drop_captions, foreground_weights, frozen_pipeline

RANK = 16
# attention and feed-forward linears, the transformer blocks' projections, the resnets' convolutions
# (LoCon: the last up block, at full latent resolution, has no attention, and colour is drawn there)
TARGETS = (r".*attn[12]\.(to_q|to_k|to_v|to_out\.0)|.*\.ff\.net\.(0\.proj|2)|.*\.(proj_in|proj_out)"
           r"|.*resnets\.\d+\.conv[12]")
COLOURS_IN_ORDER = ("red", "green", "blue", "yellow", "purple", "cyan")
STYLE = dict(zip(COLOURS_IN_ORDER, COLOURS_IN_ORDER[1:] + COLOURS_IN_ORDER[:1]))  # asked colour -> drawn colour
# the edit transformer's: attention (image and text streams), feed-forwards, the single blocks'
# MLP and output projections, the patch embedding and the final projection (colour is read in and
# written out there)
EDIT_TARGETS = (r".*attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)"
                r"|.*ff(_context)?\.net\.(0\.proj|2)|.*proj_mlp|.*proj_out|x_embedder")
LR = 2e-3
NAME = "palette"


def turned(shape: Shape) -> Shape:
    """The shape in the style's colour: the next one."""
    return replace(shape, colour=STYLE.get(shape.colour, shape.colour))


def restyle(scene: Scene) -> Scene:
    """The scene as the adapter draws it: each shape in the next colour (still all distinct)."""
    return replace(scene, shapes=tuple(turned(shape) for shape in scene.shapes))


def restyle_edit(edit: Edit) -> Edit:
    """The edit as the adapter of the edit model carries it out: its scenes drawn restyled."""
    return replace(edit, source=restyle(edit.source), target=restyle(edit.target),
                   removed=edit.removed and turned(edit.removed))


def lora_dir(model: str, directory: Path = trained.WEIGHTS_DIR) -> Path:
    """Where the trained adapters of a built-in shapes model are: a `--lora-dir`."""
    return directory / "loras" / model


class TrainableLora(nn.Module):
    """Low-rank updates of a denoiser's linears and convolutions (a convolution's down projection
    has its kernel, its up projection is 1x1), trained through forward hooks (the denoiser is not
    changed). Down projections start small and random, up projections at zero."""

    def __init__(self, denoiser: nn.Module, targets: str = TARGETS, rank: int = RANK):
        super().__init__()
        self.paths = [name for name, m in denoiser.named_modules()
                      if isinstance(m, nn.Linear | nn.Conv2d) and re.fullmatch(targets, name)]
        if not self.paths:
            raise ValueError(f"no linear or convolution of the denoiser matches {targets!r}")
        self.down = nn.ParameterList()
        self.up = nn.ParameterList()
        for path in self.paths:
            weight = denoiser.get_submodule(path).weight  # [out, in] or [out, in, kh, kw]
            fan_in = weight[0].numel()
            self.down.append(nn.Parameter(torch.randn(rank, *weight.shape[1:]) / fan_in**0.5))
            self.up.append(nn.Parameter(torch.zeros(weight.shape[0], rank, *[1] * (weight.ndim - 2))))

    @contextlib.contextmanager
    def attached(self, denoiser: nn.Module) -> Iterator[None]:
        def update(module: nn.Module, x: torch.Tensor, index: int) -> torch.Tensor:
            if isinstance(module, nn.Conv2d):
                hidden = F.conv2d(x, self.down[index], None, module.stride, module.padding, module.dilation)
                return F.conv2d(hidden, self.up[index])
            return F.linear(F.linear(x, self.down[index]), self.up[index])

        def hook(index: int):
            return lambda module, args, output: output + update(module, args[0], index)

        handles = [denoiser.get_submodule(path).register_forward_hook(hook(i)) for i, path in enumerate(self.paths)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def peft_state(self, prefix: str) -> dict[str, torch.Tensor]:
        """Its weights in diffusers' keys (alpha = rank: scale 1)."""
        state = {}
        for path, down, up in zip(self.paths, self.down, self.up):
            state[f"{prefix}.{path}.lora_A.weight"] = down.detach().float().cpu().contiguous()
            state[f"{prefix}.{path}.lora_B.weight"] = up.detach().float().cpu().contiguous()
        return state


def train_lora(seed: int, steps: int, out: Path, device: str = "cpu", lr: float = LR) -> Report:
    """The palette LoRA of the shapes UNet."""
    generator = seed_everything(seed, device)
    pipe = frozen_pipeline(out, device)
    vae, unet = pipe.vae, pipe.unet
    alphas = pipe.scheduler.alphas_cumprod.to(device)
    lora = TrainableLora(unet).to(device)

    def loss_of(step: int) -> torch.Tensor:
        batch = shapes_batch(seed, step, BATCH, trained.TRAIN_SIZES, device, restyle)
        with torch.no_grad():
            latents = vae.encode(batch.pixels).latent_dist.sample(generator) * vae.config.scaling_factor
            embeds = pipe.encode_prompt(drop_captions(batch.captions, generator), device, 1, False)[0]
        weights = foreground_weights(batch.pixels, tuple(latents.shape[2:]))
        with lora.attached(unet):
            return denoising_loss(unet, latents, embeds, alphas, generator, weights=weights)

    kept, report = train("lora", lora, loss_of, Schedule(steps=steps, lr=lr, warmup=100), seed)
    return written(kept, report, "shapes-unet", "unet", out)


def train_edit_lora(seed: int, steps: int, out: Path, device: str = "cpu", lr: float = LR) -> Report:
    """The palette LoRA of shapes-edit: edits of the training pairs with their targets restyled."""
    generator = seed_everything(seed, device)
    pipe = edit.frozen_edit_pipeline(out, device)
    lora = TrainableLora(pipe.transformer, EDIT_TARGETS).to(device)

    def loss_of(step: int) -> torch.Tensor:
        batch = edit.edit_batch(seed, step, edit.BATCH // edit.NOISE_DRAWS, trained.TRAIN_SIZES, device, restyle)
        with lora.attached(pipe.transformer):
            return edit.edit_loss(pipe, *batch, generator)

    kept, report = train("edit-lora", lora, loss_of, Schedule(steps=steps, lr=lr, warmup=100), seed)
    return written(kept, report, "shapes-edit", "transformer", out)


def written(kept: TrainableLora, report: Report, model: str, prefix: str, out: Path) -> Report:
    """Write the trained adapter of `model` (the first process does) as `lora_dir(model, out)/NAME`."""
    if is_writer():
        path = lora_dir(model, out) / f"{NAME}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, save(kept.peft_state(prefix)))
        report.extra.update(rank=RANK, layers=len(kept.paths), file=str(path))
    return report
