"""What a user asked (`ImageRequest`) and what the scheduler tracks (`RequestState`).

The runner's per-request tensors (latents, sampler, embeddings) live in the runner, keyed by
the same request id; nothing here imports torch.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass


class Tier(enum.IntEnum):
    """A service tier (OpenAI's `service_tier`) as its rank: lower ranks are served first. The
    API names it once (`Tier.named`); metrics, queue shares and status read its `label`."""

    PRIORITY = 0
    DEFAULT = 1
    FLEX = 2

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def named(cls, label: str) -> Tier:
        """The tier of a name (ValueError naming the tiers for any other)."""
        if label not in TIERS:
            raise ValueError(f"unknown service tier {label!r}; the tiers are {', '.join(TIERS)}")
        return cls[label.upper()]


TIERS = tuple(tier.label for tier in Tier)  # the tiers' names, highest first
DEFAULT_TIER = Tier.DEFAULT.label


@dataclass
class ImageRequest:
    """One image to make, as validated by the API. A user's `n` images become n of these."""

    request_id: str  # unique; "<api id>-<index>" for the index-th of n images
    prompt: str
    width: int  # pixels, a multiple of the model's size step
    height: int  # pixels
    num_inference_steps: int
    guidance_scale: float
    seed: int  # seeds this image's own torch.Generator, so batch-mates never change it
    negative_prompt: str | None = None
    output_format: str = "png"  # png | jpeg | webp
    output_compression: int | None = None  # jpeg/webp quality 0-100 (OpenAI's name; 100 = best); None = 95
    partial_images: int = 0  # decoded previews to stream while denoising (0 = none)
    slo_ms: float | None = None  # deadline relative to arrival, for SLO-aware policies
    block_cache: float | None = None  # block-cache threshold (0 = exact); None: the server's default
    template_cache: bool | None = None  # edit: reuse its template's activations; None: the server's default
    template_id: str | None = None  # edit: the template's name; None: a content hash of the image
    register_template: bool = False  # record the template (mask: nothing) instead of editing it: POST /v1/templates
    loras: tuple[tuple[str, float], ...] = ()  # LoRA adapters (file name, scale) applied to the denoiser
    # ControlNets (directory name, conditioning image still encoded, scale), summed in this order
    controlnets: tuple[tuple[str, bytes, float], ...] = ()
    controlnet_mode: str | None = None  # sync | async; None: the server's default
    image: bytes | None = None  # edit: the uploaded image, still encoded; a clip's: its first frame
    mask: bytes | None = None  # edit: the uploaded mask, still encoded (transparent = repaint)
    references: tuple[bytes, ...] = ()  # edit: the uploads after `image` (models that take several), still encoded
    # edit without a mask: img2img, the upload noised to this share of the schedule and denoised
    # from there (1: all of it); None: the whole picture repainted from noise
    strength: float | None = None
    tier: Tier = Tier.DEFAULT  # its service tier (`gouache.sched.tiers`)
    tenant: str = ""  # the API key's name ("" without tenants)
    tenant_weight: float = 1.0  # its tenant's share of the tier among the tenants waiting in it
    arrival_time: float = 0.0  # time.monotonic() when the API accepted it
    num_frames: int = 1  # a video model's clip: its frames (1 + 4k for Wan); 1: an image
    fps: int = 16  # a clip's frames per second, its MP4's rate

    @property
    def shape(self) -> tuple[int, ...]:
        """What its latents' shape follows: (height, width), and a clip's frames after them."""
        return (self.height, self.width) if self.num_frames == 1 else (self.height, self.width, self.num_frames)

    @property
    def is_edit(self) -> bool:
        return self.image is not None

    @property
    def api_id(self) -> str:
        """The id of the API request whose images this is one of."""
        return self.request_id.rsplit("-", 1)[0]


def preview_steps(total_steps: int, partial_images: int) -> set[int]:
    """Steps after which a preview is decoded: evenly spaced, never the last one."""
    return {round(k * total_steps / (partial_images + 1)) for k in range(1, partial_images + 1)} - {0, total_steps}


class RequestStatus(enum.Enum):
    PREPARING = "preparing"  # decoding, text encoding, initial latents
    WAITING = "waiting"  # ready to denoise, not admitted yet
    RUNNING = "running"  # admitted; denoised step by step
    PAUSED = "paused"  # gave its slot to a higher tier's request at a step boundary; resumes where it stopped
    POSTPROCESSING = "postprocessing"  # VAE decode and encode


@dataclass
class RequestState:
    """The scheduler's view of a request: plain values, no tensors."""

    request_id: str
    # (height, width) in pixels, then a clip's frames (`ImageRequest.shape`); requests of one
    # resolution can share a plain forward
    resolution: tuple[int, ...]
    num_steps: int  # denoising steps in total
    arrival_time: float  # time.monotonic() at acceptance
    deadline: float | None = None  # absolute time.monotonic() deadline, None if no SLO
    steps_done: int = 0  # denoising steps completed so far
    status: RequestStatus = RequestStatus.WAITING
    first_step_time: float | None = None  # when its first step started (queueing time ends)
    devices: tuple[int, ...] = ()  # its devices in the last plan that could place it; () if it had none
    tier: int = Tier.DEFAULT  # its service tier's rank (`Tier`): lower ranks are served first
    tenant: str = ""  # who sent it, for fair queuing within a tier
    weight: float = 1.0  # its tenant's share within the tier
    fair_tag: float = 0.0  # its start tag in its tier's fair queue (set by the scheduler on arrival)
    pauses: int = 0  # times a higher tier's request took its slot at a step boundary

    @classmethod
    def of(cls, request: ImageRequest, num_steps: int) -> RequestState:
        """The scheduler's view of `request`, prepared to denoise in `num_steps` steps."""
        return cls(
            request_id=request.request_id,
            resolution=request.shape,
            num_steps=num_steps,
            arrival_time=request.arrival_time,
            deadline=request.arrival_time + request.slo_ms / 1000 if request.slo_ms else None,
            tier=request.tier,
            tenant=request.tenant,
            weight=request.tenant_weight,
        )

    @property
    def pixels(self) -> int:
        """Its pixels, of every frame of a clip."""
        return math.prod(self.resolution)

    @property
    def remaining_steps(self) -> int:
        return self.num_steps - self.steps_done

    @property
    def done(self) -> bool:
        return self.steps_done >= self.num_steps
