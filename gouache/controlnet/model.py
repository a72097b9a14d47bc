"""ControlNets of a UNet (KATZ §5): diffusers directories checked against the base model from
their config alone (`cache` loads them), random ones for tests, and the residuals one
ControlNet gives some rows of a forward.

A ControlNet's residuals add to the UNet's skip connections (down blocks) and to its middle
block's output; diffusers' UNet takes them as `down_block_additional_residuals` and
`mid_block_additional_residual`. A ControlNet fits a UNet when its encoder has the UNet's
encoder's shape: channels, layers, text width and (SDXL) added conditioning.
"""

from __future__ import annotations

import inspect
import json
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from gouache.adapter_names import CONFIG, ControlNetError

# ControlNetModel config keys that must equal the UNet's: the residuals' count, channels and
# sizes, and the inputs the ControlNet shares with the UNet (latents, text, added conditioning)
MATCHING = ("in_channels", "block_out_channels", "layers_per_block", "cross_attention_dim", "addition_embed_type",
            "addition_time_embed_dim", "projection_class_embeddings_input_dim")
CONDITIONING_CHANNELS = 3  # the conditioning is an RGB image


def supports_controlnets(pipe) -> str | None:
    """Why `pipe` takes no ControlNets, or None if it does."""
    unet = getattr(pipe, "unet", None)
    if unet is None:
        return "ControlNets are served for UNet models (SD, SDXL); this model is a transformer"
    if unet.config.in_channels != 4:
        return f"ControlNets are served for 4-channel UNets; this one takes {unet.config.in_channels} (inpainting)"
    return None


def check_config(config: dict, unet_config: dict, name: str) -> None:
    """Raise ControlNetError unless a ControlNet of `config` fits a UNet of `unet_config`."""
    from diffusers import ControlNetModel

    if config.get("_class_name", "ControlNetModel") != "ControlNetModel":
        raise ControlNetError(f"ControlNet {name!r} is a {config.get('_class_name')}, not a diffusers ControlNetModel")
    defaults = {k: p.default for k, p in inspect.signature(ControlNetModel.__init__).parameters.items()}
    for key in MATCHING:
        theirs, ours = config.get(key, defaults.get(key)), unet_config.get(key)
        if isinstance(theirs, list | tuple) and isinstance(ours, list | tuple):
            theirs, ours = list(theirs), list(ours)
        if theirs != ours:
            raise ControlNetError(f"ControlNet {name!r} does not fit this model: its {key} is {theirs!r}, "
                                  f"the UNet's {ours!r}")
    channels = config.get("conditioning_channels", defaults["conditioning_channels"])
    if channels != CONDITIONING_CHANNELS:
        raise ControlNetError(f"ControlNet {name!r} takes {channels}-channel conditioning; gouache sends RGB images")


def random_controlnet(pipe, seed: int = 0, std: float = 0.02):
    """A ControlNet of `pipe`'s UNet (its encoder's weights, as training starts from) whose
    zero-initialised convolutions are random instead, so its residuals are not zero: for tests
    and benchmarks; in the UNet's dtype (built in it: a full-size one in fp32 first would take
    twice the memory)."""
    from diffusers import ControlNetModel

    from gouache.models.arch import default_dtype

    with default_dtype(pipe.unet.dtype):
        model = ControlNetModel.from_unet(pipe.unet, conditioning_channels=CONDITIONING_CHANNELS)
    generator = torch.Generator().manual_seed(seed)
    zero = [*model.controlnet_down_blocks, model.controlnet_mid_block, model.controlnet_cond_embedding.conv_out]
    with torch.no_grad():
        for conv in zero:
            nn.init.normal_(conv.weight, std=std, generator=generator)
            nn.init.normal_(conv.bias, std=std, generator=generator)
    return model


@torch.no_grad()
def residuals(model, sample: torch.Tensor, timesteps: torch.Tensor, embeds: torch.Tensor, embedded: torch.Tensor,
              added: dict[str, torch.Tensor] | None, run: Callable | None = None) -> list[torch.Tensor]:
    """The ControlNet's down residuals, then its middle one, for these rows at scale 1 (the
    caller scales each row: diffusers multiplies by the scale last, so this is exact), from
    their conditioning images already through its conditioning embedding (`Embeddings`).
    `run(model, inputs)`: how its forward runs (`ControlRuntime`: compiled), else `skipping_embedding`."""
    if _bgr(model):
        embedded = embedded.flip(1)  # the model flips its conditioning's channels first: this undoes it
    inputs = {"sample": sample, "timestep": timesteps, "encoder_hidden_states": embeds, "controlnet_cond": embedded,
              "added_cond_kwargs": added}
    return (run or skipping_embedding)(model, inputs)


def skipping_embedding(model, inputs: dict, fn: Callable | None = None) -> list[torch.Tensor]:
    """`fn(model, **inputs)` (`forward` by default) with the model's conditioning embedding
    skipped: its conditioning is already embedded, the same at every step."""
    embedding = model.controlnet_cond_embedding
    previous = embedding.__dict__.get("forward")  # another wrapper's, kept
    embedding.forward = _embedded
    try:
        return (fn or forward)(model, **inputs)
    finally:
        if previous is None:
            del embedding.forward  # the class's forward again
        else:
            embedding.forward = previous


def forward(model, **inputs) -> list[torch.Tensor]:
    """A ControlNet's down residuals, then its middle one, at scale 1."""
    down, mid = model(**inputs, conditioning_scale=1.0, return_dict=False)
    return [*down, mid]


def _embedded(cond: torch.Tensor) -> torch.Tensor:
    """The conditioning embedding of a conditioning already embedded: one function, so that a
    compiled ControlNet's guard on it holds from step to step."""
    return cond


def _bgr(model) -> bool:
    return model.config.get("controlnet_conditioning_channel_order", "rgb") == "bgr"


class Embeddings:
    """Conditioning images through a ControlNet's conditioning embedding, once per request and
    ControlNet. The embedding reads the image alone (at full pixel resolution: most of a small
    ControlNet's work), so its output is the same at every step."""

    def __init__(self):
        self._by: dict[tuple[str, str], tuple[weakref.ref, torch.Tensor]] = {}  # (name, cond id) -> (model, output)

    @torch.no_grad()
    def rows(self, name: str, model, cond_ids: list[str], conds: dict[str, torch.Tensor]) -> torch.Tensor:
        """[n, C, h, w] each row's embedded conditioning (`conds[cond_ids[i]]` through `model`'s)."""
        out = []
        for cond_id in cond_ids:
            hit = self._by.get((name, cond_id))
            if hit is None or hit[0]() is not model:  # new, or the ControlNet was loaded anew meanwhile
                image = conds[cond_id].flip(1) if _bgr(model) else conds[cond_id]
                hit = self._by[name, cond_id] = (weakref.ref(model), model.controlnet_cond_embedding(image))
            out.append(hit[1])
        return torch.cat(out)

    def forget(self, cond_ids: set[str]) -> None:
        for key in [key for key in self._by if key[1] in cond_ids]:
            del self._by[key]

    def forget_request(self, request_id: str) -> None:
        """Every conditioning of a request (ids "<request id>/<k>")."""
        self.forget({cond_id for _, cond_id in self._by if cond_id.rsplit("/", 1)[0] == request_id})


def residual_shapes(unet_config: dict, rows: int, height: int, width: int) -> list[tuple[int, ...]]:
    """The shapes of a ControlNet's down residuals, then its middle one, for `rows` latents of
    height x width: the outputs of the UNet encoder's input convolution, of every resnet and of
    every downsampler (stride 2), then of its middle block."""
    channels, layers = unet_config["block_out_channels"], unet_config["layers_per_block"]
    layers = [layers] * len(channels) if isinstance(layers, int) else layers
    shapes = [(rows, channels[0], height, width)]
    for i, (c, n) in enumerate(zip(channels, layers)):
        shapes += [(rows, c, height, width)] * n
        if i < len(channels) - 1:
            height, width = (height + 1) // 2, (width + 1) // 2
            shapes.append((rows, c, height, width))
    return shapes + [(rows, channels[-1], height, width)]


@dataclass(frozen=True)
class Base:
    """What a ControlNet must fit, and where it runs: the UNet's config, its dtype and device
    (picklable: service processes get it without the model)."""

    unet_config: dict
    dtype: torch.dtype = torch.float32
    device: str = "cpu"

    @classmethod
    def of(cls, pipe) -> Base | None:
        """The base of a loaded pipeline; None if it takes no ControlNets."""
        if supports_controlnets(pipe):
            return None
        return cls(dict(pipe.unet.config), pipe.unet.dtype, str(pipe.unet.device))

    @classmethod
    def of_model(cls, model: str, dtype: str, device: str) -> Base | None:
        """The base of a model not loaded here (a local directory's UNet config; a built-in is built)."""
        from gouache.models.zoo import load_pipeline, torch_dtype

        unet = Path(model) / "unet" / CONFIG
        if not Path(model).is_dir():
            return cls.of(load_pipeline(model, dtype))
        if not unet.is_file():
            return None
        config = json.loads(unet.read_text())
        return cls(config, torch_dtype(dtype), device) if config.get("in_channels", 4) == 4 else None
