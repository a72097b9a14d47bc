"""The field types and limits of the images API's request bodies (`gouache.api.protocol`): the
bounds on single fields, the OpenAI fields accepted and ignored, what one request may ask of this
server (`Limits`), and the adapters a request names (`LoraRef`, `ControlNetRef`)."""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationInfo, model_validator

from gouache.adapter_names import NAME as LORA_NAME
from gouache.model_info import unpriced_message

if TYPE_CHECKING:
    from gouache.config import ServerConfig
    from gouache.model_info import ModelInfo

MAX_SEED = 2**32 - 1  # seeds are 32-bit like most diffusion front ends
MAX_PROMPT_CHARS = 32_000  # OpenAI's limit for GPT image models
MAX_GUIDANCE = 50.0  # beyond this every model produces noise; almost surely a mistake
MAX_LORAS = 8  # adapters one request may apply
MAX_LORA_SCALE = 4.0  # |scale|; past it an adapter swamps the model: almost surely a mistake
MAX_CONTROLNETS = 4  # ControlNets one request may apply
MAX_CONTROLNET_SCALE = 4.0  # diffusers' pipelines use 0..2; past 4 the control swamps the prompt
# OpenAI fields that official clients send and gouache accepts but cannot honour, with why; the
# API logs each once per process. Fields whose value would change the image in a way gouache
# does not (`background: "transparent"`) are refused instead.
IGNORED_FIELDS = {
    "quality": "the model's steps decide quality; send num_inference_steps",
    "style": "only DALL-E 3 has styles",
    "moderation": "gouache does no content moderation",
    "input_fidelity": "an edit keeps the pixels outside its mask exactly, whatever the fidelity",
    "user": "gouache keeps no per-user records",
    "safety_identifier": "gouache keeps no per-user records",
}


@dataclass(frozen=True)
class Limits:
    """What one request may ask of this server: ServerConfig's bounds and the model's size rules."""

    max_n: int = 10
    max_steps: int = 200
    min_size: int = 64
    max_size: int = 2048
    max_pixels: int = 2048 * 2048
    size_step: int = 8  # width and height must be multiples of this
    default_size: int = 1024  # pixels per side for size "auto" or absent
    # the only (height, width) allowed (a clip's (height, width, frames)), if restricted
    sizes: tuple[tuple[int, ...], ...] | None = None

    @classmethod
    def of(cls, config: ServerConfig, info: ModelInfo) -> Limits:
        return cls(
            max_n=config.max_n,
            max_steps=config.max_steps,
            min_size=config.min_size,
            max_size=config.max_size,
            max_pixels=config.max_pixels,
            size_step=info.size_step,
            default_size=info.default_size,
            sizes=info.sizes,
        )

    def check_size(self, width: int, height: int) -> None:
        """Raise ValueError (which pydantic reports against `size`) if width x height is not allowed."""
        if width % self.size_step or height % self.size_step:
            raise ValueError(f"width and height must be multiples of {self.size_step} pixels")
        if not (self.min_size <= width <= self.max_size and self.min_size <= height <= self.max_size):
            raise ValueError(f"width and height must be between {self.min_size} and {self.max_size} pixels")
        if width * height > self.max_pixels:
            raise ValueError(f"width*height must be at most {self.max_pixels} pixels")
        if self.sizes is not None and (height, width) not in {res[:2] for res in self.sizes}:
            raise ValueError(unpriced_message(self.sizes, (height, width)))  # a clip's frames: the engine checks


def limits_of(info: ValidationInfo) -> Limits:
    """The `Limits` a validation was handed in its context, else the defaults."""
    limits = (info.context or {}).get("limits")
    return limits if isinstance(limits, Limits) else Limits()


class LoraRef(BaseModel):
    """One adapter of a request: a file of the server's --lora-dir, by name, and its weight."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=f"^{LORA_NAME}$")
    scale: float = Field(1.0, ge=-MAX_LORA_SCALE, le=MAX_LORA_SCALE, allow_inf_nan=False)


class ControlNetRef(BaseModel):
    """One ControlNet of a request: a directory of the server's --controlnet-dir by name, its
    conditioning image (base64 PNG, JPEG or WebP, optionally a data URL, of the request's size)
    and its weight."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=f"^{LORA_NAME}$")
    image: str = Field(min_length=1)
    scale: float = Field(1.0, ge=0, le=MAX_CONTROLNET_SCALE, allow_inf_nan=False)
    _data: bytes = PrivateAttr(b"")

    @model_validator(mode="after")
    def _decode(self) -> ControlNetRef:
        encoded = self.image.split(",", 1)[1] if self.image.startswith("data:") else self.image
        try:
            self._data = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("image must be a base64-encoded PNG, JPEG or WebP (or a data URL of one)") from None
        return self

    @property
    def data(self) -> bytes:
        return self._data
