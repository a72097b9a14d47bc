"""LoRA adapters of a denoiser (KATZ §6): a file read into its layers, merged into the base
weights in place, or applied to its own rows of a forward next to other adapters.

A file is a safetensors state dict in any format diffusers reads (diffusers / peft keys,
kohya's `lora_unet_*`, and the others its pipelines' `lora_state_dict` converts); it is
converted with diffusers' own utilities, then every layer is checked against a table of the
denoiser's modules taken before it serves (`Target`: module, kind, shapes), so that a wrong file
is refused before it reaches a forward. Files are read whole, never mapped (`gouache.files`).

Layers of an SD or SDXL pipeline's text encoders (kohya `lora_te*`, diffusers `text_encoder.*`)
are kept apart (`Lora.text_layers`), with the ranks and alphas diffusers' own config gives
them, and apply while the request's prompt is encoded (`gouache.lora.text`). Other families'
text-encoder layers, DoRA magnitudes, LoKr and LoHa files are refused, naming the format.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from gouache.adapter_names import LoraError
from gouache.files import Header, header_of, read_file

METADATA_KEY = "lora_adapter_metadata"  # diffusers' key of a file's peft settings (r, lora_alpha, patterns)
TEXT_ENCODERS = ("text_encoder", "text_encoder_2")  # SD / SDXL pipelines' text encoders, as LoRA keys name them


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
    """An adapter: its layers by module path in the denoiser, and in each text encoder."""

    name: str
    layers: dict[str, LoraLayer]  # the denoiser's, by module path
    digest: str = ""  # of its file's bytes: a rewritten file is another adapter, an unchanged one the same
    # the text encoders' ("text_encoder", "text_encoder_2"), by module path in each
    text_layers: dict[str, dict[str, LoraLayer]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        every = [*self.layers.values(), *(layer for layers in self.text_layers.values() for layer in layers.values())]
        return sum(layer.nbytes for layer in every)

    def to(self, device: torch.device) -> Lora:
        """A copy whose denoiser layers sit on `device` (still float32: merges compute in it);
        the text encoders' stay where preparation reads them."""
        layers = {path: LoraLayer(layer.down.to(device), layer.up.to(device), layer.scale)
                  for path, layer in self.layers.items()}
        return Lora(self.name, layers, self.digest, self.text_layers)


@dataclass(frozen=True)
class Layer:
    """What an adapter of one module must fit: its kind and shapes."""

    kind: str  # "linear", "conv", or the class name of a module no adapter can target
    inputs: int = 0  # in_features; a conv's in_channels per group
    outputs: int = 0  # out_features / out_channels
    kernel: tuple[int, ...] = ()  # a conv's kernel size
    groups: int = 1


@dataclass(frozen=True)
class Target:
    """What a LoRA must fit, read once off the denoiser before it serves: the pipeline class
    (whose `lora_state_dict` converts keys), the denoiser's name in keys, and every module's
    kind and shapes by path. Checking a file reads this table, never the live model, whose
    blocks the engine thread may have swapped for wrappers meanwhile (template replay)."""

    pipeline: type
    prefix: str  # "unet" | "transformer"
    layers: dict[str, Layer]
    encoders: dict[str, dict[str, Layer]] = field(default_factory=dict)  # SD / SDXL: each text encoder's modules

    @classmethod
    def of(cls, pipe) -> Target:
        prefix = denoiser_prefix(pipe)
        denoiser = pipe.unet if prefix == "unet" else pipe.transformer
        encoders = {}
        if prefix == "unet":  # the families whose text-encoder adapters are served (tested against diffusers)
            for encoder in TEXT_ENCODERS:
                module = getattr(pipe, encoder, None)
                if module is not None:
                    encoders[encoder] = {name: _layer(m) for name, m in module.named_modules() if name}
        return cls(type(pipe), prefix, {name: _layer(module) for name, module in denoiser.named_modules() if name},
                   encoders)


def _layer(module: nn.Module) -> Layer:
    if isinstance(module, nn.Linear):
        return Layer("linear", module.in_features, module.out_features)
    if isinstance(module, nn.Conv2d):
        return Layer("conv", module.in_channels // module.groups, module.out_channels, tuple(module.kernel_size),
                     module.groups)
    return Layer(type(module).__name__)


def denoiser_prefix(pipe) -> str:
    return "unet" if hasattr(pipe, "unet") else "transformer"


def read_lora(path: Path, target: Target, name: str) -> Lora:
    """The adapter in file `path` for `target`; LoraError if it is not one (or the file kept
    changing while it was read)."""
    try:
        snapshot = read_file(path)
    except OSError as error:
        raise LoraError(f"LoRA {name!r} could not be read ({error})") from None
    return lora_of_bytes(snapshot.data, snapshot.digest, target, name)


def lora_of_bytes(data: bytes, digest: str, target: Target, name: str) -> Lora:
    """The adapter a safetensors file's bytes hold; LoraError if they are not one."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        raw, metadata = load(data), header_of(data).metadata
    except (SafetensorError, ValueError) as error:
        raise LoraError(f"LoRA {name!r} is not a readable safetensors file ({error})") from None
    if not raw:
        raise LoraError(f"LoRA {name!r} holds no tensors")
    return parse_lora(raw, metadata, target, name, digest)


# safetensors' dtype names
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def header_tensors(header: Header, name: str) -> dict[str, torch.Tensor]:
    """A file's tensors as its header describes them: one-element ones (alphas) read, the
    others empty on the meta device (shapes are all a check needs)."""
    raw = {}
    for key, info in header.tensors.items():
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise LoraError(f"LoRA {name!r}: tensor {key!r} has dtype {info['dtype']}, which gouache does not read")
        if key in header.scalars:
            _, shape, data = header.scalars[key]
            if len(data) != dtype.itemsize:
                raise LoraError(f"LoRA {name!r}: tensor {key!r} holds {len(data)} bytes, not one {info['dtype']}")
            raw[key] = torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)
        else:
            raw[key] = torch.empty(info["shape"], dtype=dtype, device="meta")
    return raw


def parse_lora(raw: dict[str, torch.Tensor], metadata: dict[str, str], target: Target, name: str,
               digest: str = "") -> Lora:
    """Convert a state dict with diffusers' utilities and check it against the denoiser."""
    from diffusers.utils.state_dict_utils import convert_unet_state_dict_to_peft

    prefix = target.prefix
    kinds = {kind for key in raw for marker, kind in (("lokr_", "LoKr"), ("hada_", "LoHa")) if marker in key}
    if kinds:
        raise LoraError(f"LoRA {name!r} is a {' and '.join(sorted(kinds))} file, not a LoRA; gouache (like diffusers' "
                        "SD and SDXL pipelines) applies plain LoRA only")
    try:
        converted = target.pipeline.lora_state_dict(dict(raw))
    except Exception as error:  # diffusers' converters raise anything on a foreign layout
        raise LoraError(f"LoRA {name!r}: diffusers cannot read its keys ({type(error).__name__}: {error})") from None
    state, alphas = converted if isinstance(converted, tuple) else (converted, None)
    foreign = sorted({key.split(".")[0] for key in state} - {prefix, *target.encoders})
    if foreign:
        served = " and ".join([prefix, *target.encoders])
        raise LoraError(f"LoRA {name!r} has layers for {', '.join(foreign)}; gouache applies LoRAs to the {served} of "
                        "this model")
    text_layers = {encoder: _text_layers(state, alphas, metadata, encoder, target.encoders[encoder], name)
                   for encoder in target.encoders if any(key.startswith(encoder + ".") for key in state)}
    state = convert_unet_state_dict_to_peft({key[len(prefix) + 1:]: value for key, value in state.items()
                                             if key.startswith(prefix + ".")})
    parts = _pairs(state, name)
    alpha_of = _alphas({key: value for key, value in (alphas or {}).items()
                        if key.split(".")[0] not in target.encoders},
                       prefix, convert_unet_state_dict_to_peft)
    settings = _settings(metadata, prefix, name)
    layers = {}
    for module_name, pair in parts.items():
        down, up = pair["lora_A"], pair["lora_B"]
        _check_layer(target.layers, module_name, down, up, name)
        rank = down.shape[0]
        alpha = alpha_of.get(module_name, settings.alpha(module_name, rank))
        layers[module_name] = LoraLayer(down.float().contiguous(), up.float().contiguous(), float(alpha) / rank)
    if not layers and not text_layers:
        raise LoraError(f"LoRA {name!r} holds no layers")
    return Lora(name, layers, digest, text_layers)


def _pairs(state: dict[str, torch.Tensor], name: str) -> dict[str, dict[str, torch.Tensor]]:
    """peft-keyed weights as module path -> {"lora_A": down, "lora_B": up}."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        if key.endswith("lora_magnitude_vector"):
            raise LoraError(f"LoRA {name!r} is a DoRA (lora_magnitude_vector keys); only plain LoRA is supported")
        match = re.fullmatch(r"(.+)\.(lora_A|lora_B)\.weight", key)
        if match is None:
            raise LoraError(f"LoRA {name!r}: key {key!r} is not a LoRA down or up weight (DoRA, biases and full "
                            "weight differences are not supported)")
        parts.setdefault(match[1], {})[match[2]] = value
    for module_name, pair in parts.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise LoraError(f"LoRA {name!r}: {module_name} has {' and '.join(pair)} only")
    return parts


def _text_layers(state: dict[str, torch.Tensor], alphas: dict | None, metadata: dict[str, str], encoder: str,
                 table: dict[str, Layer], name: str) -> dict[str, LoraLayer]:
    """One text encoder's layers of a converted state dict, each with the scale diffusers gives
    it when it loads the file: its keys converted by diffusers' utilities, its ranks and alphas
    read by diffusers' own config (whose choices, e.g. one alpha for all modules but a pattern's,
    are the file's meaning there), r and alpha per module as peft picks them."""
    from diffusers.utils.peft_utils import _create_lora_config
    from diffusers.utils.state_dict_utils import convert_state_dict_to_diffusers, convert_state_dict_to_peft
    from peft.utils.other import get_pattern_key

    own = {key[len(encoder) + 1:]: value for key, value in state.items() if key.startswith(encoder + ".")}
    try:
        own = convert_state_dict_to_peft(convert_state_dict_to_diffusers(own))
    except ValueError as error:
        raise LoraError(f"LoRA {name!r}: diffusers cannot read its {encoder} layers ({error})") from None
    if "text_model" not in table:  # transformers' flattened CLIPTextModel; files name text_model.* still
        own = {key.removeprefix("text_model."): value for key, value in own.items()}
    pairs = _pairs(own, name)
    ranks = {f"{module}.lora_B.weight": pairs[module]["lora_B"].shape[1] for module in table
             if module.endswith((".q_proj", ".k_proj", ".v_proj", ".out_proj", ".fc1", ".fc2")) and module in pairs}
    own_alphas = {key[len(encoder) + 1:]: value for key, value in (alphas or {}).items()
                  if key.split(".")[0] == encoder} if alphas else None
    settings = None
    if METADATA_KEY in metadata:
        try:
            config = json.loads(metadata[METADATA_KEY])
        except json.JSONDecodeError:
            raise LoraError(f"LoRA {name!r}: its {METADATA_KEY} metadata is not JSON") from None
        settings = {key[len(encoder) + 1:]: value for key, value in config.items() if key.startswith(encoder + ".")}
    config = _create_lora_config(own, own_alphas or None, settings, ranks, is_unet=False)
    if config.use_dora:
        raise LoraError(f"LoRA {name!r}: its {encoder} layers are a DoRA; only plain LoRA is supported")
    layers = {}
    for module_name, pair in pairs.items():
        down, up = pair["lora_A"], pair["lora_B"]
        _check_layer(table, module_name, down, up, name)
        rank = config.rank_pattern.get(get_pattern_key(config.rank_pattern.keys(), module_name), config.r)
        alpha = config.alpha_pattern.get(get_pattern_key(config.alpha_pattern.keys(), module_name), config.lora_alpha)
        scale = alpha / math.sqrt(rank) if config.use_rslora else alpha / rank
        layers[module_name] = LoraLayer(down.float().contiguous(), up.float().contiguous(), float(scale))
    return layers


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


def _check_layer(table: dict[str, Layer], module_name: str, down: torch.Tensor, up: torch.Tensor, name: str) -> None:
    layer = table.get(module_name)
    if layer is None:
        raise LoraError(f"LoRA {name!r}: this model has no module {module_name!r}")
    if layer.kind == "linear":
        ok = down.ndim == 2 and up.ndim == 2 and down.shape[1] == layer.inputs and up.shape[0] == layer.outputs
    elif layer.kind == "conv":
        ok = (down.ndim == 4 and up.ndim == 4 and tuple(down.shape[1:]) == (layer.inputs, *layer.kernel)
              and up.shape[0] == layer.outputs and tuple(up.shape[2:]) == (1, 1) and layer.groups == 1)
    else:
        raise LoraError(f"LoRA {name!r}: {module_name} is a {layer.kind}, not a linear or conv layer")
    if not ok or down.shape[0] != up.shape[1]:
        shape = f"{layer.kind} {layer.inputs} -> {layer.outputs}" + (f", kernel {layer.kernel}" if layer.kernel else "")
        raise LoraError(f"LoRA {name!r}: shapes down {tuple(down.shape)} / up {tuple(up.shape)} do not fit "
                        f"{module_name} ({shape})")


ATTENTION = r".*(attn\d?|attention)\.(to_q|to_k|to_v|to_out\.0)"  # the attention projections of every family


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
