"""Prometheus metrics of one server, in their own registry (no process-wide globals)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from gouache.outputs import EngineStats

_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# recorded by the API server, not by engines
API_FAMILIES = ("gouache_request_latency_seconds", "gouache_tier_latency_seconds", "gouache_errors",
                "gouache_tenant_requests")
_REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0, 600.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_length = Gauge("gouache_queue_length", "Images accepted but not yet denoising", registry=r)
        self.running_batch = Gauge("gouache_running_batch_size", "Images in the denoising batch", registry=r)
        self.step_latency = Histogram(
            "gouache_step_latency_seconds", "Wall time of one engine step (all forwards)", buckets=_STEP_BUCKETS,
            registry=r
        )
        self.step_overhead = Histogram(
            "gouache_step_overhead_seconds",
            "Engine time per step outside the model forwards (schedule, batch, update)",
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.request_latency = Histogram(
            "gouache_request_latency_seconds", "Acceptance to last image of a request", buckets=_REQUEST_BUCKETS,
            registry=r
        )
        self.tier_latency = Histogram(
            "gouache_tier_latency_seconds", "Acceptance to last image of a request, by its service tier", ["tier"],
            buckets=_REQUEST_BUCKETS, registry=r
        )
        self.queueing_time = Histogram(
            "gouache_queueing_seconds", "Acceptance to first denoising step of an image", buckets=_REQUEST_BUCKETS,
            registry=r
        )
        self.images = Counter("gouache_images_total", "Images returned", registry=r)
        self.videos = Counter("gouache_videos_total", "Clips returned (a video model's)", registry=r)
        self.video_frames = Counter("gouache_video_frames_total", "Frames of the clips returned", registry=r)
        self.image_steps = Counter("gouache_image_steps_total",
                                   "Denoising steps of one image, by the sequence-parallel degree it ran at",
                                   ["degree"], registry=r)
        self.handoffs = Counter("gouache_handoffs_total",
                                "Denoising states moved from one device block to another", registry=r)
        self.errors = Counter("gouache_errors_total", "Requests that ended with an error", ["kind"], registry=r)
        self.tenant_requests = Counter("gouache_tenant_requests_total",
                                       "API requests by tenant (API key name) and service tier: accepted, or "
                                       "limited (429: over the tenant's rate or concurrency)",
                                       ["tenant", "tier", "result"], registry=r)
        self.pauses = Counter("gouache_pauses_total",
                              "Images paused at a step boundary for a higher service tier's request, by their tier",
                              ["tier"], registry=r)
        self.paused_host_bytes = Gauge("gouache_paused_host_bytes",
                                       "Paused images' denoising states parked in host memory (--paused-host-mb), "
                                       "after the last step", registry=r)
        self.step_time_scale = Gauge("gouache_step_time_scale",
                                     "Measured step seconds over the cost model's prediction, a running mean of the "
                                     "last steps; the deadline policies plan with predictions times this "
                                     "(--calibrate-steps)", registry=r)
        self.cache_blocks = Counter("gouache_block_cache_blocks_total",
                                    "Blocks of block-cached images (per patch when patched): reused or computed",
                                    ["result"], registry=r)
        self.cache_bytes = Gauge("gouache_block_cache_bytes", "Activations the block cache holds, by device",
                                 ["device"], registry=r)
        self.cache_decide = Counter("gouache_block_cache_decide_seconds_total",
                                    "Time the block cache's reuse predictor took to decide (--block-cache-predictor)",
                                    registry=r)
        self.template_tokens = Counter("gouache_template_tokens_total",
                                       "Token-blocks (a token in one block) of template edits: image tokens replayed "
                                       "from the template or computed, text rows replayed (replayed_text)",
                                       ["result"], registry=r)
        self.template_lookups = Counter("gouache_template_store_lookups_total",
                                        "Template store reads: a hit in a tier (device, host, disk) or a miss",
                                        ["result"], registry=r)
        self.template_bytes = Gauge("gouache_template_store_bytes", "Template activations held, by device and tier",
                                    ["device", "tier"], registry=r)
        self.lora_steps = Counter("gouache_lora_steps_total",
                                  "Steps that applied LoRA adapters, by how: merged into the weights, segmented per "
                                  "request rows in one forward, or split into a forward per adapter set",
                                  ["mode"], registry=r)
        self.lora_merge = Histogram("gouache_lora_merge_seconds", "Merging and unmerging adapter weights in one step",
                                    buckets=_STEP_BUCKETS, registry=r)
        self.lora_loads = Counter("gouache_lora_loads_total",
                                  "Adapter loads: from host memory (hit), from a file (miss), or refused (failed)",
                                  ["result"], registry=r)
        self.lora_load_time = Histogram("gouache_lora_load_seconds", "Reading and checking one adapter file",
                                        buckets=_STEP_BUCKETS, registry=r)
        self.lora_request_steps = Counter("gouache_lora_request_steps_total",
                                          "Request-steps whose adapters were still loading: run without them (before "
                                          "the loading bound) or waiting (at it)", ["result"], registry=r)
        self.lora_bytes = Gauge("gouache_lora_host_bytes", "Adapters held in host memory, by device", ["device"],
                                registry=r)

        self.compile_steps = Counter("gouache_compile_steps_total",
                                     "Steps under --compile: every denoiser forward compiled, or one eager, by why "
                                     "(a technique that runs eagerly, a changed module, rows past the last bucket)",
                                     ["path", "reason"], registry=r)
        self.compile_graphs = Counter("gouache_compile_graphs_total", "Denoiser graphs compiled (warm-up included)",
                                      registry=r)
        self.compile_recompiles = Counter("gouache_compile_recompiles_total",
                                          "Denoiser graphs compiled after the warm-up: shapes it did not foresee",
                                          registry=r)
        self.compile_failures = Counter("gouache_compile_failures_total",
                                        "Denoiser graphs that failed to compile or load (a damaged compile cache, an "
                                        "unsupported operator): their shapes run eagerly, reason compile_failed",
                                        registry=r)
        self.compile_warmup = Gauge("gouache_compile_warmup_seconds", "Seconds compiling before serving, by device",
                                    ["device"], registry=r)
        self.conditioning_lookups = Counter("gouache_conditioning_cache_total",
                                            "Conditioning cache lookups at preparation: text-encoder outputs of a "
                                            "prompt (text) or the VAE encoding of an upload (vae), found or computed",
                                            ["kind", "result"], registry=r)
        self.conditioning_bytes = Gauge("gouache_conditioning_cache_bytes",
                                        "Text-encoder outputs and upload encodings the conditioning cache holds",
                                        registry=r)
        self.controlnet_runs = Counter("gouache_controlnet_runs_total",
                                       "ControlNet runs over a forward's rows: in this process before the forward "
                                       "(local), or on the service with residuals of the same step (sync) or the "
                                       "previous one (async)", ["mode"], registry=r)
        self.controlnet_wait = Histogram("gouache_controlnet_wait_seconds",
                                         "Seconds one step's forwards waited for ControlNet residuals (local: "
                                         "computing them)", buckets=_STEP_BUCKETS, registry=r)
        self.controlnet_loads = Counter("gouache_controlnet_loads_total",
                                        "ControlNet model loads: already loaded (hit) or read from disk (miss)",
                                        ["result"], registry=r)
        self.controlnet_load_time = Histogram("gouache_controlnet_load_seconds", "Reading one ControlNet from disk",
                                              buckets=_STEP_BUCKETS, registry=r)

    def error_counts(self) -> dict[str, int]:
        """Requests answered with an error since start, by kind."""
        return {sample.labels["kind"]: int(sample.value) for family in self.errors.collect()
                for sample in family.samples if sample.name == "gouache_errors_total"}

    def render(self) -> bytes:
        """The text exposition format for GET /metrics."""
        return generate_latest(self.registry)

    def render_with(self, stats: EngineStats) -> bytes:
        """`render` with the queue gauges set from an engine's snapshot."""
        self.queue_length.set(stats.waiting)
        self.running_batch.set(stats.running)
        return self.render()


class _Families:
    """What `generate_latest` reads: metric families, already collected."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def merged_exposition(api: Metrics, replicas: Mapping[str, bytes]) -> bytes:
    """One exposition for an API server in front of replica engines: the API's own families
    (`API_FAMILIES`) as they are, every engine family from each replica's exposition with a
    `replica` label on its samples."""
    families = [family for family in api.registry.collect() if family.name in API_FAMILIES]
    by_name: dict[str, Metric] = {}
    for replica, text in replicas.items():
        for family in text_string_to_metric_families(text.decode()):
            if family.name in API_FAMILIES:
                continue
            merged = by_name.setdefault(family.name, family)
            samples = [s._replace(labels={**s.labels, "replica": replica}) for s in family.samples]
            if merged is family:
                family.samples = samples
            else:
                merged.samples.extend(samples)
    return generate_latest(_Families([*families, *by_name.values()]))
