"""LoRA adapters of a denoiser (KATZ §6): a file read into its layers, merged into the base
weights in place, or applied to its own rows of a forward next to other adapters.

A file is a safetensors state dict in any format diffusers reads (diffusers / peft keys,
kohya's `lora_unet_*`, and the others its pipelines' `lora_state_dict` converts); it is
converted with diffusers' own utilities, then every layer is checked against the denoiser it
is for (module, kind, shapes) so that a wrong file is refused before it reaches a forward.
Text-encoder layers are refused: adapters apply to the denoiser only.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from gouache.adapters.directory import LoraError

METADATA_KEY = "lora_adapter_metadata"  # diffusers' key of a file's peft settings (r, lora_alpha, patterns)


@dataclass(frozen=True)
class LoraLayer:
    """One module's low-rank update W += scale * up @ down."""

    down: torch.Tensor  # A: [r, in] (linear) or [r, in, kh, kw] (conv)
    up: torch.Tensor  # B: [out, r] or [out, r, 1, 1]
    scale: float  # alpha / r

    @property
    def nbytes(self) -> int:
        return self.down.nbytes + self.up.nbytes

    def delta(self, weight: torch.Tensor) -> torch.Tensor:
        """scale * up @ down in float32 on `weight`'s device, shaped like `weight`."""
        product = self.up.to(weight.device).flatten(1).float() @ self.down.to(weight.device).flatten(1).float()
        return (self.scale * product).view(weight.shape)


@dataclass(frozen=True)
class Lora:
    """An adapter: its layers by module path in the denoiser."""

    name: str
    layers: dict[str, LoraLayer]
    version: int = 0  # its file's modification time (ns): a rewritten file is another adapter

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers.values())

    def to(self, device: torch.device) -> Lora:
        """A copy whose layers sit on `device` (still float32: merges compute in it)."""
        layers = {path: LoraLayer(layer.down.to(device), layer.up.to(device), layer.scale)
                  for path, layer in self.layers.items()}
        return Lora(self.name, layers, self.version)


def denoiser_prefix(pipe) -> str:
    return "unet" if hasattr(pipe, "unet") else "transformer"


def read_lora(path: Path, pipe, name: str, version: int = 0) -> Lora:
    """The adapter in file `path` for `pipe`'s denoiser; LoraError if it is not one."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    try:
        raw = load_file(str(path), device="cpu")
        with safe_open(str(path), "pt") as handle:
            metadata = handle.metadata() or {}
    except (SafetensorError, OSError, ValueError) as error:
        raise LoraError(f"LoRA {name!r} is not a readable safetensors file ({error})") from None
    if not raw:
        raise LoraError(f"LoRA {name!r} holds no tensors")
    return parse_lora(raw, metadata, pipe, name, version)


def parse_lora(raw: dict[str, torch.Tensor], metadata: dict[str, str], pipe, name: str, version: int = 0) -> Lora:
    """Convert a state dict with diffusers' utilities and check it against the denoiser."""
    from diffusers.utils.state_dict_utils import convert_unet_state_dict_to_peft

    prefix = denoiser_prefix(pipe)
    try:
        converted = type(pipe).lora_state_dict(dict(raw))
    except Exception as error:  # diffusers' converters raise anything on a foreign layout
        raise LoraError(f"LoRA {name!r}: diffusers cannot read its keys ({type(error).__name__}: {error})") from None
    state, alphas = converted if isinstance(converted, tuple) else (converted, None)
    foreign = sorted({key.split(".")[0] for key in state if not key.startswith(prefix + ".")})
    if foreign:
        raise LoraError(f"LoRA {name!r} has layers for {', '.join(foreign)}; gouache applies LoRAs to the {prefix} only")
    state = convert_unet_state_dict_to_peft({key[len(prefix) + 1:]: value for key, value in state.items()})
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        match = re.fullmatch(r"(.+)\.(lora_A|lora_B)\.weight", key)
        if match is None:
            raise LoraError(f"LoRA {name!r}: key {key!r} is not a LoRA down or up weight (DoRA, biases and full "
                            "weight differences are not supported)")
        parts.setdefault(match[1], {})[match[2]] = value
    alpha_of = _alphas(alphas or {}, prefix, convert_unet_state_dict_to_peft)
    settings = _settings(metadata, prefix, name)
    layers = {}
    denoiser = pipe.unet if prefix == "unet" else pipe.transformer
    for module_name, pair in parts.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise LoraError(f"LoRA {name!r}: {module_name} has {' and '.join(pair)} only")
        down, up = pair["lora_A"], pair["lora_B"]
        _check_layer(denoiser, module_name, down, up, name)
        rank = down.shape[0]
        alpha = alpha_of.get(module_name, settings.alpha(module_name, rank))
        layers[module_name] = LoraLayer(down.float().contiguous(), up.float().contiguous(), float(alpha) / rank)
    return Lora(name, layers, version)


def _alphas(alphas: dict, prefix: str, convert) -> dict[str, float]:
    """kohya's network alphas, by module path (their keys converted like the weights')."""
    out = {}
    for key, value in alphas.items():
        base = key[: -len(".alpha")] if key.endswith(".alpha") else key
        base = base[len(prefix) + 1:] if base.startswith(prefix + ".") else base
        for converted in convert({base: 0}):
            out[re.sub(r"\.(lora_A|lora_B)\.weight$", "", converted)] = float(value)
    return out


@dataclass(frozen=True)
class _Settings:
    """A file's peft settings (diffusers writes them in its metadata): alpha per module."""

    lora_alpha: float | None = None
    alpha_pattern: tuple[tuple[str, float], ...] = ()

    def alpha(self, module_name: str, rank: int) -> float:
        for pattern, alpha in self.alpha_pattern:
            if re.fullmatch(rf"(.*\.)?(?:{pattern})", module_name):
                return alpha
        return rank if self.lora_alpha is None else self.lora_alpha  # peft's default alpha = r: scale 1


def _settings(metadata: dict[str, str], prefix: str, name: str) -> _Settings:
    if METADATA_KEY not in metadata:
        return _Settings()
    try:
        config = json.loads(metadata[METADATA_KEY])
    except json.JSONDecodeError:
        raise LoraError(f"LoRA {name!r}: its {METADATA_KEY} metadata is not JSON") from None
    own = {key.split(".", 1)[1]: value for key, value in config.items() if key.startswith(prefix + ".")}
    if own.get("use_dora"):
        raise LoraError(f"LoRA {name!r} is a DoRA; only plain LoRA is supported")
    alpha = own.get("lora_alpha")
    pattern = tuple((str(k), float(v)) for k, v in (own.get("alpha_pattern") or {}).items())
    return _Settings(None if alpha is None else float(alpha), pattern)


def _check_layer(denoiser: nn.Module, module_name: str, down: torch.Tensor, up: torch.Tensor, name: str) -> None:
    try:
        module = denoiser.get_submodule(module_name)
    except AttributeError:
        raise LoraError(f"LoRA {name!r}: this model has no module {module_name!r}") from None
    if isinstance(module, nn.Linear):
        ok = down.ndim == 2 and up.ndim == 2 and down.shape[1] == module.in_features and up.shape[0] == module.out_features
    elif isinstance(module, nn.Conv2d):
        ok = (down.ndim == 4 and up.ndim == 4 and down.shape[1:] == (module.in_channels // module.groups, *module.kernel_size)
              and up.shape[0] == module.out_channels and up.shape[2:] == (1, 1) and module.groups == 1)
    else:
        raise LoraError(f"LoRA {name!r}: {module_name} is a {type(module).__name__}, not a linear or conv layer")
    if not ok or down.shape[0] != up.shape[1]:
        raise LoraError(f"LoRA {name!r}: shapes down {tuple(down.shape)} / up {tuple(up.shape)} do not fit "
                        f"{module_name} ({module})")


ATTENTION = r".*attn\d?\.(to_q|to_k|to_v|to_out\.0)"  # the attention projections of every family


def random_lora(pipe, rank: int = 4, seed: int = 0, targets: str = ATTENTION) -> dict[str, torch.Tensor]:
    """A random adapter of `pipe`'s denoiser, in diffusers' (peft) keys, on the linear and conv
    layers whose path matches `targets` (attention projections by default): for tests and
    benchmarks."""
    prefix = denoiser_prefix(pipe)
    denoiser = pipe.unet if prefix == "unet" else pipe.transformer
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for module_name, module in denoiser.named_modules():
        if isinstance(module, (nn.Linear, nn.Conv2d)) and re.fullmatch(targets, module_name):
            weight = module.weight  # [out, in] or [out, in, kh, kw]
            fan_in = weight[0].numel()
            down = torch.randn(rank, *weight.shape[1:], generator=generator) / fan_in**0.5
            up = torch.randn(weight.shape[0], rank, *[1] * (weight.ndim - 2), generator=generator) / (2 * rank**0.5)
            out[f"{prefix}.{module_name}.lora_A.weight"], out[f"{prefix}.{module_name}.lora_B.weight"] = down, up
    if not out:
        raise LoraError(f"no linear or conv layer of the {prefix} matches {targets!r}")
    return out
