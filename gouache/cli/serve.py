"""`gouache serve`: the OpenAI-compatible image server; its flags, grouped by what they tune, and
the engine's configs built from them."""

from __future__ import annotations

import argparse
import logging
import os

from gouache.cli.model_args import add_model_args
from gouache.cli_flags import (
    Given,
    GivenBool,
    batch_size_arg,
    counts_arg,
    given,
    mib_arg,
    refuse_ignored,
    shapes_arg,
    tier_share_arg,
    tier_slo_arg,
)
from gouache.config import (
    COMPILE_BUCKETS,
    COMPILE_GRAPHS,
    CONTROLNET_MODES,
    DEFAULT_PATCH_PIXELS,
    EXECUTORS,
    RAY_PLACEMENTS,
    BlockCacheConfig,
    CompileConfig,
    ControlNetConfig,
    EngineConfig,
    LoraConfig,
    ModelConfig,
    ReplicaConfig,
    SchedulerConfig,
    ServerConfig,
    TemplateConfig,
)


def _policies_where(attribute: str, value=True) -> str:
    """The serve policies whose class sets `attribute` (`needs_predictor`, `mixes_resolutions`)
    to `value` (any true value by default)."""
    from gouache.sched.policies import POLICIES

    return ", ".join(name for name, cls in POLICIES.items()
                     if (getattr(cls, attribute) if value is True else getattr(cls, attribute) == value))


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; 0.0.0.0 for every interface (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default: %(default)s)")
    _add_scheduling_args(p)
    _add_cache_args(p)
    _add_speed_args(p)
    _add_adapter_args(p)
    _add_process_args(p)
    _add_api_args(p)


def _add_scheduling_args(p: argparse.ArgumentParser) -> None:
    from gouache.sched.policies import POLICIES

    p.add_argument("--policy", default="orca", choices=sorted(POLICIES),
                   help="scheduling policy (default: %(default)s)")
    p.add_argument("--max-batch-size", type=batch_size_arg, default=None, metavar="N|auto",
                   help="most images denoised together in one step; auto: as many as pay on this device, "
                        "measured at start (step time per image falls by 10 %% or more as the batch doubles) "
                        "(default: auto)")
    p.add_argument("--cost-model", default=None,
                   help="step-cost JSON from `gouache profile`; needed by, and only by, the policies that plan "
                        f"with step times: {_policies_where('needs_predictor')} (default: none)")
    p.add_argument("--calibrate-steps", action=GivenBool, default=SchedulerConfig.calibrate_steps,
                   help="scale the cost model's step times online by how long this server's steps take (a "
                        "running mean of measured over predicted), so deadlines are planned with the load's "
                        "real step times; only with --cost-model (default: on)")
    p.add_argument("--round-s", type=float, default=SchedulerConfig.round_s, action=Given,
                   help="round length in seconds; only with --policy round-knapsack (default: %(default)s)")
    p.add_argument("--max-queue-len", type=int, default=EngineConfig.max_queue_len,
                   help="images waiting or running before new requests get 429 (default: %(default)s)")
    p.add_argument("--tier-queue-share", type=tier_share_arg, default=EngineConfig.tier_queue_share,
                   metavar="TIER=SHARE,...",
                   help="each tier's share of --max-queue-len: its requests get 429 once those of its tier and "
                        "the higher ones fill it (default: flex=0.5: flex is refused first)")
    p.add_argument("--tier-slo-ms", type=tier_slo_arg, default=(), action=Given, metavar="TIER=MS,...",
                   help="the deadline of each service tier's requests that send no slo_ms, e.g. "
                        "priority=2000,default=10000; only with a deadline policy (default: none)")
    p.add_argument("--paused-host-mb", type=mib_arg, default=EngineConfig.paused_host_bytes >> 20, action=Given,
                   help="MiB of host memory for the states of requests paused for a higher tier, freeing their "
                        "device memory until they resume; worth it on a GPU (0: they stay; default: %(default)s)")
    p.add_argument("--request-timeout", type=float, default=EngineConfig.request_timeout_s,
                   help="seconds before an unfinished request fails with 504 (default: %(default)s)")
    p.add_argument("--patch-size", type=int, default=EngineConfig.patch_pixels, action=Given,
                   help="the largest patch side in pixels; only with the patching policies "
                        f"({_policies_where('mixes_resolutions')}) and UNet models: each forward cuts its images "
                        "into the largest patches up to this that fit every one of them, so every size the model "
                        f"takes is served; a multiple of the model's size step (default: {DEFAULT_PATCH_PIXELS})")


def _add_cache_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--block-cache", type=float, default=BlockCacheConfig.threshold,
                   help="block-cache threshold every request runs with unless it sends its own `block_cache`: a "
                        "block's output is reused for a patch (an image, unpatched) whose input changed less than "
                        "this, relatively; approximate (docs/block_cache.md); 0 keeps images exact "
                        "(default: %(default)s)")
    p.add_argument("--block-cache-predictor", default=None, metavar="FILE",
                   help="`gouache profile --reuse` JSON of this model: its random forest decides each unit's reuse "
                        "instead of the threshold; a request's `block_cache` (or --block-cache) value v then reuses "
                        "where the forest's P(reusable) > 1 - v (default: the threshold)")
    p.add_argument("--block-cache-max-reuse", type=int, default=BlockCacheConfig.max_reuse,
                   help="most steps in a row one block's output is reused (default: %(default)s)")
    p.add_argument("--block-cache-mb", type=mib_arg, default=BlockCacheConfig.budget_bytes >> 20,
                   help="MiB of cached activations per device; past it, the newest requests run uncached "
                        "(default: %(default)s)")
    p.add_argument("--template-cache", action="store_true",
                   help="edits reuse their template's activations unless they send `template_cache: false`: the "
                        "first edit of an image records them, later ones compute their masked tokens only; "
                        "approximate outside the mask, DiT models (docs/edits.md) (default: off)")
    p.add_argument("--template-cost-model", default=None,
                   help="`gouache profile --edits` JSON: each replayed step follows InstGenIE's load plan on these "
                        "costs (which blocks load the template, which compute in full; an edit runs in full where "
                        "that is faster); with --router mask-aware the router prices steps with it too "
                        "(default: none: in full above 90 %% of the tokens, the router a linear stand-in)")
    p.add_argument("--template-dir", default=None,
                   help="directory of the template store's disk tier (default: a temporary one per server)")
    p.add_argument("--template-mb", type=mib_arg, default=TemplateConfig.host_bytes >> 20,
                   help="MiB of template activations in host memory per device (default: %(default)s)")
    p.add_argument("--template-gpu-mb", type=mib_arg, default=TemplateConfig.device_bytes >> 20,
                   help="MiB of template activations in GPU memory per device (default: %(default)s)")
    p.add_argument("--template-disk-mb", type=mib_arg, default=TemplateConfig.disk_bytes >> 20,
                   help="MiB of template activations on disk per device (default: %(default)s)")
    p.add_argument("--conditioning-mb", type=mib_arg, default=EngineConfig.conditioning_bytes >> 20,
                   help="MiB of prompts' text-encoder outputs and uploads' VAE encodings kept for requests that "
                        "repeat them; exact (0: off; default: %(default)s)")


def _add_speed_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quantize", choices=["int8", "fp8"], default=None,
                   help="quantize the denoiser's linear layers (torchao): int8 on CPU and GPU, fp8 on GPUs with "
                        "float8 units; LoRA adapters then run segmented beside them; approximate, and slower than "
                        "bf16 in eager mode (fp8 3-6x on an H200; docs/speed.md; default: off)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=CompileConfig.enabled,
                   help="run the denoiser compiled (torch.compile) where a step's techniques allow it, one graph "
                        "of dynamic rows per size up to the last of --compile-buckets; compiles at start before "
                        "/health says ok (docs/speed.md; default: off)")
    p.add_argument("--compile-sizes", type=shapes_arg, default=(),
                   help="WxH sizes (comma-separated; a video model's clips WxHxF) compiled at start at every bucket; "
                        "a size first met later runs eagerly until it is compiled (--compile-background) (default: "
                        "the model's default size)")
    p.add_argument("--compile-buckets", type=counts_arg, default=COMPILE_BUCKETS,
                   help="row counts the warm-up runs each compiled size at (one graph serves the rows between "
                        "them; under CUDA graphs forwards are padded up to them); forwards past the last run "
                        f"eagerly (default: {','.join(map(str, COMPILE_BUCKETS))})")
    p.add_argument("--compile-graphs", type=int, default=None,
                   help="graphs a compiled model warms up at most: a row graph per --compile-sizes size and "
                        "bucket, the rest to forwards of mixed sizes (an SD3 or FLUX.1 model's packed forwards in "
                        "token buckets, a UNet's patched forwards per patch side and bucket; default: "
                        f"{COMPILE_GRAPHS})")
    p.add_argument("--compile-cache", default=None, metavar="DIR",
                   help="keep compiled kernels in DIR, so a restart compiles in seconds (default: torch's own, "
                        "per user in the temporary directory)")
    p.add_argument("--compile-background", action=GivenBool, default=CompileConfig.background,
                   help="a shape first met while serving runs eagerly while a child process compiles it into the "
                        "compile cache at the lowest CPU priority, then loads from there in seconds; "
                        "--no-compile-background compiles it in its step, which waits for it (default: on)")
    p.add_argument("--compile-cuda-graphs", action="store_true",
                   help="capture the bucketed compiled forwards as CUDA graphs (GPU only; default: off)")


def _add_adapter_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora-dir", default=None,
                   help="directory of LoRA adapters (<name>.safetensors, diffusers/peft or kohya keys); requests "
                        "name them in `loras` (default: none: requests cannot ask for adapters)")
    p.add_argument("--lora-mb", type=mib_arg, default=LoraConfig.host_bytes >> 20, action=Given,
                   help="MiB of LoRA adapters kept in host memory per device (default: %(default)s)")
    p.add_argument("--lora-bound", type=int, default=LoraConfig.bound, action=Given,
                   help="bounded asynchronous LoRA loading: a request whose adapters are still being read denoises "
                        "without them for at most this many steps (`gouache profile-lora` finds the step); "
                        "approximate above 0 (default: %(default)s: synchronous, exact)")
    p.add_argument("--controlnet-dir", default=None,
                   help="directory of ControlNets (<name>/ in diffusers' format, for this UNet); requests name them "
                        "in `controlnets` with a conditioning image each (default: none)")
    p.add_argument("--controlnet-mb", type=mib_arg, default=ControlNetConfig.model_bytes >> 20, action=Given,
                   help="MiB of ControlNet weights kept loaded per process (default: %(default)s)")
    p.add_argument("--controlnet-workers", type=int, default=ControlNetConfig.workers, action=Given,
                   help="ControlNet service processes, which run ControlNets beside the base model; 0 runs them in "
                        "this process before each forward, as diffusers does (default: %(default)s)")
    p.add_argument("--controlnet-mode", default=ControlNetConfig.mode, choices=CONTROLNET_MODES, action=Given,
                   help="residuals of step t join step t (sync, exact) or step t + 1 (async: the ControlNet runs "
                        "beside the whole step; needs --controlnet-workers); requests may say (default: %(default)s)")


def _add_process_args(p: argparse.ArgumentParser) -> None:
    from gouache.sched.router import ROUTERS

    p.add_argument("--image-workers", type=int, default=EngineConfig.image_workers,
                   help="processes that decode uploads and encode images (default: %(default)s)")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="intra-op threads of torch (default: torch's); profile with the same number")
    p.add_argument("--executor", default=EngineConfig.executor, choices=EXECUTORS,
                   help="uniproc: the model runs in this process on one device; multiproc: one worker process "
                        "per device (gloo on the CPU, NCCL on GPUs), started and supervised here; ray: one Ray "
                        "actor per device, here or on a cluster (the gouache[ray] extra) (default: %(default)s)")
    p.add_argument("--ray-address", default=None,
                   help="under --executor ray: the Ray cluster to join ('auto' finds the local one) "
                        "(default: start Ray in this process)")
    p.add_argument("--ray-placement", default=EngineConfig.ray_placement, choices=RAY_PLACEMENTS, action=Given,
                   help="under --executor ray: where one replica's devices go; strict-pack: all on one node, "
                        "refused if no node has room; pack: as few nodes as have room; spread: across nodes "
                        "(default: %(default)s)")
    p.add_argument("--ray-resource", default=None, metavar="NAME",
                   help="under --executor ray with --ray-address: a custom resource each device also reserves "
                        "one unit of, so that only the nodes started with it (ray start --resources "
                        "'{\"NAME\": N}') take replicas and devices (default: any node with a CPU / GPU)")
    p.add_argument("--devices", type=int, default=EngineConfig.devices,
                   help="devices (worker processes or actors) under --executor multiproc or ray; more than one for "
                        f"{_policies_where('max_devices', None)} (default: %(default)s)")
    p.add_argument("--worker-timeout", type=float, default=EngineConfig.worker_timeout_s, action=Given,
                   help="seconds a device worker under --executor multiproc or ray may owe a reply and answer "
                        "nothing before it is taken for hung: killed, its requests failed, its device lost; "
                        "more than the 60 s collective timeout (default: %(default)s)")
    p.add_argument("--replicas", type=int, default=ReplicaConfig.replicas,
                   help="engine processes behind this API server, each with its own model and --devices; "
                        "1 runs the engine in the server's process (default: %(default)s)")
    p.add_argument("--router", default=ReplicaConfig.router, choices=sorted(ROUTERS), action=Given,
                   help="which replica gets each request; only with --replicas > 1. least-tokens and "
                        "mask-aware count the repainted pixels only of an edit that replays a template "
                        "(default: %(default)s)")


def _add_api_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-key", default=os.environ.get("GOUACHE_API_KEY"),
                   help="require `Authorization: Bearer KEY` on every route but /health and the playground "
                        "(default: $GOUACHE_API_KEY, else no key)")
    p.add_argument("--api-keys", default=None, metavar="FILE",
                   help="tenants: a JSON file of API keys, each with a name, service tiers, rate, concurrency "
                        "limit and weight (docs/tiers.md); reloaded on SIGHUP (default: none)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model ids clients may use; the first is listed first "
                        "(default: the built-in's name, or a directory's folder name)")
    p.add_argument("--shutdown-grace-s", type=float, default=ServerConfig.shutdown_grace_s,
                   help="on SIGTERM/SIGINT, seconds running requests may still finish before they are "
                        "cancelled (default: %(default)s)")
    p.add_argument("--max-size", type=int, default=ServerConfig.max_size, metavar="PX",
                   help="largest width or height a request may ask, in pixels (default: %(default)s)")
    p.add_argument("--max-steps", type=int, default=ServerConfig.max_steps,
                   help="most num_inference_steps a request may ask (default: %(default)s)")
    p.add_argument("--max-n", type=int, default=ServerConfig.max_n,
                   help="most images one request may ask, 1 to 10 (default: %(default)s)")


def run(args) -> int:
    from gouache.api.server import run_server
    from gouache.engine.build import build_engine

    _log_to_stderr()

    config = ServerConfig(host=args.host, port=args.port, api_key=args.api_key, api_keys_file=args.api_keys,
                          served_model_names=tuple(args.served_model_name or ()),
                          shutdown_grace_s=args.shutdown_grace_s,
                          max_size=args.max_size, max_steps=args.max_steps, max_n=args.max_n,
                          max_pixels=min(ServerConfig.max_pixels, args.max_size ** 2))
    if args.api_keys:  # a wrong keys file is refused before the model loads
        from gouache.api.tenants import TenantBook

        TenantBook.of(None, args.api_keys)
    configs, replicas = engine_configs(args), ReplicaConfig(args.replicas, args.router)
    if replicas.replicas > 1:
        from gouache.replicas.front import ReplicaSet

        return run_server(ReplicaSet(*configs, replicas), config)
    if "router" in given(args):
        refuse_ignored({"router": "one replica has nothing to route between; add --replicas 2 or more"})
    return run_server(build_engine(*configs), config)


def engine_configs(args) -> tuple[ModelConfig, EngineConfig, SchedulerConfig]:
    """The engine's configs from `gouache serve`'s flags. A flag the chosen policy would ignore
    is refused: the policy classes' `needs_predictor` and `mixes_resolutions` say what each reads."""
    from gouache.sched.policies import POLICIES

    policy = POLICIES[args.policy]
    if policy.needs_predictor and not args.cost_model:
        raise ValueError(f"--policy {args.policy} plans with predicted step times: give it --cost-model "
                         "(a JSON from `gouache profile`)")
    ignored = {}
    if args.cost_model and not policy.needs_predictor:
        ignored["cost_model"] = (f"--policy {args.policy} plans without step times; only "
                                 f"{_policies_where('needs_predictor')} read it")
    if "calibrate_steps" in given(args) and not policy.needs_predictor:
        ignored["calibrate_steps"] = (f"--policy {args.policy} plans without step times; only "
                                      f"{_policies_where('needs_predictor')} read them")
    if "tier_slo_ms" in given(args) and not policy.uses_deadlines:
        ignored["tier_slo_ms"] = (f"--policy {args.policy} does not plan by deadline; only "
                                  f"{_policies_where('uses_deadlines')} do")
    if "paused_host_mb" in given(args) and not policy.pauses:
        ignored["paused_host_mb"] = (f"--policy {args.policy} pauses no request; only {_policies_where('pauses')} "
                                     "do, for a higher tier")
    if "round_s" in given(args) and not policy.rounds:
        ignored["round_s"] = f"--policy {args.policy} does not plan in rounds; only {_policies_where('rounds')} does"
    if "patch_size" in given(args) and not policy.mixes_resolutions:
        ignored["patch_size"] = (f"--policy {args.policy} runs whole latents; "
                                 f"only {_policies_where('mixes_resolutions')} cut them into patches")
    if "compile_background" in given(args) and not args.compile:
        ignored["compile_background"] = "without --compile nothing compiles"
    if "ray_placement" in given(args) and args.executor != "ray":
        ignored["ray_placement"] = f"--executor {args.executor} places no Ray actors"
    if "worker_timeout" in given(args) and args.executor == "uniproc":
        ignored["worker_timeout"] = ("--executor uniproc runs the model in the server's own process: "
                                     "no worker to wait for")
    for flag in ("lora_mb", "lora_bound"):
        if flag in given(args) and not args.lora_dir:
            ignored[flag] = "without --lora-dir no request can name an adapter"
    for flag in ("controlnet_mb", "controlnet_workers", "controlnet_mode"):
        if flag in given(args) and not args.controlnet_dir:
            ignored[flag] = "without --controlnet-dir no request can name a ControlNet"
    refuse_ignored(ignored)
    return (
        ModelConfig(args.model, args.dtype, args.device, args.quantize),
        EngineConfig(max_queue_len=args.max_queue_len, tier_queue_share=args.tier_queue_share,
                     request_timeout_s=args.request_timeout, image_workers=args.image_workers,
                     patch_pixels=args.patch_size, torch_threads=args.torch_threads, executor=args.executor,
                     devices=args.devices, ray_address=args.ray_address, ray_placement=args.ray_placement,
                     ray_resource=args.ray_resource, worker_timeout_s=args.worker_timeout,
                     conditioning_bytes=args.conditioning_mb << 20, paused_host_bytes=args.paused_host_mb << 20,
                     compile=CompileConfig(args.compile, args.compile_buckets, args.compile_sizes, args.compile_cache,
                                           args.compile_cuda_graphs, args.compile_graphs, args.compile_background),
                     block_cache=BlockCacheConfig(args.block_cache, args.block_cache_max_reuse,
                                                  args.block_cache_mb << 20, args.block_cache_predictor),
                     templates=TemplateConfig(args.template_cache, args.template_dir, args.template_gpu_mb << 20,
                                              args.template_mb << 20, args.template_disk_mb << 20,
                                              cost_model=args.template_cost_model),
                     lora=LoraConfig(args.lora_dir, args.lora_mb << 20, args.lora_bound),
                     controlnet=ControlNetConfig(args.controlnet_dir, args.controlnet_workers, args.controlnet_mode,
                                                  args.controlnet_mb << 20, args.torch_threads,
                                                  reply_timeout_s=0.8 * args.worker_timeout)),
        SchedulerConfig(policy=args.policy, max_batch_size=args.max_batch_size, cost_model=args.cost_model,
                        round_s=args.round_s, tier_slo_ms=args.tier_slo_ms, calibrate_steps=args.calibrate_steps),
    )


def _log_to_stderr() -> None:
    """gouache's own INFO lines (draining, a replaced worker, ...) beside uvicorn's, in its style."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
    log = logging.getLogger("gouache")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False

