"""`gouache` command line: serve, generate, edit, models, export-model, bench."""

from __future__ import annotations

import argparse
import sys

from gouache.config import EngineConfig, ModelConfig, SchedulerConfig, ServerConfig
from gouache.errors import GouacheError


def _size(text: str) -> tuple[int, int]:
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"size must look like 512x512, got {text!r}") from None
    return width, height


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-sdxl", help="built-in model name or local diffusers directory (default: tiny-sdxl)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--device", default="cpu", help="torch device (default: cpu)")


def _add_image_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt")
    _add_model_args(p)
    p.add_argument("--size", type=_size, default=None, help="WxH in pixels (default: the model's)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's)")
    p.add_argument("--guidance", type=float, default=None, help="guidance scale (default: the model's)")
    p.add_argument("--negative-prompt", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-o", "--output", default="out.png", help="output file; the extension picks png/jpeg/webp")


def build_parser() -> argparse.ArgumentParser:
    from gouache.sched.policies import POLICIES

    parser = argparse.ArgumentParser(prog="gouache", description="A serving engine for diffusion models.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="run the OpenAI-compatible image server")
    _add_model_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--policy", default="orca", choices=sorted(POLICIES), help="scheduling policy (default: orca)")
    serve.add_argument("--max-batch-size", type=int, default=8)
    serve.add_argument("--cost-model", default=None,
                       help="step-cost JSON from `gouache profile` (for patched-slo and round-knapsack)")
    serve.add_argument("--round-s", type=float, default=0.5,
                       help="round length in seconds under --policy round-knapsack (default: 0.5)")
    serve.add_argument("--max-queue-len", type=int, default=64, help="images in flight before 429 (default: 64)")
    serve.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request fails (default: 600)")
    serve.add_argument("--patch-size", type=int, default=128,
                       help="patch side in pixels under --policy patched; sizes must be multiples of it (default: 128)")
    serve.add_argument("--image-workers", type=int, default=1, help="processes for image decode/encode (default: 1)")
    serve.add_argument("--torch-threads", type=int, default=None,
                       help="intra-op threads of torch (default: torch's); profile with the same number")

    generate = commands.add_parser("generate", help="make one image offline, without a server")
    _add_image_args(generate)

    edit = commands.add_parser("edit", help="edit an image offline: repaint where the mask is transparent")
    _add_image_args(edit)
    edit.add_argument("--image", required=True, help="the image to edit")
    edit.add_argument("--mask", default=None, help="PNG whose transparent pixels mark the region to repaint")

    commands.add_parser("models", help="list the built-in models")

    export = commands.add_parser("export-model", help="write a built-in model as a diffusers directory")
    export.add_argument("name")
    export.add_argument("directory")

    from gouache.bench import profile
    from gouache.sim import command as simulate
    from gouache.sim import reproduce

    profile.add_arguments(commands.add_parser("profile", help="measure this device and fit the step-cost model"))

    simulate.add_arguments(commands.add_parser("simulate", help="run scheduling policies on a simulated clock"))
    reproduce.add_arguments(commands.add_parser("reproduce", help="the papers' scheduling experiments, in one run"))

    bench = commands.add_parser("bench", help="benchmarks")
    bench_kinds = bench.add_subparsers(dest="bench", required=True, metavar="KIND")
    from gouache.bench import batching, overhead, serve, sim_to_real

    sim_to_real.add_arguments(bench_kinds.add_parser("sim-to-real", help="live engine vs simulator on one workload"))
    overhead.add_arguments(bench_kinds.add_parser("overhead", help="scheduling decision time vs queue length"))
    serve.add_arguments(bench_kinds.add_parser("serve", help="load-test servers under several policies"))
    batching.add_arguments(bench_kinds.add_parser("batching", help="step latency of mixed-size batches, patched vs grouped"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _COMMANDS[args.command](args)
    except (ValueError, OSError, GouacheError) as error:  # configuration mistakes: say what to fix
        print(f"gouache: error: {error}", file=sys.stderr)
        return 2


def _serve(args) -> int:
    from gouache.api.server import run_server
    from gouache.engine.client import AsyncEngine

    engine = AsyncEngine.from_config(
        ModelConfig(args.model, args.dtype, args.device),
        EngineConfig(max_queue_len=args.max_queue_len, request_timeout_s=args.request_timeout, image_workers=args.image_workers,
                     patch_size=args.patch_size, torch_threads=args.torch_threads),
        SchedulerConfig(policy=args.policy, max_batch_size=args.max_batch_size, cost_model=args.cost_model,
                        round_s=args.round_s),
    )
    run_server(engine, ServerConfig(host=args.host, port=args.port))
    return 0


def _generate(args) -> int:
    from gouache.offline import run_offline

    run_offline(args)
    return 0


def _models(args) -> int:
    from gouache.runner.models import BUILTIN_MODELS

    for name, spec in BUILTIN_MODELS.items():
        print(f"{name:20s} {spec.description}")
    return 0


def _export(args) -> int:
    from gouache.runner.models import export_model

    export_model(args.name, args.directory)
    print(f"wrote {args.name} to {args.directory}")
    return 0


def _bench(args) -> int:
    from gouache.bench import batching, overhead, serve, sim_to_real

    kinds = {"serve": serve, "batching": batching, "overhead": overhead, "sim-to-real": sim_to_real}
    return kinds[args.bench].run(args)


def _profile(args) -> int:
    from gouache.bench.profile import run

    return run(args)


def _reproduce(args) -> int:
    from gouache.sim.reproduce import run

    return run(args)


def _simulate(args) -> int:
    from gouache.sim.command import run

    return run(args)


_COMMANDS = {"reproduce": _reproduce, "profile": _profile, "simulate": _simulate, "serve": _serve, "generate": _generate, "edit": _generate, "models": _models, "export-model": _export, "bench": _bench}

if __name__ == "__main__":
    sys.exit(main())
