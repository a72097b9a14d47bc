"""`gouache profile`: measure the served model on this device and fit its step-cost model.

Times one patched denoising step (CFG rows included, the engine's own code path) for
compositions of the given sizes (every one of up to --max-batch images when they are few),
fits `BatchCostModel` (exact table + SVR on PatchedServe's features), times the plain forward
of 1..max-batch images of each size (what non-patching policies run, one forward per size)
and what one request costs outside its steps, then writes it all as JSON with the SVR's
held-out error. The stages are preparation (text encoding, initial latents) and
post-processing: VAE decode, plus image encoding when the device is the CPU (on a GPU the
codec processes do not use the device). `gouache serve --cost-model PATH` loads it for
SLO-aware policies; `gouache simulate --cost-model PATH` uses it as the step cost.

Each piece is timed on a thread of its own, as the engine runs it: preparation on a "prep"
thread, steps on an "engine" thread, decoding on a "post" thread, the model loaded on the
main thread. This matters on a CPU: on the 2-core CPU a tiny-sdxl step takes about 1.4x as
long on another thread as on the main one (likely torch's OpenMP runtime, which stops
spinning idle workers once more threads use it than there are cores), and a profile taken on
the main thread predicted live steps 1.2-1.5x too fast (docs/scheduling.md).
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from itertools import combinations_with_replacement
from pathlib import Path

from tqdm import tqdm

from gouache.cli_flags import Given, given, parse_shape, refuse_ignored
from gouache.config import DEFAULT_PATCH_PIXELS
from gouache.sched.interface import Resolution
from gouache.stats import median_s


def add_arguments(p) -> None:
    p.add_argument("--model", default="tiny-sdxl",
                   help="built-in model name or local diffusers directory (default: %(default)s)")
    p.add_argument("--device", default="cpu", help="torch device (default: %(default)s)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                   help="weights and activations (default: %(default)s)")
    p.add_argument("--sizes", default="256,384,512",
                   help="comma-separated sizes in pixels the server will see: S (a square), WxH, or a video "
                        "model's clips as WxHxF (F frames) (default: %(default)s)")
    p.add_argument("--patch-size", type=int, default=DEFAULT_PATCH_PIXELS, action=Given,
                   help="patch side in pixels, as `gouache serve --patch-size` will run (default: %(default)s)")
    p.add_argument("--samples", type=int, default=60, action=Given,
                   help="compositions to time (every one, if there are no more than this) (default: %(default)s)")
    p.add_argument("--max-batch", type=int, default=6, action=Given,
                   help="most images in a profiled batch (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=2, action=Given,
                   help="timed rounds over all batches, after a warm-up round; medians kept (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, action=Given,
                   help="seed of the random mixes, drawn when there are more compositions than --samples "
                        "(default: %(default)s)")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="intra-op threads of torch, as `gouache serve --torch-threads` will run (default: torch's)")
    p.add_argument("--compile", action="store_true",
                   help="time compiled steps, as `gouache serve --compile --compile-sizes` (every --sizes) runs them: "
                        "a graph per size and row bucket up to --max-batch requests' rows, a DiT's mixes in packed "
                        "pieces, on a GPU under CUDA graphs; the warm-up's compiles are not timed (default: off)")
    p.add_argument("--compile-graphs", type=int, default=None, action=Given,
                   help="with --compile: graphs warmed up at most, as `gouache serve --compile-graphs` "
                        "(default: the server's)")
    p.add_argument("--compile-backend", default="inductor", choices=("inductor", "eager"), action=Given,
                   help="with --compile: torch.compile's backend; eager traces the same graphs without generating "
                        "kernels (a smoke run; no CUDA graphs) (default: %(default)s)")
    p.add_argument("--devices", type=int, default=1,
                   help="more than 1: measure T(size, k) for k = 1, 2, 4, ... <= DEVICES and the hand-off through "
                        "that many worker processes instead (a parallel cost model for round-knapsack over "
                        "devices; --samples, --max-batch, --seed and --patch-size are refused with it) "
                        "(default: %(default)s)")
    p.add_argument("--edits", action="store_true",
                   help="fit the mask-aware cost model of template edits instead (`gouache serve "
                        "--template-cost-model`): replayed vs full steps over --ratios, cache loads (default: off)")
    p.add_argument("--ratios", default="0.1,0.2,0.4,0.6,0.8,1.0", action=Given,
                   help="mask ratios profiled with --edits (default: %(default)s)")
    p.add_argument("--reuse", action="store_true",
                   help="train the block cache's reuse predictor instead (`gouache serve --block-cache-predictor`): "
                        "exact runs of --requests captions over --sizes, a random forest on every unit and block "
                        "(docs/block_cache.md) (default: off)")
    p.add_argument("--requests", type=int, default=32, action=Given,
                   help="captions run with --reuse, each once (default: %(default)s)")
    p.add_argument("--reuse-steps", type=int, default=20, action=Given,
                   help="denoising steps of each --reuse request (default: %(default)s)")
    p.add_argument("--bound", type=float, default=0.05, action=Given,
                   help="--reuse labels a unit reusable where reusing its block's previous output changes the "
                        "output by less than this, relatively (default: %(default)s)")
    p.add_argument("--trees", type=int, default=32, action=Given, help="--reuse forest's trees (default: %(default)s)")
    p.add_argument("--depth", type=int, default=8, action=Given, help="--reuse trees' depth (default: %(default)s)")
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/costmodel_<model>.json, "
                                               "parallel_<model>.json with --devices, costmodel_mask_<model>.json "
                                               "with --edits, reuse_<model>.json with --reuse)")


def compositions(sizes: list[Resolution], n: int, max_batch: int, seed: int) -> list[dict[Resolution, int]]:
    """The batches to time. When there are at most `n` compositions of 1..max_batch images, all
    of them: the table then prices every batch the server can form from measurements, and the
    SVR never extrapolates. Otherwise every single-size batch of one (the standalone times),
    then random mixes."""
    every = [dict(Counter(picks)) for total in range(1, max_batch + 1)
             for picks in combinations_with_replacement(sizes, total)]
    if len(every) <= n:
        return every
    rng = random.Random(seed)
    out = [{size: 1} for size in sizes]
    while len(out) < n:
        total = rng.randint(1, max_batch)
        picks = [rng.choice(sizes) for _ in range(total)]
        out.append({size: picks.count(size) for size in sizes if picks.count(size)})
    return out


def run(args) -> int:
    if args.devices < 1:
        raise ValueError(f"--devices must be >= 1, got {args.devices}")
    reuse_only = ("requests", "reuse_steps", "bound", "trees", "depth")
    compile_flags = [dest for dest in ("compile_graphs", "compile_backend") if dest in given(args)]
    if args.reuse or args.edits or args.devices > 1:
        refuse_ignored({dest: "only the batch profile times compiled steps (not --reuse, --edits or --devices)"
                        for dest in ["compile"] * args.compile + compile_flags})
    elif not args.compile:
        refuse_ignored({dest: "it applies to compiled steps: add --compile" for dest in compile_flags})
    if args.reuse:
        from gouache.profile import reuse as profile_reuse

        refuse_ignored({dest: "--reuse runs whole requests; it times no batches"
                        for dest in ("samples", "max_batch", "repeats") if dest in given(args)}
                       | ({"ratios": "only --edits profiles mask ratios"} if "ratios" in given(args) else {})
                       | ({"devices": "--reuse profiles one device"} if args.devices > 1 else {})
                       | ({"edits": "--reuse and --edits are two profiles: run them apart"} if args.edits else {}))
        return profile_reuse.run(args)
    refuse_ignored({dest: "only --reuse takes it" for dest in reuse_only if dest in given(args)})
    if args.edits:
        from gouache.profile import edits as profile_edits

        refuse_ignored({dest: "--edits times template edits of one size at a time; it fits no batch model"
                        for dest in ("samples", "max_batch", "seed", "patch_size") if dest in given(args)}
                       | ({"devices": "--edits profiles one device"} if args.devices > 1 else {}))
        return profile_edits.run(args)
    if "ratios" in given(args):
        refuse_ignored({"ratios": "only --edits profiles mask ratios"})
    if args.devices > 1:
        from gouache.profile import parallel as profile_parallel

        refuse_ignored({dest: "--devices times one request per size at each degree; it fits no batch model"
                        for dest in ("samples", "max_batch", "seed", "patch_size") if dest in given(args)})

        return profile_parallel.run(args)
    import torch

    from gouache.models.zoo import load_pipeline
    from gouache.runner.describe import model_info
    from gouache.runner.model_runner import ModelRunner
    from gouache.sched.costmodel import save
    from gouache.threads import own, single, step_threads

    sizes = list(dict.fromkeys(parse_shape(s) for s in args.sizes.split(",")))
    threads = step_threads(args.torch_threads)
    single()  # as in the server, only the step thread runs torch on several threads (`gouache.threads`)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    pipe = load_pipeline(args.model, args.dtype, args.device)
    pipe.set_progress_bar_config(disable=True)
    _check_sizes(model_info(pipe, args.model), sizes)
    runner = ModelRunner(pipe, args.patch_size, compile=_compile_config(args, sizes))
    if "patch_size" in given(args) and not runner.family.patches:
        refuse_ignored({"patch_size": f"{runner.family.name} models pack mixed sizes' tokens; patches are for UNets"})
    prep, post = (ThreadPoolExecutor(1, f"gouache-{name}", initializer=single) for name in ("prep", "post"))
    engine = ThreadPoolExecutor(1, "gouache-engine", initializer=own, initargs=(threads,))
    with prep, engine, post:
        # on the thread that steps, as the server does (inductor records CUDA graphs per thread)
        engine.submit(runner.warm_up, sizes[0][0]).result()
        pool, prep_s = prep.submit(_prepare_pool, runner, sizes, args.max_batch, sync).result()
        model = engine.submit(_time_steps, runner, pool, sizes, args, sync).result()
        for res in sizes:
            model.record_stages(res, prep_s[res], post.submit(_post_s, runner, pool[res][0], args, sync).result())
    out = Path(args.out or f"benchmarks/results/costmodel_{args.model}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    save(model, out)
    report = model.report
    summary = {"command": "gouache profile " + " ".join(sys.argv[2:]), "model": args.model, "device": args.device,
               "torch_threads": threads, "compiled": runner.family.compiled is not None,
               "samples": report.n_train + report.n_test, "fit": report.to_json()}
    out.with_suffix(".report.json").write_text(json.dumps(summary, indent=2))
    print(f"test MAPE {report.test_mape:.1f} %, worst held-out error {report.test_max_rel_error:.1%}, "
          f"R² {report.test_r2:.3f}; wrote {out}")
    return 0


def _time_steps(runner, pool: dict[Resolution, list], sizes: list[Resolution], args, sync):
    """The cost model of the denoiser's steps: patched steps of the compositions (the fit), and
    plain forwards of 1..max-batch images of each size."""
    from gouache.sched.costmodel import BatchCostModel

    family = runner.family
    mixes = compositions(sizes, args.samples, args.max_batch, args.seed)
    plain = [(res, batch) for res in sizes for batch in range(1, args.max_batch + 1)]
    calls = [partial(family.predict_patched, _states(pool, mix)) for mix in mixes]
    calls += [partial(family.forward, pool[res][:batch]) for res, batch in plain]
    if family.compiled is not None:  # each call a step of its own, which may run compiled
        calls = [partial(_stepped, family.compiled, call) for call in calls]
    seconds = _median_over_rounds(calls, args.repeats, sync)
    model = BatchCostModel(sizes, patch_px=args.patch_size)
    model.fit(list(zip(mixes, seconds)))
    for (res, batch), t in zip(plain, seconds[len(mixes):]):
        model.record_grouped(res, batch, t)
    return model


def _compile_config(args, sizes: list[Resolution]):
    """--compile's configuration (None without it): every size, row buckets by powers of two up
    to --max-batch requests with CFG."""
    from gouache.config import CompileConfig

    if not args.compile:
        return None
    buckets = [2]
    while buckets[-1] < 2 * args.max_batch:
        buckets.append(2 * buckets[-1])
    return CompileConfig(enabled=True, sizes=tuple(sizes), buckets=tuple(buckets),
                         backend=args.compile_backend, graphs=args.compile_graphs,
                         cuda_graphs=args.device.startswith("cuda") and args.compile_backend == "inductor")


def _stepped(compiled, call):
    with compiled.step(None):
        return call()


def _states(pool: dict[Resolution, list], mix: dict[Resolution, int]) -> list:
    return [state for res, count in mix.items() for state in pool[res][:count]]


def _median_over_rounds(calls: list, repeats: int, sync) -> list[float]:
    """Median seconds of each call, timed once per round over `repeats` rounds after a warm-up
    round. A shared machine slows down for seconds at a time; spread over rounds, such a spell
    costs every call a little instead of a few calls a lot."""
    import torch

    times: list[list[float]] = [[] for _ in calls]
    bar = tqdm(total=len(calls) * (repeats + 1), desc="timing batches (1 warm-up round)", unit="batch")
    with torch.no_grad(), bar:
        for round_ in range(repeats + 1):
            for call, seen in zip(calls, times):
                start = time.perf_counter()
                call()
                sync()
                if round_:
                    seen.append(time.perf_counter() - start)
                bar.update()
    return [statistics.median(seen) for seen in times]


def _prepare_pool(runner, sizes: list[Resolution], max_batch: int, sync) \
        -> tuple[dict[Resolution, list], dict[Resolution, float]]:
    """max_batch prepared states per size, and the median seconds of one preparation per size
    (after a warm-up preparation that is not kept)."""
    from gouache.request import ImageRequest

    pool, prep_s = {}, {}
    for res in sizes:
        height, width, *frames = res
        times = []
        for i in range(max_batch + 1):
            request = ImageRequest(f"{'x'.join(map(str, res))}-{i}", "a red fox", width, height, 20, 5.0, seed=i,
                                   num_frames=frames[0] if frames else 1)
            start = time.perf_counter()
            runner.prepare(request)
            sync()
            times.append(time.perf_counter() - start)
            state = runner.states.pop(request.request_id)
            if i:
                pool.setdefault(res, []).append(state)
        prep_s[res] = statistics.median(times[1:])
    return pool, prep_s


def _post_s(runner, state, args, sync) -> float:
    """Seconds of one request's post-processing on the device: VAE decode, plus its encoding (an
    image's PNG, a clip's MP4) when the device is the CPU that the codec processes also run on."""
    import torch

    from gouache.engine.imaging import encode_image
    from gouache.engine.video import encode_clip

    with torch.no_grad():
        pixels = runner.family.decode(state, state.latents)
        seconds = median_s(lambda: runner.family.decode(state, state.latents), args.repeats, sync)
    if args.device == "cpu":
        clip = pixels.ndim == 4  # [F, H, W, 3]
        encode = partial(encode_clip, pixels, state.request.fps) if clip else partial(encode_image, pixels, "png")
        seconds += median_s(encode, args.repeats, sync)
    return seconds


def _check_sizes(info, sizes: list[Resolution]) -> None:
    """Refuse --sizes the model cannot make: clips on an image model, frame counts it does not take."""
    clips = [res for res in sizes if len(res) == 3]
    if clips and info.clips is None:
        raise ValueError(f"--sizes: {info.name} makes images; a size is S or WxH, not a clip's WxHxF")
    for height, width, frames in clips:
        why = info.clips.refusal(frames)
        if why:
            raise ValueError(f"--sizes: {width}x{height}x{frames}: {why}")
