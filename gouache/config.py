"""Typed configuration. Every field is documented and checked in `__post_init__`."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
from dataclasses import dataclass, field

from gouache.request import TIERS

DEFAULT_QUEUE_SHARES = (("flex", 0.5),)  # (service tier, share of the queue limit); absent tiers: all of it
# The deadlines a tier may be given (`--tier-slo-ms`), in ms: less than a millisecond is a deadline
# no step meets (its requests would all be dropped at once), more than 1e9 ms (11.6 days) outlives
# any request, and inf or NaN would be no deadline at all to plan by.
MIN_TIER_SLO_MS, MAX_TIER_SLO_MS = 1.0, 1e9
# The most images in flight a server may hold (`--max-queue-len`): each holds its latents and
# conditioning, so a million is past any host's memory; a tier's and a tenant's shares of it are
# computed in floats, which hold every count up to it exactly.
MAX_QUEUE_LEN = 1_000_000
# The longest round (`--round-s`): an hour, past any step. A round runs floor(τ / T) steps of T
# seconds, which stays a finite count for any step a cost model may hold (`sched.cost_fields`).
MAX_ROUND_S = 3600.0
# The longest timeout or grace a flag may set (a day): each becomes a deadline on a clock, a poll's
# milliseconds or an asyncio timeout, which an infinite or 1e308-second value would overflow.
MAX_TIMEOUT_S = 86400.0
# The most a server may let one request ask (`--max-size`, `--max-steps`): 16384 px a side is
# 268 M pixels an image, past any model's trained sizes; 10,000 steps, past any sampler's schedule.
MAX_SIZE_PX, MAX_STEPS = 16384, 10_000


EXECUTORS = ("uniproc", "multiproc", "ray")  # where the model runs: see gouache/executor
# how a replica's devices share a Ray cluster's nodes (gouache/executor/ray_cluster.py): all on one,
# on as few as have room, or across them
RAY_PLACEMENTS = ("strict-pack", "pack", "spread")

_DTYPES = ("float32", "float16", "bfloat16")
CONTROLNET_MODES = ("sync", "async")  # residuals of step t join step t, or step t + 1
MAX_BLOCK_CACHE_THRESHOLD = 1.0  # a relative change of 1 is as large as the input itself
# How long a device worker (process or actor) that owes a reply may stay silent before it is taken
# for hung, killed and lost like a dead one. A step of a full-size model takes tens of seconds on
# a many-core CPU, and a request's first step on a worker also reads its adapters; five minutes
# leaves room for both, is well past the collective timeout (60 s: a worker waiting in a
# collective on a hung peer gives up first, so only the hung one is killed), and finds a hung
# worker inside the 600 s request timeout, so its requests fail with the reason.
WORKER_TIMEOUT_S = 300.0
# The largest patch side by default, a common factor of 512..1024 sizes (PatchedServe mixes 512,
# 768 and 1024 px). A forward cuts its images into the largest patches up to this that fit all of
# them: fewer, larger patches carry less halo and keep convolutions efficient (sdxl-arch, two
# 256 px and two 512 px requests: 1.09 of their grouped time at 128 px patches, 1.02 at 256).
DEFAULT_PATCH_PIXELS = 256


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass
class ModelConfig:
    """Which model to serve and where it runs."""

    model: str = "shapes-unet"  # a built-in name (see `gouache models`) or a local diffusers directory
    dtype: str = "float32"  # weights and activations: float32 | float16 | bfloat16
    device: str = "cpu"  # torch device string: cpu, cuda, cuda:1
    # the denoiser's linear layers: int8 | fp8 (GPU) (`gouache.runner.quantize`); None: as loaded
    quantize: str | None = None

    def __post_init__(self) -> None:
        _check(bool(self.model), "model must name a built-in model or a local directory")
        _check(self.dtype in _DTYPES, f"dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        _check(self.quantize in (None, "int8", "fp8"), f"quantize must be int8 or fp8, got {self.quantize!r}")
        _check(self.quantize != "fp8" or self.device.startswith("cuda"),
               "--quantize fp8 needs a GPU with float8 units (H100 or later); on the CPU use --quantize int8")
        _check(self.quantize is None or importlib.util.find_spec("torchao") is not None,
               "--quantize needs torchao, an optional extra: pip install 'gouache[quantize]'")


@dataclass
class SchedulerConfig:
    """How the denoising stage picks the requests of each step."""

    policy: str = "orca"  # a name from gouache.sched.policies.POLICIES
    # most requests denoised together in one step; None: as many as pay on the device, measured
    # at start by `build_engine` (`gouache.runner.batch_probe`), which a policy needs first
    max_batch_size: int | None = 8
    cost_model: str | None = None  # JSON from `gouache profile`, for SLO-aware policies
    round_s: float = 0.5  # round-knapsack's round length τ in seconds (at least one step is always taken)
    run_late: bool = True  # round-knapsack gives idle devices to requests that will miss their deadline anyway
    # (tier, ms): the deadline of a request of that service tier that sends no slo_ms (deadline policies)
    tier_slo_ms: tuple[tuple[str, float], ...] = ()
    # the cost model's step times are scaled online by measured over predicted (gouache.sched.calibration)
    calibrate_steps: bool = True

    def __post_init__(self) -> None:
        _check(self.max_batch_size is None or self.max_batch_size >= 1,
               f"max_batch_size must be >= 1, got {self.max_batch_size}")
        _check(0 < self.round_s <= MAX_ROUND_S,
               f"round_s must be in (0, {MAX_ROUND_S:g}] seconds, got {self.round_s}")
        for tier, ms in self.tier_slo_ms:
            _check(tier in TIERS, f"tier_slo_ms names tier {tier!r}; the tiers are {', '.join(TIERS)}")
            _check(MIN_TIER_SLO_MS <= ms <= MAX_TIER_SLO_MS,
                   f"tier_slo_ms of {tier} must be in [{MIN_TIER_SLO_MS:g}, {MAX_TIER_SLO_MS:g}] ms, got {ms}")


COMPILE_BUCKETS = (1, 2, 4, 8, 16)
COMPILE_GRAPHS = 32  # graphs a compiled model warms up at most, over every kind of step (--compile-graphs)


@dataclass(frozen=True)
class CompileConfig:
    """Compiled denoiser forwards (`gouache.runner.compiled`)."""

    enabled: bool = False
    # row counts warmed up (a graph of dynamic rows serves those between; padded up to under CUDA graphs);
    # larger forwards run eagerly
    buckets: tuple[int, ...] = COMPILE_BUCKETS
    # (h, w), a clip's (h, w, frames), compiled at start at every bucket; (): the model's default size
    sizes: tuple[tuple[int, ...], ...] = ()
    # compiled kernels kept here across restarts; None: torch's default (per user, in /tmp)
    cache_dir: str | None = None
    cuda_graphs: bool = False  # capture the bucketed graphs as CUDA graphs (GPU only)
    # graphs warmed up at most: a row graph per size and bucket first, what is left to forwards of mixed
    # sizes: packed token buckets, a UNet's patched graphs (None: COMPILE_GRAPHS; a given budget is
    # refused where no such forward compiles)
    graphs: int | None = None
    # a shape first met while serving runs eagerly while a child process compiles it (`gouache.runner.background`);
    # off: it compiles in its step, which waits for it
    background: bool = True
    # torch.compile's backend: "inductor" (generated kernels); "eager" traces and guards the same
    # graphs but runs their operators as they are (tests of the graphs' paths, without codegen)
    backend: str = "inductor"

    def __post_init__(self) -> None:
        _check(bool(self.buckets) and all(b >= 1 for b in self.buckets),
               f"compile buckets must be row counts >= 1, got {self.buckets}")
        _check(self.graphs is None or self.graphs >= 1, f"compile graphs must be >= 1, got {self.graphs}")
        _check(self.enabled or self.graphs is None, "--compile-graphs bounds compiled forwards: add --compile")
        _check(self.enabled or not (self.sizes or self.cuda_graphs or self.cache_dir),
               "compile sizes, cache and CUDA graphs apply to compiled forwards: add --compile")
        _check(self.backend in ("inductor", "eager"),
               f"compile backend must be inductor or eager, got {self.backend!r}")
        _check(self.backend == "inductor" or not self.cuda_graphs, "CUDA graphs are captured by the inductor backend")
        _check(self.enabled or self.backend == "inductor",
               "a compile backend applies to compiled forwards: add --compile")


@dataclass(frozen=True)
class BlockCacheConfig:
    """PatchedServe §5's block cache (`gouache.block_cache.store`): off unless a threshold is given."""

    threshold: float = 0.0  # the server's default relative-change threshold; 0 keeps requests exact
    max_reuse: int = 2  # most steps in a row a unit may reuse one block's output
    budget_bytes: int = 2 << 30  # cached activations held at most (after each forward)
    predictor: str | None = None  # `gouache profile --reuse` file: a learned decision instead of the threshold

    def __post_init__(self) -> None:
        _check(0 <= self.threshold <= MAX_BLOCK_CACHE_THRESHOLD,
               f"block cache threshold must be in [0, {MAX_BLOCK_CACHE_THRESHOLD}], got {self.threshold}")
        _check(self.max_reuse >= 1, f"block cache max_reuse must be >= 1, got {self.max_reuse}")
        _check(self.budget_bytes >= 0, f"block cache budget must be >= 0 bytes, got {self.budget_bytes}")


@dataclass(frozen=True)
class TemplateConfig:
    """InstGenIE's mask-aware edits (`gouache.templates.replay`): templates' activations
    in a tiered store. Edits use them when they ask (`template_cache`), or all edits with `default`."""

    default: bool = False  # edits that do not say use templates
    directory: str | None = None  # the store's disk tier; None: a temporary directory of the server
    device_bytes: int = 0  # activations held in device memory (a GPU's; 0 on a CPU, where host memory is the device's)
    host_bytes: int = 2 << 30  # ... in host memory
    disk_bytes: int = 16 << 30  # ... on disk
    full_above: float = 0.9  # without a cost model: an edit computing more than this share of the tokens runs in full
    cost_model: str | None = None  # `gouache profile --edits` JSON: the live load plan decides per block and step

    def __post_init__(self) -> None:
        for name in ("device_bytes", "host_bytes", "disk_bytes"):
            _check(getattr(self, name) >= 0, f"template store {name} must be >= 0, got {getattr(self, name)}")
        _check(0 < self.full_above <= 1, f"template full_above must be in (0, 1], got {self.full_above}")

    def budgets(self) -> dict[str, int]:
        return {"device": self.device_bytes, "host": self.host_bytes, "disk": self.disk_bytes}

    def under(self, part: str) -> TemplateConfig:
        """The config of one store of several sharing `directory` (a replica's, a device's): its own
        subdirectory, so that each owns its files and budgets."""
        if self.directory is None:
            return self
        return dataclasses.replace(self, directory=os.path.join(self.directory, part))


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters (`gouache.lora`): files in `directory`, the popular ones in host memory,
    and KATZ's bounded asynchronous loading: a request whose adapters are still being read
    starts without them and takes them at the first step after they arrive, no later than step
    `bound` (waiting there). `bound` 0 is synchronous loading (exact)."""

    directory: str | None = None  # `--lora-dir`: <name>.safetensors files; None: no adapters
    host_bytes: int = 2 << 30  # adapters kept in host memory (LRU)
    bound: int = 0  # the step by which a request's adapters must have joined (0: before its first)
    # "mixed": requests of different adapters share a forward; "per-adapter": a forward per
    # adapter set (the baseline of servers that batch only one adapter's requests together)
    batching: str = "mixed"

    def __post_init__(self) -> None:
        _check(self.batching in ("mixed", "per-adapter"),
               f"LoRA batching must be 'mixed' or 'per-adapter', got {self.batching!r}")
        _check(self.host_bytes >= 0, f"LoRA host memory must be >= 0 bytes, got {self.host_bytes}")
        _check(self.bound >= 0, f"the LoRA loading bound must be a step >= 0, got {self.bound}")


@dataclass(frozen=True)
class ServiceAddress:
    """Where a ControlNet service listens (`gouache.controlnet.service`): a Unix socket
    per worker process, and the key that admits its clients."""

    sockets: tuple[str, ...]
    authkey: bytes

    def worker_of(self, name: str) -> int:
        """The worker that runs ControlNet `name` (rendezvous hashing: few move when workers change)."""
        return max(range(len(self.sockets)),
                   key=lambda i: hashlib.blake2b(f"{i}/{name}".encode(), digest_size=8).digest())


@dataclass(frozen=True)
class ControlNetConfig:
    """ControlNets (`gouache.controlnet.model`, KATZ §5): diffusers directories in
    `directory`, run in this process before each forward (`workers` 0: the sequential way of
    diffusers' pipelines) or as a service of `workers` processes, each caching models in
    `model_bytes`, whose residuals of step t join step t (`mode` "sync": exact) or step t + 1
    ("async": the ControlNet runs beside the whole base step)."""

    directory: str | None = None  # `--controlnet-dir`: <name>/config.json + weights; None: no ControlNets
    workers: int = 0  # ControlNet service processes; 0: in-process, in sequence with the base model
    mode: str = "sync"  # the default of requests that do not say: sync | async
    model_bytes: int = 4 << 30  # ControlNet weights each process keeps loaded (least recently used leave first)
    torch_threads: int | None = None  # intra-op threads of each service process; None: torch's default
    service: ServiceAddress | None = None  # the running service (set by whoever starts it); None: none yet
    # a service worker that sends no residuals this long for one forward is taken for hung (its
    # requests fail); under a device worker it must be less than that worker's timeout, so the
    # worker gives up on the service before it is taken for hung itself (EngineConfig checks)
    reply_timeout_s: float = 0.8 * WORKER_TIMEOUT_S

    def __post_init__(self) -> None:
        _check(self.workers >= 0, f"ControlNet workers must be >= 0, got {self.workers}")
        _check(self.mode in CONTROLNET_MODES, f"ControlNet mode must be 'sync' or 'async', got {self.mode!r}")
        _check(self.mode == "sync" or self.workers > 0,
               "async ControlNet residuals need the ControlNet service: give --controlnet-workers 1 or more")
        _check(self.model_bytes >= 0, f"ControlNet memory must be >= 0 bytes, got {self.model_bytes}")
        _check(self.torch_threads is None or self.torch_threads >= 1, "ControlNet torch_threads must be >= 1")
        _check(self.reply_timeout_s > 0, f"ControlNet reply_timeout_s must be positive, got {self.reply_timeout_s}")


@dataclass
class EngineConfig:
    """Limits and worker counts of one engine (one replica)."""

    max_queue_len: int = 64  # requests waiting or running before new ones get 429
    # (tier, share): a tier's requests get 429 once their tier and the higher ones hold this share
    # of max_queue_len (`sched.tiers.queue_limit`); absent tiers: all of it
    tier_queue_share: tuple[tuple[str, float], ...] = DEFAULT_QUEUE_SHARES
    request_timeout_s: float = 600.0  # a request still unfinished after this ends with a timeout error
    image_workers: int = 1  # processes that decode uploads and encode PNG/JPEG/WebP
    torch_threads: int | None = None  # intra-op threads of torch; None keeps torch's default
    max_upload_pixels: int = 4096 * 4096  # Pillow's decompression-bomb limit for edit uploads
    # the largest patch side in pixels under patched batching (UNets); each forward cuts its images
    # into the largest patches up to this that fit all of them; None: DEFAULT_PATCH_PIXELS. Refused for DiTs.
    patch_pixels: int | None = None
    # uniproc: the model in this process; multiproc: a worker process per device; ray: a Ray actor per device
    executor: str = "uniproc"
    devices: int = 1  # devices of this replica (its worker processes or actors)
    ray_address: str | None = None  # under ray: the cluster to join ("auto": the local one); None starts one here
    ray_placement: str = "strict-pack"  # under ray: a replica's devices on one node, or straddling (`RAY_PLACEMENTS`)
    # under ray: a custom resource each device also reserves one unit of, so that only the nodes
    # started with it (`ray start --resources`) take devices and replicas; None: any node with a CPU / GPU
    ray_resource: str | None = None
    # under multiproc / ray: a worker silent this long while it owes a reply is hung
    worker_timeout_s: float = WORKER_TIMEOUT_S
    conditioning_bytes: int = 256 << 20  # prompts' encodings and uploads' VAE encodings kept for repeats (0: off)
    # host memory for paused requests' states (`DevicePool.park`; 0: they stay on their devices)
    paused_host_bytes: int = 0
    compile: CompileConfig = field(default_factory=CompileConfig)  # compiled denoiser forwards (opt-in)
    block_cache: BlockCacheConfig = field(default_factory=BlockCacheConfig)  # per-request block reuse (opt-in)
    templates: TemplateConfig = field(default_factory=TemplateConfig)  # mask-aware edits of templates (opt-in)
    lora: LoraConfig = field(default_factory=LoraConfig)  # LoRA adapters per request
    controlnet: ControlNetConfig = field(default_factory=ControlNetConfig)  # ControlNets per request

    def __post_init__(self) -> None:
        _check(1 <= self.max_queue_len <= MAX_QUEUE_LEN,
               f"max_queue_len must be in [1, {MAX_QUEUE_LEN}], got {self.max_queue_len}")
        for tier, share in self.tier_queue_share:
            _check(tier in TIERS, f"tier_queue_share names tier {tier!r}; the tiers are {', '.join(TIERS)}")
            _check(0 < share <= 1, f"tier_queue_share of {tier} must be in (0, 1], got {share}")
        _check(0 < self.request_timeout_s <= MAX_TIMEOUT_S,
               f"request_timeout_s must be in (0, {MAX_TIMEOUT_S:g}] seconds, got {self.request_timeout_s}")
        _check(self.image_workers >= 1, f"image_workers must be >= 1, got {self.image_workers}")
        _check(self.torch_threads is None or self.torch_threads >= 1, "torch_threads must be >= 1")
        _check(self.max_upload_pixels > 0, "max_upload_pixels must be positive")
        _check(self.patch_pixels is None or self.patch_pixels > 0,
               f"--patch-size must be positive, got {self.patch_pixels}")
        _check(self.executor in EXECUTORS, f"executor must be one of {', '.join(EXECUTORS)}, got {self.executor!r}")
        _check(self.devices >= 1, f"devices must be >= 1, got {self.devices}")
        _check(self.executor != "uniproc" or self.devices == 1,
               f"the uniproc executor runs one device; --devices {self.devices} needs --executor multiproc or ray")
        _check(0 < self.worker_timeout_s <= MAX_TIMEOUT_S,
               f"worker_timeout_s must be in (0, {MAX_TIMEOUT_S:g}] seconds, got {self.worker_timeout_s}")
        _check(self.conditioning_bytes >= 0, f"conditioning_bytes must be >= 0, got {self.conditioning_bytes}")
        _check(self.paused_host_bytes >= 0, f"paused_host_bytes must be >= 0, got {self.paused_host_bytes}")
        _check(self.executor == "uniproc" or self.controlnet.reply_timeout_s < self.worker_timeout_s,
               f"the ControlNet service's reply timeout ({self.controlnet.reply_timeout_s:g} s) must be less than "
               f"the worker timeout ({self.worker_timeout_s:g} s): a worker waiting on the service must give up first")
        _check(self.ray_address is None or self.executor == "ray",
               f"a Ray address is read only by the ray executor, not {self.executor!r}")
        _check(self.ray_placement in RAY_PLACEMENTS,
               f"ray_placement must be one of {', '.join(RAY_PLACEMENTS)}, got {self.ray_placement!r}")
        _check(self.ray_placement == "strict-pack" or self.executor == "ray",
               f"a Ray placement is read only by the ray executor, not {self.executor!r}")
        _check(self.ray_resource is None or (self.executor == "ray" and self.ray_address is not None),
               "a Ray resource picks nodes of an existing cluster: give it with --executor ray --ray-address "
               "(the Ray this server starts has one node, without custom resources)")
        _check(self.ray_resource is None or (self.ray_resource.strip() and self.ray_resource not in ("CPU", "GPU")),
               f"ray_resource must name a custom resource of the cluster's nodes, got {self.ray_resource!r}")
        _check(not (self.controlnet.workers and self.executor == "ray"),
               "the ControlNet service listens on this machine's Unix sockets, which Ray actors elsewhere cannot "
               "reach: run --controlnet-workers with --executor uniproc or multiproc")


@dataclass
class ReplicaConfig:
    """Engines behind one API server: `replicas` engine processes, each request sent to one by `router`."""

    replicas: int = 1  # 1: the engine runs in the API's process; more: one engine process each
    router: str = "least-requests"  # a name from gouache.sched.router.ROUTERS (checked where it is made)

    def __post_init__(self) -> None:
        _check(self.replicas >= 1, f"replicas must be >= 1, got {self.replicas}")


@dataclass
class ServerConfig:
    """The HTTP front end."""

    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 25 * 1024 * 1024  # larger request bodies get 413
    min_size: int = 64  # smallest width or height in pixels
    max_size: int = 2048  # largest width or height in pixels
    max_pixels: int = 2048 * 2048  # largest width*height of one image
    max_n: int = 10  # most images per request (OpenAI allows 1-10)
    max_steps: int = 200  # most num_inference_steps per request
    file_ttl_s: float = 3600.0  # how long `response_format=url` images stay downloadable
    api_key: str | None = None  # set: `Authorization: Bearer <key>` on all routes but /health and the playground
    api_keys_file: str | None = None  # tenants' keys, tiers and limits (`gouache.api.tenants`); reloaded on SIGHUP
    served_model_names: tuple[str, ...] = ()  # ids clients may pass as `model`; () = the model's own id
    shutdown_grace_s: float = 30.0  # on SIGTERM / SIGINT, how long running requests may still finish

    def __post_init__(self) -> None:
        _check(0 < self.port < 65536, f"port must be in 1..65535, got {self.port}")
        _check(0 < self.min_size <= self.max_size <= MAX_SIZE_PX,
               f"sizes must satisfy 0 < min_size <= max_size <= {MAX_SIZE_PX} px, got {self.min_size} and "
               f"{self.max_size}")
        _check(self.max_pixels >= self.min_size**2, "max_pixels must allow at least min_size x min_size")
        _check(1 <= self.max_n <= 10, "max_n must be in 1..10")
        _check(1 <= self.max_steps <= MAX_STEPS, f"max_steps must be in 1..{MAX_STEPS}, got {self.max_steps}")
        _check(self.max_body_bytes > 0 and self.file_ttl_s > 0, "max_body_bytes and file_ttl_s must be positive")
        _check(self.api_key is None or bool(self.api_key.strip()), "api_key must not be empty")
        _check(self.api_key is None or self.api_keys_file is None,
               "give either one API key (--api-key, $GOUACHE_API_KEY) or a keys file (--api-keys), not both")
        _check(all(name.strip() for name in self.served_model_names), "served model names must not be empty")
        _check(0 <= self.shutdown_grace_s <= MAX_TIMEOUT_S,
               f"shutdown_grace_s must be in [0, {MAX_TIMEOUT_S:g}] seconds, got {self.shutdown_grace_s}")
