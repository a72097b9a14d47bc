"""`gouache` command line: serve, generate, edit, models, export-model, make-lora, make-controlnet, train,
profile, profile-lora, simulate, reproduce, bench."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from gouache.cli_flags import (
    Given, GivenBool, batch_size_arg, counts_arg, given, mib_arg, refuse_ignored, size_arg, sizes_arg, tier_share_arg,
    tier_slo_arg,
)
from gouache.config import (
    COMPILE_BUCKETS, CONTROLNET_MODES, DEFAULT_PATCH_PIXELS, EXECUTORS, RAY_PLACEMENTS, BlockCacheConfig, CompileConfig,
    ControlNetConfig, EngineConfig, LoraConfig, ModelConfig, ReplicaConfig, SchedulerConfig, ServerConfig, TemplateConfig,
)
from gouache.errors import GouacheError
from gouache.heap import keep_freed_memory


def _policies_where(attribute: str, value=True) -> str:
    """The serve policies whose class sets `attribute` (`needs_predictor`, `mixes_resolutions`)
    to `value` (any true value by default)."""
    from gouache.sched.policies import POLICIES

    return ", ".join(name for name, cls in POLICIES.items()
                     if (getattr(cls, attribute) if value is True else getattr(cls, attribute) == value))


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=ModelConfig.model,
                   help="built-in model name (see `gouache models`) or local diffusers directory "
                        "(default: %(default)s)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                   help="weights and activations (default: %(default)s)")
    p.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1 (default: %(default)s)")


def _add_image_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt")
    _add_model_args(p)
    p.add_argument("--size", type=size_arg, default=None, help="WxH in pixels (default: the model's)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's)")
    p.add_argument("--guidance", type=float, default=None, help="guidance scale (default: the model's)")
    p.add_argument("--negative-prompt", default=None,
                   help="what to steer away from; needs classifier-free guidance (--guidance > 1; Z-Image: > 0; not FLUX) "
                        "(default: none)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial noise (default: %(default)s)")
    p.add_argument("-o", "--output", default="out.png",
                   help="output file; its extension picks png / jpeg / webp (default: %(default)s)")


def build_parser() -> argparse.ArgumentParser:
    from gouache.sched.policies import POLICIES
    from gouache.sched.router import ROUTERS

    parser = argparse.ArgumentParser(prog="gouache", description="A serving engine for diffusion models.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="run the OpenAI-compatible image server")
    _add_model_args(serve)
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on; 0.0.0.0 for every interface (default: %(default)s)")
    serve.add_argument("--port", type=int, default=8000, help="TCP port (default: %(default)s)")
    serve.add_argument("--policy", default="orca", choices=sorted(POLICIES),
                       help="scheduling policy (default: %(default)s)")
    serve.add_argument("--max-batch-size", type=batch_size_arg, default=None, metavar="N|auto",
                       help="most images denoised together in one step; auto: as many as pay on this device, "
                            "measured at start (step time per image falls by 10 %% or more as the batch doubles) "
                            "(default: auto)")
    serve.add_argument("--cost-model", default=None,
                       help="step-cost JSON from `gouache profile`; needed by, and only by, the policies that plan "
                            f"with step times: {_policies_where('needs_predictor')} (default: none)")
    serve.add_argument("--calibrate-steps", action=GivenBool, default=SchedulerConfig.calibrate_steps,
                       help="scale the cost model's step times online by how long this server's steps take (a "
                            "running mean of measured over predicted), so deadlines are planned with the load's "
                            "real step times; only with --cost-model (default: on)")
    serve.add_argument("--round-s", type=float, default=SchedulerConfig.round_s, action=Given,
                       help="round length in seconds; only with --policy round-knapsack (default: %(default)s)")
    serve.add_argument("--max-queue-len", type=int, default=EngineConfig.max_queue_len,
                       help="images waiting or running before new requests get 429 (default: %(default)s)")
    serve.add_argument("--tier-queue-share", type=tier_share_arg, default=EngineConfig.tier_queue_share,
                       metavar="TIER=SHARE,...",
                       help="each tier's share of --max-queue-len: its requests get 429 once those of its tier and "
                            "the higher ones fill it (default: flex=0.5: flex is refused first)")
    serve.add_argument("--tier-slo-ms", type=tier_slo_arg, default=(), action=Given, metavar="TIER=MS,...",
                       help="the deadline of each service tier's requests that send no slo_ms, e.g. "
                            "priority=2000,default=10000; only with a deadline policy (default: none)")
    serve.add_argument("--paused-host-mb", type=mib_arg, default=EngineConfig.paused_host_bytes >> 20, action=Given,
                       help="MiB of host memory for the states of requests paused for a higher tier, freeing their "
                            "device memory until they resume; worth it on a GPU (0: they stay; default: %(default)s)")
    serve.add_argument("--request-timeout", type=float, default=EngineConfig.request_timeout_s,
                       help="seconds before an unfinished request fails with 504 (default: %(default)s)")
    serve.add_argument("--patch-size", type=int, default=EngineConfig.patch_size, action=Given,
                       help="the largest patch side in pixels; only with the patching policies "
                            f"({_policies_where('mixes_resolutions')}) and UNet models: each forward cuts its images "
                            "into the largest patches up to this that fit every one of them, so every size the model "
                            f"takes is served; a multiple of the model's size step (default: {DEFAULT_PATCH_PIXELS})")
    serve.add_argument("--block-cache", type=float, default=BlockCacheConfig.threshold,
                       help="block-cache threshold every request runs with unless it sends its own `block_cache`: a "
                            "block's output is reused for a patch (an image, unpatched) whose input changed less than "
                            "this, relatively; approximate (docs/block_cache.md); 0 keeps images exact (default: %(default)s)")
    serve.add_argument("--block-cache-predictor", default=None, metavar="FILE",
                       help="`gouache profile --reuse` JSON of this model: its random forest decides each unit's reuse "
                            "instead of the threshold; a request's `block_cache` (or --block-cache) value v then reuses "
                            "where the forest's P(reusable) > 1 - v (default: the threshold)")
    serve.add_argument("--block-cache-max-reuse", type=int, default=BlockCacheConfig.max_reuse,
                       help="most steps in a row one block's output is reused (default: %(default)s)")
    serve.add_argument("--block-cache-mb", type=mib_arg, default=BlockCacheConfig.budget_bytes >> 20,
                       help="MiB of cached activations per device; past it, the newest requests run uncached "
                            "(default: %(default)s)")
    serve.add_argument("--template-cache", action="store_true",
                       help="edits reuse their template's activations unless they send `template_cache: false`: the "
                            "first edit of an image records them, later ones compute their masked tokens only; "
                            "approximate outside the mask, DiT models (docs/edits.md) (default: off)")
    serve.add_argument("--template-cost-model", default=None,
                       help="`gouache profile --edits` JSON: each replayed step follows InstGenIE's load plan on these "
                            "costs (which blocks load the template, which compute in full; an edit runs in full where "
                            "that is faster); with --router mask-aware the router prices steps with it too "
                            "(default: none: in full above 90 %% of the tokens, the router a linear stand-in)")
    serve.add_argument("--template-dir", default=None,
                       help="directory of the template store's disk tier (default: a temporary one per server)")
    serve.add_argument("--template-mb", type=mib_arg, default=TemplateConfig.host_bytes >> 20,
                       help="MiB of template activations in host memory per device (default: %(default)s)")
    serve.add_argument("--template-gpu-mb", type=mib_arg, default=TemplateConfig.device_bytes >> 20,
                       help="MiB of template activations in GPU memory per device (default: %(default)s)")
    serve.add_argument("--template-disk-mb", type=mib_arg, default=TemplateConfig.disk_bytes >> 20,
                       help="MiB of template activations on disk per device (default: %(default)s)")
    serve.add_argument("--conditioning-mb", type=mib_arg, default=EngineConfig.conditioning_bytes >> 20,
                       help="MiB of prompts' text-encoder outputs and uploads' VAE encodings kept for requests that "
                            "repeat them; exact (0: off; default: %(default)s)")
    serve.add_argument("--quantize", choices=["int8", "fp8"], default=None,
                       help="quantize the denoiser's linear layers (torchao): int8 on CPU and GPU, fp8 on GPUs with "
                            "float8 units; LoRA adapters then run segmented beside them; approximate, and slower than "
                            "bf16 in eager mode (fp8 3-6x on an H200; docs/speed.md; default: off)")
    serve.add_argument("--compile", action=argparse.BooleanOptionalAction, default=CompileConfig.enabled,
                       help="run the denoiser compiled (torch.compile) where a step's techniques allow it, padded to "
                            "--compile-buckets rows; compiles at start before /health says ok (docs/speed.md; "
                            "default: off)")
    serve.add_argument("--compile-sizes", type=sizes_arg, default=(),
                       help="WxH sizes (comma-separated) compiled at start at every bucket; a size first met later "
                            "compiles in its step (default: the model's default size)")
    serve.add_argument("--compile-buckets", type=counts_arg, default=COMPILE_BUCKETS,
                       help="row counts a compiled forward is padded up to; larger forwards run eagerly (default: "
                            f"{','.join(map(str, COMPILE_BUCKETS))})")
    serve.add_argument("--compile-cache", default=None, metavar="DIR",
                       help="keep compiled kernels in DIR, so a restart compiles in seconds (default: torch's own, "
                            "per user in the temporary directory)")
    serve.add_argument("--compile-cuda-graphs", action="store_true",
                       help="capture the bucketed compiled forwards as CUDA graphs (GPU only; default: off)")
    serve.add_argument("--lora-dir", default=None,
                       help="directory of LoRA adapters (<name>.safetensors, diffusers/peft or kohya keys); requests "
                            "name them in `loras` (default: none: requests cannot ask for adapters)")
    serve.add_argument("--lora-mb", type=mib_arg, default=LoraConfig.host_bytes >> 20, action=Given,
                       help="MiB of LoRA adapters kept in host memory per device (default: %(default)s)")
    serve.add_argument("--lora-bound", type=int, default=LoraConfig.bound, action=Given,
                       help="bounded asynchronous LoRA loading: a request whose adapters are still being read denoises "
                            "without them for at most this many steps (`gouache profile-lora` finds the step); "
                            "approximate above 0 (default: %(default)s: synchronous, exact)")
    serve.add_argument("--controlnet-dir", default=None,
                       help="directory of ControlNets (<name>/ in diffusers' format, for this UNet); requests name them "
                            "in `controlnets` with a conditioning image each (default: none)")
    serve.add_argument("--controlnet-mb", type=mib_arg, default=ControlNetConfig.model_bytes >> 20, action=Given,
                       help="MiB of ControlNet weights kept loaded per process (default: %(default)s)")
    serve.add_argument("--controlnet-workers", type=int, default=ControlNetConfig.workers, action=Given,
                       help="ControlNet service processes, which run ControlNets beside the base model; 0 runs them in "
                            "this process before each forward, as diffusers does (default: %(default)s)")
    serve.add_argument("--controlnet-mode", default=ControlNetConfig.mode, choices=CONTROLNET_MODES, action=Given,
                       help="residuals of step t join step t (sync, exact) or step t + 1 (async: the ControlNet runs "
                            "beside the whole step; needs --controlnet-workers); requests may say (default: %(default)s)")
    serve.add_argument("--image-workers", type=int, default=EngineConfig.image_workers,
                       help="processes that decode uploads and encode images (default: %(default)s)")
    serve.add_argument("--torch-threads", type=int, default=None,
                       help="intra-op threads of torch (default: torch's); profile with the same number")
    serve.add_argument("--executor", default=EngineConfig.executor, choices=EXECUTORS,
                       help="uniproc: the model runs in this process on one device; multiproc: one worker process "
                            "per device (gloo on the CPU, NCCL on GPUs), started and supervised here; ray: one Ray "
                            "actor per device, here or on a cluster (the gouache[ray] extra) (default: %(default)s)")
    serve.add_argument("--ray-address", default=None,
                       help="under --executor ray: the Ray cluster to join ('auto' finds the local one) "
                            "(default: start Ray in this process)")
    serve.add_argument("--ray-placement", default=EngineConfig.ray_placement, choices=RAY_PLACEMENTS, action=Given,
                       help="under --executor ray: where one replica's devices go; strict-pack: all on one node, "
                            "refused if no node has room; pack: as few nodes as have room; spread: across nodes "
                            "(default: %(default)s)")
    serve.add_argument("--ray-resource", default=None, metavar="NAME",
                       help="under --executor ray with --ray-address: a custom resource each device also reserves "
                            "one unit of, so that only the nodes started with it (ray start --resources "
                            "'{\"NAME\": N}') take replicas and devices (default: any node with a CPU / GPU)")
    serve.add_argument("--devices", type=int, default=EngineConfig.devices,
                       help="devices (worker processes or actors) under --executor multiproc or ray; more than one for "
                            f"{_policies_where('max_devices', None)} (default: %(default)s)")
    serve.add_argument("--worker-timeout", type=float, default=EngineConfig.worker_timeout_s, action=Given,
                       help="seconds a device worker under --executor multiproc or ray may owe a reply and answer "
                            "nothing before it is taken for hung: killed, its requests failed, its device lost; "
                            "more than the 60 s collective timeout (default: %(default)s)")
    serve.add_argument("--replicas", type=int, default=ReplicaConfig.replicas,
                       help="engine processes behind this API server, each with its own model and --devices; "
                            "1 runs the engine in the server's process (default: %(default)s)")
    serve.add_argument("--router", default=ReplicaConfig.router, choices=sorted(ROUTERS), action=Given,
                       help="which replica gets each request; only with --replicas > 1. least-tokens and "
                            "mask-aware count the repainted pixels only of an edit that replays a template "
                            "(default: %(default)s)")
    serve.add_argument("--api-key", default=os.environ.get("GOUACHE_API_KEY"),
                       help="require `Authorization: Bearer KEY` on every route but /health and the playground "
                            "(default: $GOUACHE_API_KEY, else no key)")
    serve.add_argument("--api-keys", default=None, metavar="FILE",
                       help="tenants: a JSON file of API keys, each with a name, service tiers, rate, concurrency "
                            "limit and weight (docs/tiers.md); reloaded on SIGHUP (default: none)")
    serve.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="model ids clients may use; the first is listed first "
                            "(default: the built-in's name, or a directory's folder name)")
    serve.add_argument("--shutdown-grace-s", type=float, default=ServerConfig.shutdown_grace_s,
                       help="on SIGTERM/SIGINT, seconds running requests may still finish before they are "
                            "cancelled (default: %(default)s)")
    serve.add_argument("--max-size", type=int, default=ServerConfig.max_size, metavar="PX",
                       help="largest width or height a request may ask, in pixels (default: %(default)s)")
    serve.add_argument("--max-steps", type=int, default=ServerConfig.max_steps,
                       help="most num_inference_steps a request may ask (default: %(default)s)")
    serve.add_argument("--max-n", type=int, default=ServerConfig.max_n,
                       help="most images one request may ask, 1 to 10 (default: %(default)s)")

    generate = commands.add_parser("generate", help="make one image offline, without a server")
    _add_image_args(generate)

    edit = commands.add_parser("edit", help="edit an image offline: repaint where the mask is transparent")
    _add_image_args(edit)
    edit.add_argument("--image", required=True, help="the image to edit (PNG, JPEG or WebP)")
    edit.add_argument("--mask", default=None,
                      help="PNG of the image's size whose fully transparent pixels are repainted "
                           "(default: the image's own transparent pixels, else the whole image)")

    commands.add_parser("models", help="list the built-in models and the full-size benchmark architectures")

    export = commands.add_parser("export-model", help="write a built-in model as a diffusers directory")
    export.add_argument("name")
    export.add_argument("directory")

    make_lora = commands.add_parser("make-lora", help="write a random LoRA of a model's denoiser (for tests and benchmarks)")
    _add_model_args(make_lora)
    make_lora.add_argument("--out", required=True, help="the .safetensors file to write")
    make_lora.add_argument("--rank", type=int, default=4, help="rank of each layer's update (default: %(default)s)")
    make_lora.add_argument("--seed", type=int, default=0, help="seed of its random weights (default: %(default)s)")

    make_controlnet = commands.add_parser(
        "make-controlnet", help="write a random ControlNet of a UNet model, a diffusers directory (for tests and benchmarks)")
    _add_model_args(make_controlnet)
    make_controlnet.add_argument("--out", required=True, help="the directory to write (a name in --controlnet-dir)")
    make_controlnet.add_argument("--seed", type=int, default=0, help="seed of its random weights (default: %(default)s)")

    from gouache.profile import lora as profile_lora, step as profile
    from gouache.sim import command as simulate
    from gouache.sim import reproduce
    from gouache.train import command as train

    train.add_arguments(commands.add_parser("train", help="train a shapes model (vae, unet, dit) from a seed"))

    profile.add_arguments(commands.add_parser("profile", help="measure this device and fit the step-cost model"))
    profile_lora.add_arguments(commands.add_parser(
        "profile-lora", help="the step by which an adapter must join (KATZ's bound for asynchronous LoRA loading)"))

    simulate.add_arguments(commands.add_parser("simulate", help="run scheduling policies on a simulated clock"))
    reproduce.add_arguments(commands.add_parser("reproduce", help="the papers' scheduling experiments, in one run"))

    bench = commands.add_parser("bench", help="benchmarks")
    bench_kinds = bench.add_subparsers(dest="bench", required=True, metavar="KIND")
    from gouache.bench import (
        adapters, baselines, batching, edit, fidelity, fullsize, fuzz, overhead, parallel, reuse_compare, serve,
        sim_to_real, soak, speed, tiers,
    )

    fuzz.add_arguments(bench_kinds.add_parser(
        "fuzz", help="requests generated from the server's OpenAPI schema on every endpoint: 2xx or 4xx only"))
    adapters.add_arguments(bench_kinds.add_parser(
        "adapters", help="LoRA serving: loading bound, latency with uncached adapters (BAL), fidelity, mixed-adapter "
                         "throughput vs per-adapter batches"))
    parallel.add_arguments(bench_kinds.add_parser("parallel", help="worker processes on this machine: executor "
                                                                  "overhead, collectives per step, hand-offs"))
    sim_to_real.add_arguments(bench_kinds.add_parser("sim-to-real", help="live engine vs simulator on one workload"))
    tiers.add_arguments(bench_kinds.add_parser("tiers", help="service tiers, preemption and tenants under overload, "
                                                             "live and simulated"))
    overhead.add_arguments(bench_kinds.add_parser("overhead", help="scheduling decision time vs queue length"))
    serve.add_arguments(bench_kinds.add_parser("serve", help="load-test servers under several policies"))
    soak.add_arguments(bench_kinds.add_parser(
        "soak", help="overload each policy for minutes: lost requests, latency, memory, fds, leaked processes"))
    baselines.add_arguments(bench_kinds.add_parser("baselines", help="gouache vs a plain diffusers server, serial "
                                                   "and with static batching, under one load"))
    speed.add_arguments(bench_kinds.add_parser("speed", help="eager vs compiled (vs int8) steps, and the seeds' "
                                               "savings under compile"))
    fullsize.add_arguments(bench_kinds.add_parser(
        "fullsize", help="the seeds' savings on the full-size architectures in bf16, against the matmul peak (MFU)"))
    batching.add_arguments(bench_kinds.add_parser("batching", help="step latency of mixed-size batches, patched vs grouped"))
    fidelity.add_arguments(bench_kinds.add_parser(
        "fidelity", help="a candidate configuration's images vs the exact ones: SSIM, PSNR, prompt alignment"))
    edit.add_arguments(bench_kinds.add_parser(
        "edit", help="mask-aware template edits: latency vs mask ratio, fidelity, throughput vs fcfs-static"))
    reuse_compare.add_arguments(bench_kinds.add_parser(
        "reuse-compare", help="the block cache's reuse predictor vs the threshold at equal SSIM, from fidelity runs"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        keep_freed_memory()
        return _COMMANDS[args.command](args)
    except (ValueError, OSError, GouacheError) as error:  # configuration mistakes: say what to fix
        print(f"gouache: error: {error}", file=sys.stderr)
        return 2


def _serve(args) -> int:
    from gouache.api.server import run_server
    from gouache.engine.build import build_engine

    _log_to_stderr()

    config = ServerConfig(host=args.host, port=args.port, api_key=args.api_key, api_keys_file=args.api_keys,
                          served_model_names=tuple(args.served_model_name or ()), shutdown_grace_s=args.shutdown_grace_s,
                          max_size=args.max_size, max_steps=args.max_steps, max_n=args.max_n,
                          max_pixels=min(ServerConfig.max_pixels, args.max_size ** 2))
    if args.api_keys:  # a wrong keys file is refused before the model loads
        from gouache.api.tenants import TenantBook

        TenantBook.of(None, args.api_keys)
    configs, replicas = _engine_configs(args), ReplicaConfig(args.replicas, args.router)
    if replicas.replicas > 1:
        from gouache.replicas.front import ReplicaSet

        return run_server(ReplicaSet(*configs, replicas), config)
    if "router" in given(args):
        refuse_ignored({"router": "one replica has nothing to route between; add --replicas 2 or more"})
    return run_server(build_engine(*configs), config)


def _engine_configs(args) -> tuple[ModelConfig, EngineConfig, SchedulerConfig]:
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
        ignored["patch_size"] = (f"--policy {args.policy} runs whole latents; only {_policies_where('mixes_resolutions')} "
                                 "cut them into patches")
    if "ray_placement" in given(args) and args.executor != "ray":
        ignored["ray_placement"] = f"--executor {args.executor} places no Ray actors"
    if "worker_timeout" in given(args) and args.executor == "uniproc":
        ignored["worker_timeout"] = "--executor uniproc runs the model in the server's own process: no worker to wait for"
    for flag in ("lora_mb", "lora_bound"):
        if flag in given(args) and not args.lora_dir:
            ignored[flag] = "without --lora-dir no request can name an adapter"
    for flag in ("controlnet_mb", "controlnet_workers", "controlnet_mode"):
        if flag in given(args) and not args.controlnet_dir:
            ignored[flag] = "without --controlnet-dir no request can name a ControlNet"
    refuse_ignored(ignored)
    return (
        ModelConfig(args.model, args.dtype, args.device, args.quantize),
        EngineConfig(max_queue_len=args.max_queue_len, tier_queue_share=args.tier_queue_share, request_timeout_s=args.request_timeout, image_workers=args.image_workers,
                     patch_size=args.patch_size, torch_threads=args.torch_threads, executor=args.executor,
                     devices=args.devices, ray_address=args.ray_address, ray_placement=args.ray_placement,
                     ray_resource=args.ray_resource, worker_timeout_s=args.worker_timeout,
                     conditioning_bytes=args.conditioning_mb << 20, paused_host_bytes=args.paused_host_mb << 20,
                     compile=CompileConfig(args.compile, args.compile_buckets, args.compile_sizes, args.compile_cache,
                                           args.compile_cuda_graphs),
                     block_cache=BlockCacheConfig(args.block_cache, args.block_cache_max_reuse, args.block_cache_mb << 20,
                                                  args.block_cache_predictor),
                     templates=TemplateConfig(args.template_cache, args.template_dir, args.template_gpu_mb << 20,
                                              args.template_mb << 20, args.template_disk_mb << 20,
                                              cost_model=args.template_cost_model),
                     loras=LoraConfig(args.lora_dir, args.lora_mb << 20, args.lora_bound),
                     controlnets=ControlNetConfig(args.controlnet_dir, args.controlnet_workers, args.controlnet_mode,
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


def _generate(args) -> int:
    from gouache.offline import run_offline

    run_offline(args)
    return 0


def _models(args) -> int:
    from gouache.models.arch import ARCH_CONFIGS, arch_description
    from gouache.models.zoo import BUILTIN_MODELS

    for name, spec in BUILTIN_MODELS.items():
        print(f"{name:20s} {spec.description}")
    for name in ARCH_CONFIGS:
        print(f"{name:20s} {arch_description(name)}")
    return 0


def _export(args) -> int:
    from gouache.models.zoo import export_model

    export_model(args.name, args.directory)
    print(f"wrote {args.name} to {args.directory}")
    return 0


def _make_lora(args) -> int:
    from safetensors.torch import save

    from gouache.files import write_atomic
    from gouache.lora.files import random_lora
    from gouache.models.zoo import load_pipeline

    if args.rank < 1:
        raise ValueError(f"--rank must be >= 1, got {args.rank}")
    if not args.out.endswith(".safetensors"):
        raise ValueError(f"--out must name a .safetensors file, got {args.out!r}")
    weights = random_lora(load_pipeline(args.model, args.dtype, args.device), args.rank, args.seed)
    write_atomic(args.out, save(weights))
    print(f"wrote {args.out}: {len(weights) // 2} layers of rank {args.rank} for {args.model}")
    return 0


def _make_controlnet(args) -> int:
    from gouache.controlnet.model import random_controlnet, supports_controlnets
    from gouache.models.zoo import load_pipeline

    pipe = load_pipeline(args.model, args.dtype, args.device)
    why = supports_controlnets(pipe)
    if why:
        raise ValueError(f"{args.model}: {why}")
    random_controlnet(pipe, args.seed).save_pretrained(args.out)
    print(f"wrote {args.out}: a random ControlNet of {args.model}'s UNet")
    return 0


def _bench(args) -> int:
    from gouache.bench import (
        adapters, baselines, batching, edit, fidelity, fullsize, fuzz, overhead, parallel, reuse_compare, serve,
        sim_to_real, soak, speed, tiers,
    )

    kinds = {"fuzz": fuzz, "adapters": adapters, "serve": serve, "batching": batching, "overhead": overhead, "sim-to-real": sim_to_real, "soak": soak,
             "fidelity": fidelity, "parallel": parallel, "edit": edit, "speed": speed, "baselines": baselines,
             "fullsize": fullsize, "reuse-compare": reuse_compare, "tiers": tiers}
    return kinds[args.bench].run(args)


def _train(args) -> int:
    from gouache.train.command import run

    return run(args)


def _profile(args) -> int:
    from gouache.profile.step import run

    return run(args)


def _profile_lora(args) -> int:
    from gouache.profile.lora import run

    return run(args)


def _reproduce(args) -> int:
    from gouache.sim.reproduce import run

    return run(args)


def _simulate(args) -> int:
    from gouache.sim.command import run

    return run(args)


_COMMANDS = {"reproduce": _reproduce, "profile": _profile, "profile-lora": _profile_lora, "simulate": _simulate, "serve": _serve, "generate": _generate, "edit": _generate, "models": _models, "export-model": _export, "make-lora": _make_lora, "make-controlnet": _make_controlnet, "train": _train, "bench": _bench}

if __name__ == "__main__":
    sys.exit(main())
