"""Data that leaves the engine: per-step results for the scheduler, events for clients and the
engine's state for /health and /metrics.

Plain values only; encoded images are bytes (PNG/JPEG/WebP), never tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepOutput:
    """What the runner reports after executing one step plan."""

    request_ids: list[str]  # [num_reqs] requests that advanced by one denoising step
    forward_s: float  # wall time of the model forwards (and sampler steps) of this step
    collective_s: float = 0.0  # of which in sequence-parallel collectives (all-to-all, all-gather), on one rank
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why its step failed (it did not advance)
    # of those, the ones whose own input is at fault (an adapter file that cannot serve them):
    # request id -> the request field to fix; answered 400, the others 500
    invalid: dict[str, str] = field(default_factory=dict)
    reused_blocks: int = 0  # unit-blocks the block cache reused in this step (units: patches or images)
    computed_blocks: int = 0  # ... and computed, of the images it caches
    cache_bytes: int = 0  # the block cache's activations held after it
    template_tokens: dict[str, int] = field(default_factory=dict)  # token-blocks of template edits: replayed | computed | replayed_text
    template_lookups: dict[str, int] = field(default_factory=dict)  # store gets: hit tier (device|host|disk) | miss
    template_bytes: dict[str, int] = field(default_factory=dict)  # the template store's bytes per tier after it
    lora_mode: str = ""  # how adapters applied: merged | segmented | split ("" if none did)
    lora_merge_s: float = 0.0  # seconds merging and unmerging adapter weights
    lora_waiting: int = 0  # requests left out of the step: at their loading bound, adapters still loading
    lora_without: int = 0  # requests that ran the step without their adapters (still loading, before the bound)
    lora_loads: dict[str, int] = field(default_factory=dict)  # adapter loads: hit | miss | failed
    lora_load_s: list[float] = field(default_factory=list)  # seconds of each adapter file read that ended
    lora_bytes: int = 0  # adapters held in host memory after it
    controlnet_runs: dict[str, int] = field(default_factory=dict)  # ControlNet runs over a forward's rows, by mode
    controlnet_wait_s: float = 0.0  # seconds the forwards waited for ControlNet residuals (in-process: computed them)
    controlnet_loads: dict[str, int] = field(default_factory=dict)  # ControlNet model loads: hit | miss
    controlnet_load_s: list[float] = field(default_factory=list)  # seconds of each ControlNet read from disk


@dataclass
class CacheBytes:
    """What one device's caches hold between steps, for /metrics to be true when nothing runs."""

    block_cache: int  # the block cache's activations (released requests' freed first)
    lora: int  # adapters in host memory
    templates: dict[str, int] = field(default_factory=dict)  # the template store's bytes per tier; {}: no store


@dataclass
class ProgressEvent:
    """One denoising step of one image finished."""

    index: int  # which of the user's n images
    step: int  # steps done, 1-based
    total_steps: int


@dataclass
class PartialImageEvent:
    """A decoded preview of an image that is still being denoised."""

    index: int
    partial_image_index: int  # 0-based count of previews of this image
    image: bytes  # encoded in the request's output_format


@dataclass
class ImageEvent:
    """A finished image."""

    index: int
    image: bytes  # encoded in the request's output_format
    seed: int  # the seed that made it, so the user can reproduce it


@dataclass
class ErrorEvent:
    """The request ended without its images."""

    kind: str  # GouacheError.kind
    message: str
    status: int  # HTTP status the API answers with


Event = ProgressEvent | PartialImageEvent | ImageEvent | ErrorEvent


@dataclass
class EngineStats:
    """A snapshot for /health and /metrics."""

    waiting: int  # requests accepted but not yet denoising (preparing or queued)
    running: int  # requests in the denoising batch
    finished: int  # images returned since start
    failed: int  # images that ended with an error since start
    status: str = "ok"  # ok | draining (shutting down, admits nothing) | dead (the engine loop died)
