"""Request and response bodies of the images API: OpenAI's fields plus gouache's extensions.

Checks that depend on the served model or the server's limits read a `Limits`
(`gouache.api.request_fields`, with the single fields' bounds) from the pydantic validation
context, so JSON bodies and multipart forms share one set of rules and messages.
JSON is validated strictly (`n: "2"` is an error); form fields arrive as strings and are
validated in lax mode (`n=2` in a form is the string "2").
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import secrets
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from gouache.api.request_fields import (
    IGNORED_FIELDS,
    MAX_CONTROLNETS,
    MAX_GUIDANCE,
    MAX_LORAS,
    MAX_PROMPT_CHARS,
    MAX_SEED,
    ControlNetRef,
    Limits,
    LoraRef,
    limits_of,
)
from gouache.api.tenants import ANONYMOUS, Tenant
from gouache.config import MAX_BLOCK_CACHE_THRESHOLD
from gouache.errors import InvalidRequestError
from gouache.model_info import img2img_start
from gouache.request import ImageRequest, Tier
from gouache.techniques import TECHNIQUES, refused_pair

if TYPE_CHECKING:
    from gouache.model_info import ModelInfo

MEDIA_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}
_SIZE = re.compile(r"(\d{1,6})x(\d{1,6})")
TEMPLATE_ID = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
DEFAULT_SECONDS = 4  # a clip's length when a request names none (OpenAI's default)
MAX_SECONDS = 3600  # beyond any clip a model makes: the frame bound refuses long ones, naming it
MAX_FPS = 60


class PromptParams(BaseModel):
    """Fields of every request that makes pictures from a prompt, images and clips alike. Unknown
    fields are rejected, as OpenAI does."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    model: str | None = None  # must be the served model's name when given
    size: str = Field("auto", validate_default=True)  # "WxH" or "auto"; normalized to "WxH" (edits: see there)
    # gouache extensions; None means the model's default
    negative_prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    num_inference_steps: int | None = None  # 1..limits.max_steps
    guidance_scale: float | None = Field(None, ge=0, le=MAX_GUIDANCE, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)  # None: a random seed
    slo_ms: float | None = Field(None, gt=0, allow_inf_nan=False)  # deadline after arrival
    # OpenAI's service tier (`gouache.sched.tiers`); auto or absent: the API key's default
    service_tier: Literal["auto", "priority", "default", "flex"] | None = None
    # block-cache threshold (docs/block_cache.md); 0: exact; None: the server's --block-cache
    block_cache: float | None = Field(None, ge=0, le=MAX_BLOCK_CACHE_THRESHOLD, allow_inf_nan=False)
    # LoRA adapters (docs/lora.md); a multipart form sends the list as JSON text
    loras: list[LoraRef] = Field(default_factory=list, max_length=MAX_LORAS)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # OpenAI treats `"n": null` like an absent field.
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    @field_validator("loras", "controlnets", mode="before", check_fields=False)
    @classmethod
    def _list_as_json(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, str):  # a multipart form field
            try:
                return json.loads(value)
            except json.JSONDecodeError:
                example = ('{"name": "papercut", "scale": 0.8}' if info.field_name == "loras"
                           else '{"name": "edges", "image": "<base64 PNG>", "scale": 1.0}')
                raise ValueError(f"must be a JSON list such as [{example}]") from None
        return value

    @field_validator("loras")
    @classmethod
    def _loras_once_each(cls, loras: list[LoraRef]) -> list[LoraRef]:
        names = [lora.name for lora in loras]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"names {', '.join(repeated)} more than once; give each adapter once, with its scale")
        return loras

    @field_validator("prompt")
    @classmethod
    def _prompt_not_blank(cls, prompt: str) -> str:
        if not prompt.strip():
            raise ValueError("must not be empty")
        return prompt

    @field_validator("num_inference_steps")
    @classmethod
    def _steps_in_range(cls, steps: int | None, info: ValidationInfo) -> int | None:
        max_steps = limits_of(info).max_steps
        if steps is not None and not 1 <= steps <= max_steps:
            raise ValueError(f"must be between 1 and {max_steps}")
        return steps

    @field_validator("size")
    @classmethod
    def _size_allowed(cls, size: str, info: ValidationInfo) -> str:
        limits = limits_of(info)
        if size == "auto":
            return cls._auto_size(limits)
        match = _SIZE.fullmatch(size)
        if match is None:
            raise ValueError("must be 'auto' or WIDTHxHEIGHT in pixels, e.g. '1024x768'")
        limits.check_size(int(match[1]), int(match[2]))
        return size

    @classmethod
    def _auto_size(cls, limits: Limits) -> str:
        """What `size` "auto" (or absent) stands for."""
        return f"{limits.default_size}x{limits.default_size}"

    def ignored_fields(self) -> list[str]:
        """The IGNORED_FIELDS this request sent."""
        return [name for name in IGNORED_FIELDS if name in self.model_fields_set]

    @property
    def width_height(self) -> tuple[int, int]:
        width, height = self.size.split("x")
        return int(width), int(height)

    def request_fields(self, info: ModelInfo, tenant: Tenant) -> dict[str, Any]:
        """The ImageRequest fields every image or clip of this request shares, the model's
        defaults filled in, in the service tier `tenant` asked for (403 if its key may not use
        it); a 400 naming the field where the served model or policy would not take it."""
        if (self.num_inference_steps or info.default_steps) < info.min_steps:
            raise InvalidRequestError(f"Invalid value for 'num_inference_steps': '{info.name}' (a {info.family} model) "
                                      f"takes at least {info.min_steps} steps.", "num_inference_steps")
        width, height = self.width_height
        guidance = info.default_guidance if self.guidance_scale is None else self.guidance_scale
        if self.slo_ms is not None and not info.deadlines:
            raise InvalidRequestError("Invalid value for 'slo_ms': this server's scheduling policy does not plan by "
                                      "deadline and would ignore it (deadline-aware: --policy patched-slo or "
                                      "round-knapsack).", "slo_ms")
        tier = tenant.tier(self.service_tier)
        for technique, field in self._asked().items():
            if not info.serves(technique):
                raise InvalidRequestError(f"Invalid value for '{field}': '{info.name}' (a {info.family} model) does "
                                          f"not serve {technique}: {dict(info.unserved)[technique]}; leave it out.",
                                          field)
        refused = refused_pair(set(self._asked()))
        if refused is not None:  # docs/architecture.md, "The compatibility table"
            a, b, why = refused
            first, field = self._asked()[a], self._asked()[b]
            raise InvalidRequestError(f"Invalid value for '{field}': {first} and {field} do not compose ({why}); "
                                      "send one of them.", field)
        if self.negative_prompt is not None and info.cfg_rows(guidance) == 1:
            why = (f"'{info.name}' is guidance-distilled and has no negative branch" if not info.uses_cfg
                   else f"guidance_scale {guidance:g} turns classifier-free guidance off; send one above "
                        f"{info.cfg_from:g}")
            raise InvalidRequestError(f"Invalid value for 'negative_prompt': it would be ignored: {why}.",
                                      "negative_prompt")
        return dict(
            prompt=self.prompt, width=width, height=height,
            num_inference_steps=self.num_inference_steps or info.default_steps, guidance_scale=guidance,
            negative_prompt=self.negative_prompt,
            slo_ms=self.slo_ms if self.slo_ms is not None else dict(info.tier_slo_ms).get(tier),
            tier=Tier.named(tier), tenant=tenant.name, tenant_weight=tenant.weight, block_cache=self.block_cache,
            loras=tuple((lora.name, lora.scale) for lora in self.loras),
        )

    def first_seed(self) -> int:
        return secrets.randbelow(MAX_SEED + 1) if self.seed is None else self.seed

    def _asked(self) -> dict[str, str]:
        """The techniques (`gouache.techniques`) this request's fields ask for, each with the field
        that asks: server defaults aside, which apply only where they compose."""
        asked = {}
        if self.loras:
            asked["lora"] = "loras"
        if self.block_cache:
            asked["block_cache"] = "block_cache"
        return asked


class ImageParams(PromptParams):
    """Fields shared by image generations and edits."""

    n: int = 1  # 1..limits.max_n
    # Before response_format and partial_images: their validators read it.
    stream: bool = False
    response_format: Literal["b64_json", "url"] = "b64_json"  # streams are always b64: "url" is refused
    output_format: Literal["png", "jpeg", "webp"] = "png"
    output_compression: int | None = Field(None, ge=0, le=100)  # jpeg/webp quality, 100 = best
    partial_images: int = Field(0, ge=0, le=3)  # previews per image; needs stream
    background: Literal["transparent", "opaque", "auto"] | None = None  # images are opaque
    # In IGNORED_FIELDS: accepted so that official clients work, logged, otherwise ignored.
    user: str | None = None
    quality: Literal["auto", "low", "medium", "high", "xhigh", "max", "standard", "hd"] | None = None
    safety_identifier: str | None = None
    # ControlNets (docs/controlnet.md), summed in this order; a multipart edit sends JSON text
    controlnets: list[ControlNetRef] = Field(default_factory=list, max_length=MAX_CONTROLNETS)
    controlnet_mode: Literal["sync", "async"] | None = None  # None: the server's --controlnet-mode

    @field_validator("controlnet_mode")
    @classmethod
    def _mode_needs_controlnets(cls, mode: str | None, info: ValidationInfo) -> str | None:
        if mode is not None and not info.data.get("controlnets"):
            raise ValueError("applies to requests with controlnets; send controlnets or leave it out")
        return mode

    @field_validator("response_format")
    @classmethod
    def _b64_when_streaming(cls, response_format: str, info: ValidationInfo) -> str:
        if response_format == "url" and info.data.get("stream"):
            raise ValueError("must be 'b64_json' with stream=true: streamed images are always sent as base64")
        return response_format

    @field_validator("output_compression")
    @classmethod
    def _compression_is_lossy(cls, compression: int | None, info: ValidationInfo) -> int | None:
        if compression is not None and info.data.get("output_format", "png") == "png":
            raise ValueError("applies to output_format 'jpeg' and 'webp' only; png is lossless")
        return compression

    @field_validator("partial_images")
    @classmethod
    def _partials_need_stream(cls, partial_images: int, info: ValidationInfo) -> int:
        if partial_images and not info.data.get("stream"):
            raise ValueError("needs stream=true: previews are sent as stream events")
        return partial_images

    @field_validator("background")
    @classmethod
    def _opaque(cls, background: str | None) -> str | None:
        if background == "transparent":
            raise ValueError("gouache makes opaque images only; send 'opaque' or 'auto'")
        return background

    @field_validator("n")
    @classmethod
    def _n_in_range(cls, n: int, info: ValidationInfo) -> int:
        max_n = limits_of(info).max_n
        if not 1 <= n <= max_n:
            raise ValueError(f"must be between 1 and {max_n}")
        return n

    def to_requests(
        self, api_id: str, info: ModelInfo, arrival: float, image: bytes | None = None, mask: bytes | None = None,
        references: tuple[bytes, ...] = (), tenant: Tenant = ANONYMOUS, register_template: bool = False,
    ) -> list[ImageRequest]:
        """The n ImageRequests of this API request (`request_fields`); `register_template`: a
        POST /v1/templates, which records the template instead of editing it.

        Image i gets seed (seed + i) mod 2**32, so every seed in the response is one the API
        takes back, and sent back with n=1 it makes that image again.
        """
        if info.clips is not None:
            raise InvalidRequestError(f"'{info.name}' makes videos: send the request to /v1/videos.", "model")
        if image is None and not info.generation:
            raise InvalidRequestError(f"'{info.name}' edits images and makes none from text alone: send the request "
                                      "to /v1/images/edits with an image.")
        shared = self.request_fields(info, tenant)
        seed = self.first_seed()
        return [
            ImageRequest(
                request_id=f"{api_id}-{i}",
                **shared,
                seed=(seed + i) % (MAX_SEED + 1),
                output_format=self.output_format,
                output_compression=self.output_compression,
                partial_images=self.partial_images,
                controlnets=tuple((net.name, net.data, net.scale) for net in self.controlnets),
                controlnet_mode=self.controlnet_mode,
                register_template=register_template,
                **self._edit_fields(info, image, mask, references),
                image=image,
                mask=mask,
                references=references,
                arrival_time=arrival,
            )
            for i in range(self.n)
        ]

    def _asked(self) -> dict[str, str]:
        asked = super()._asked()
        if self.controlnets:
            asked["controlnet_async" if self.controlnet_mode == "async" else "controlnet"] = "controlnets"
        return asked

    def _edit_fields(self, info: ModelInfo, image: bytes | None, mask: bytes | None,
                     references: tuple[bytes, ...] = ()) -> dict[str, Any]:
        """ImageRequest fields only edits have."""
        return {}


class ImageGenerationRequest(ImageParams):
    """JSON body of POST /v1/images/generations."""

    style: Literal["vivid", "natural"] | None = None  # in IGNORED_FIELDS
    moderation: Literal["low", "auto"] | None = None  # in IGNORED_FIELDS


class ImageEditRequest(ImageParams):
    """Text fields of the multipart body of POST /v1/images/edits (the files are read apart).

    `size` absent or "auto" means the upload's size, which only the upload's header tells:
    validation leaves it "auto" and the API, having read the header, calls `at_upload_size`
    before anything reads the size. Any other `size` and the engine resizes the upload to it.
    """

    input_fidelity: Literal["high", "low"] | None = None  # in IGNORED_FIELDS
    # gouache extensions (docs/edits.md): reuse the template's activations, computing the masked
    # tokens only; None: the server's --template-cache. template_id names the template (else:
    # a hash of the image's pixels) and implies template_cache.
    template_cache: bool | None = None
    template_id: str | None = Field(None, pattern=TEMPLATE_ID)
    # img2img (docs/edits.md): without a mask, the upload noised to this share of the schedule and
    # denoised from there, as the family's diffusers Img2Img pipeline; None: repainted from noise
    strength: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)

    def _edit_fields(self, info: ModelInfo, image: bytes | None, mask: bytes | None,
                     references: tuple[bytes, ...] = ()) -> dict[str, Any]:
        if 1 + len(references) > info.max_input_images:
            takes = "one image" if info.max_input_images == 1 else f"at most {info.max_input_images} images"
            raise InvalidRequestError(f"Invalid value for 'image': {1 + len(references)} files were sent; an edit on "
                                      f"'{info.name}' takes {takes}.", "image")
        if info.instruction_edit and image is not None:
            self._check_reference(info)
        if self.strength is not None:
            self._check_strength(info, mask)
        if self.template_id is not None and self.template_cache is False:
            raise InvalidRequestError("Invalid value for 'template_id': it names a template to reuse, but "
                                      "template_cache is false; drop one of them.", "template_id")
        asked = self.template_cache or self.template_id is not None  # served: `to_requests` checked it
        template_id = self.template_id
        # the same upload is the same template
        if template_id is None and info.serves("template") and image is not None:
            template_id = "blake2b-" + hashlib.blake2b(image, digest_size=16).hexdigest()
        return {"template_cache": True if asked else self.template_cache, "template_id": template_id,
                "strength": self.strength}

    def _check_reference(self, info: ModelInfo) -> None:
        """An edit on an instruction-edit model (with a mask or without) uses `reference`
        (gouache.techniques): its upload enters as reference tokens."""
        asked = self._asked()
        used = {"reference", *asked, *(["parallel"] if info.parallel else [])}
        refused = refused_pair(used)
        if refused is None:
            return
        a, b, why = refused
        other = b if a == "reference" else a
        field = asked.get(other, "image")
        raise InvalidRequestError(f"Invalid value for '{field}': an edit on '{info.name}' (its upload enters as "
                                  f"reference tokens) and {asked.get(other, TECHNIQUES[other].field)} do not compose "
                                  f"({why}).", field)

    def _check_strength(self, info: ModelInfo, mask: bytes | None) -> None:
        def refuse(why: str) -> None:
            raise InvalidRequestError(f"Invalid value for 'strength': {why}.", "strength")

        if mask is not None:
            refuse("it makes an edit without a mask an img2img (the whole picture redrawn from the upload), "
                   "while a mask repaints its region from noise; send the mask or the strength, not both")
        if not info.img2img:
            refuse(f"'{info.name}' is a 9-channel inpainting model: it takes a mask, and no strength")
        steps = self.num_inference_steps or info.default_steps
        if img2img_start(info.family, steps, self.strength) >= steps:
            refuse(f"{self.strength:g} of {steps} steps runs none of them ({info.family} models run "
                   f"int(steps x strength)); send a strength of at least {math.ceil(1000 / steps) / 1000:g} "
                   "or more steps")

    @classmethod
    def _auto_size(cls, limits: Limits) -> str:
        return "auto"

    def _asked(self) -> dict[str, str]:
        asked = super()._asked()
        if self.template_id is not None:
            asked["template"] = "template_id"
        elif self.template_cache:
            asked["template"] = "template_cache"
        if self.strength is not None:
            asked["img2img"] = "strength"
        return asked

    def at_upload_size(self, width: int, height: int, limits: Limits) -> ImageEditRequest:
        """This request with `size` "auto" resolved to the upload's width x height, or an
        InvalidRequestError naming `size` if the model cannot take that size."""
        try:
            limits.check_size(width, height)
        except ValueError as error:
            message = f"the image is {width}x{height}, which this model cannot take ({error}); send `size` to resize it"
            raise InvalidRequestError(f"Invalid value for 'size': {message}.", "size") from None
        return self.model_copy(update={"size": f"{width}x{height}"})


class VideoCreateRequest(PromptParams):
    """Fields of POST /v1/videos: OpenAI's (`prompt`, `model`, `seconds`, `size`; an
    `input_reference` is read apart) and gouache's extensions. OpenAI's client sends a multipart
    form, so every field may arrive as text (validated in lax mode: `seconds` "4" is 4)."""

    seconds: float | None = Field(None, gt=0, le=MAX_SECONDS, allow_inf_nan=False)  # OpenAI's "4" / "8" / "12"
    num_frames: int | None = Field(None, ge=1)  # instead of seconds: the clip's frames exactly
    fps: int | None = Field(None, ge=1, le=MAX_FPS)  # None: the model's
    partial_images: int = Field(0, ge=0, le=3)  # previews of the first frame, in GET /v1/videos/{id}/events

    def _asked(self) -> dict[str, str]:
        """A video request makes a clip (`gouache.techniques`: what composes with one)."""
        return {**super()._asked(), "clip": "num_frames" if self.num_frames is not None else "seconds"}

    @field_validator("seconds", mode="before")
    @classmethod
    def _seconds_as_text(cls, seconds: Any) -> Any:
        """OpenAI's `seconds` is text ("4"), in JSON too."""
        if isinstance(seconds, str):
            try:
                return float(seconds)
            except ValueError:
                raise ValueError("must be a number of seconds, such as \"4\"") from None
        return seconds

    def to_request(self, api_id: str, info: ModelInfo, arrival: float, tenant: Tenant = ANONYMOUS) -> ImageRequest:
        """The clip this API request asks for (`request_fields`): `num_frames` frames, or `seconds`
        (4 when neither is sent, OpenAI's default) x fps + 1 to the nearest count the model takes."""
        if info.clips is None:
            raise InvalidRequestError(f"'{info.name}' makes images: send the request to /v1/images/generations.",
                                      "model")
        if self.seconds is not None and self.num_frames is not None:
            raise InvalidRequestError("Invalid value for 'num_frames': it sets the clip's length, as seconds does; "
                                      "send one of them.", "num_frames")
        fps = self.fps or info.clips.fps
        field = "num_frames" if self.num_frames is not None else "seconds"
        frames = self.num_frames or info.clips.frames_of(DEFAULT_SECONDS if self.seconds is None else self.seconds, fps)
        why = info.clips.refusal(frames)
        if why is not None:
            raise InvalidRequestError(f"Invalid value for '{field}': {why}.", field)
        return ImageRequest(request_id=f"{api_id}-0", **self.request_fields(info, tenant), seed=self.first_seed(),
                            num_frames=frames, fps=fps, partial_images=self.partial_images, arrival_time=arrival)


class ImageData(BaseModel):
    b64_json: str | None = None
    url: str | None = None
    seed: int  # gouache extension: the seed that made this image, to reproduce it


class ImagesResponse(BaseModel):
    """OpenAI's ImagesResponse."""

    created: int  # unix seconds
    data: list[ImageData]
    output_format: str
    size: str

