"""Data that leaves the engine: per-step results for the scheduler, events for clients and the
engine's state for /health and /metrics.

Plain values only; encoded images are bytes (PNG/JPEG/WebP), never tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BlockCacheReport:
    """What the block cache did in one step (`gouache.block_cache`)."""

    reused: int = 0  # unit-blocks reused (units: patches, tokens or images)
    computed: int = 0  # ... and computed, of the images it caches
    held_bytes: int = 0  # activations held after it
    decide_s: float = 0.0  # seconds the reuse predictor took to decide (0 under the fixed threshold)

    def record(self, metrics, device: str) -> None:
        metrics.cache_blocks.labels("reused").inc(self.reused)
        metrics.cache_blocks.labels("computed").inc(self.computed)
        metrics.cache_bytes.labels(device).set(self.held_bytes)
        metrics.cache_decide.inc(self.decide_s)


@dataclass
class TemplateReport:
    """What template replay did in one step (`gouache.templates`)."""

    # token-blocks of template edits: replayed | computed | replayed_text
    tokens: dict[str, int] = field(default_factory=dict)
    lookups: dict[str, int] = field(default_factory=dict)  # store gets: hit tier (device|host|disk) | miss
    held_bytes: dict[str, int] = field(default_factory=dict)  # the store's bytes per tier after it

    def record(self, metrics, device: str) -> None:
        for result, n in self.tokens.items():
            metrics.template_tokens.labels(result).inc(n)
        for result, n in self.lookups.items():
            metrics.template_lookups.labels(result).inc(n)
        for tier, n in self.held_bytes.items():
            metrics.template_bytes.labels(device, tier).set(n)


@dataclass
class LoraReport:
    """What LoRA adapters did in one step (`gouache.lora`)."""

    mode: str = ""  # how adapters applied: merged | segmented | split ("" if none did)
    merge_s: float = 0.0  # seconds merging and unmerging adapter weights
    waiting: int = 0  # requests left out of the step: at their loading bound, adapters still loading
    without: int = 0  # requests that ran the step without their adapters (still loading, before the bound)
    loads: dict[str, int] = field(default_factory=dict)  # adapter loads: hit | miss | failed
    load_s: list[float] = field(default_factory=list)  # seconds of each adapter file read that ended
    held_bytes: int = 0  # adapters held in host memory after it

    def record(self, metrics, device: str) -> None:
        if self.mode:
            metrics.lora_steps.labels(self.mode).inc()
        if self.merge_s:
            metrics.lora_merge.observe(self.merge_s)
        for result, n in self.loads.items():
            metrics.lora_loads.labels(result).inc(n)
        for seconds in self.load_s:
            metrics.lora_load_time.observe(seconds)
        for result, n in (("without", self.without), ("waiting", self.waiting)):
            if n:
                metrics.lora_request_steps.labels(result).inc(n)
        metrics.lora_bytes.labels(device).set(self.held_bytes)


@dataclass
class ControlNetReport:
    """What ControlNets did in one step (`gouache.controlnet`)."""

    runs: dict[str, int] = field(default_factory=dict)  # ControlNet runs over a forward's rows, by mode
    wait_s: float = 0.0  # seconds the forwards waited for residuals (in process: computed them)
    loads: dict[str, int] = field(default_factory=dict)  # ControlNet model loads: hit | miss
    load_s: list[float] = field(default_factory=list)  # seconds of each ControlNet read from disk

    def record(self, metrics, device: str) -> None:
        for mode, n in self.runs.items():
            metrics.controlnet_runs.labels(mode).inc(n)
        if self.runs:
            metrics.controlnet_wait.observe(self.wait_s)
        for result, n in self.loads.items():
            metrics.controlnet_loads.labels(result).inc(n)
        for seconds in self.load_s:
            metrics.controlnet_load_time.observe(seconds)


@dataclass
class ConditioningReport:
    """Conditioning cache lookups since the last report (`gouache.runner.conditioning`)."""

    lookups: dict[tuple[str, str], int] = field(default_factory=dict)  # (text | vae, hit | miss) -> count
    held_bytes: int = 0  # what the cache holds after them

    def record(self, metrics) -> None:
        for (kind, result), n in self.lookups.items():
            metrics.conditioning_lookups.labels(kind, result).inc(n)
        metrics.conditioning_bytes.set(self.held_bytes)


@dataclass
class CompileReport:
    """What compiled forwards did since the last report (`gouache.runner.compiled`)."""

    compiled: int = 0  # steps whose every denoiser forward ran compiled
    eager: dict[str, int] = field(default_factory=dict)  # steps with an eager forward, by why (the first one)
    graphs: int = 0  # graphs compiled
    recompiles: int = 0  # ... of which after the warm-up
    failed: int = 0  # graphs that failed to compile or load (their shapes run eagerly, `compile_failed`)
    warmup_s: float = 0.0  # seconds compiling at start

    def record(self, metrics, device: str) -> None:
        if self.compiled:
            metrics.compile_steps.labels("compiled", "").inc(self.compiled)
        for why, n in self.eager.items():
            metrics.compile_steps.labels("eager", why).inc(n)
        metrics.compile_graphs.inc(self.graphs)
        metrics.compile_recompiles.inc(self.recompiles)
        metrics.compile_failures.inc(self.failed)
        if self.warmup_s:
            metrics.compile_warmup.labels(device).set(self.warmup_s)


@dataclass
class StepOutput:
    """What the runner reports after executing one step plan: which requests stepped, and each
    technique's own report."""

    request_ids: list[str]  # [num_reqs] requests that advanced by one denoising step
    forward_s: float  # wall time of the model forwards (and sampler steps) of this step
    collective_s: float = 0.0  # of which in sequence-parallel collectives (all-to-all, all-gather), on one rank
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why its step failed (it did not advance)
    # of those, the ones whose own input is at fault (an adapter file that cannot serve them):
    # request id -> the request field to fix; answered 400, the others 500
    invalid: dict[str, str] = field(default_factory=dict)
    block_cache: BlockCacheReport = field(default_factory=BlockCacheReport)
    templates: TemplateReport = field(default_factory=TemplateReport)  # empty when no edit used a template
    lora: LoraReport = field(default_factory=LoraReport)
    controlnet: ControlNetReport = field(default_factory=ControlNetReport)
    compile: CompileReport = field(default_factory=CompileReport)

    def record(self, metrics, device: str) -> None:
        """Each technique's report into /metrics (`device`: the first of the step's devices)."""
        for report in (self.block_cache, self.templates, self.lora, self.controlnet, self.compile):
            report.record(metrics, device)


@dataclass
class CacheBytes:
    """What one device's caches hold between steps, for /metrics to be true when nothing runs."""

    block_cache: int  # the block cache's activations (released requests' freed first)
    lora: int  # adapters in host memory
    templates: dict[str, int] = field(default_factory=dict)  # the template store's bytes per tier; {}: no store

    def record(self, metrics, device: str) -> None:
        metrics.cache_bytes.labels(device).set(self.block_cache)
        metrics.lora_bytes.labels(device).set(self.lora)
        for tier, n in self.templates.items():
            metrics.template_bytes.labels(device, tier).set(n)


@dataclass
class ProgressEvent:
    """One denoising step of one image finished."""

    index: int  # which of the user's n images
    step: int  # steps done, 1-based
    total_steps: int


@dataclass
class PausedEvent:
    """A higher tier's request took the image's slot at a step boundary: it waits with its
    progress kept, and resumes where it stopped (the next `ProgressEvent`)."""

    index: int
    step: int  # steps done so far
    total_steps: int


@dataclass
class PartialImageEvent:
    """A decoded preview of an image that is still being denoised."""

    index: int
    partial_image_index: int  # 0-based count of previews of this image
    image: bytes  # encoded in the request's output_format


@dataclass
class ImageEvent:
    """A finished image, or clip (of a video model)."""

    index: int
    image: bytes  # encoded in the request's output_format; a clip's MP4
    seed: int  # the seed that made it, so the user can reproduce it
    thumbnail: bytes = b""  # a clip's first frame as WebP; empty for an image


@dataclass
class ErrorEvent:
    """The request ended without its images."""

    kind: str  # GouacheError.kind
    message: str
    status: int  # HTTP status the API answers with


Event = ProgressEvent | PausedEvent | PartialImageEvent | ImageEvent | ErrorEvent


@dataclass
class EngineStats:
    """A snapshot for /health and /metrics."""

    waiting: int  # requests accepted but not denoising (preparing, queued, or paused for a higher tier)
    running: int  # requests in the denoising batch
    finished: int  # images returned since start
    failed: int  # images that ended with an error since start
    status: str = "ok"  # ok | draining (shutting down, admits nothing) | dead (the engine loop died)
