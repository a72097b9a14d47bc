"""`gouache profile`: measure the served model on this device and fit its step-cost model.

Times one patched denoising step (CFG rows included, the engine's own code path) for random
compositions of the given sizes, fits `BatchCostModel` (exact table + SVR on PatchedServe's
features), times the plain forward of 1..max-batch images of each size (what non-patching
policies run, one forward per size) and what one request costs outside its steps, then
writes it all as JSON with the SVR's held-out error. The stages are preparation (text
encoding, initial latents) and post-processing: VAE decode, plus image encoding when the
device is the CPU (on a GPU the codec processes do not use the device). `gouache serve --cost-model PATH`
loads it for SLO-aware policies; `gouache simulate` can use it as the step cost.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from pathlib import Path

from tqdm import tqdm

from gouache.bench.batching import median_s


def add_arguments(p) -> None:
    p.add_argument("--model", default="tiny-sdxl")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--sizes", default="256,384,512", help="square sizes in pixels the server will see")
    p.add_argument("--patch-size", type=int, default=128)
    p.add_argument("--samples", type=int, default=60, help="random compositions to time")
    p.add_argument("--max-batch", type=int, default=6, help="most images in a profiled batch")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/costmodel_<model>.json)")


def random_compositions(sizes: list[int], n: int, max_batch: int, seed: int) -> list[dict[int, int]]:
    """Every single-size batch of one (the standalone times), then random mixes."""
    rng = random.Random(seed)
    out = [{size: 1} for size in sizes]
    while len(out) < n:
        total = rng.randint(1, max_batch)
        picks = [rng.choice(sizes) for _ in range(total)]
        out.append({size: picks.count(size) for size in sizes if picks.count(size)})
    return out


def run(args) -> int:
    import torch

    from gouache.runner.model_runner import ModelRunner
    from gouache.runner.models import load_pipeline
    from gouache.sched.costmodel import BatchCostModel, save

    sizes = [int(s) for s in args.sizes.split(",")]
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    pipe = load_pipeline(args.model, args.dtype, args.device)
    pipe.set_progress_bar_config(disable=True)
    runner = ModelRunner(pipe, args.patch_size)
    pool, prep_s = _prepare_pool(runner, sizes, args.max_batch, sync)
    samples = []
    for composition in tqdm(random_compositions(sizes, args.samples, args.max_batch, args.seed), desc="profiling"):
        states = [s for size, count in composition.items() for s in pool[size][:count]]
        with torch.no_grad():
            seconds = median_s(lambda: runner.family.predict_patched(states), args.repeats, sync)
        samples.append(({(size, size): count for size, count in composition.items()}, seconds))
    model = BatchCostModel(sizes, patch_px=args.patch_size, vae_scale=runner.family.vae_scale)
    report = model.fit(samples)
    for size in tqdm(sizes, desc="plain forwards and stages"):
        for batch in range(1, args.max_batch + 1):
            with torch.no_grad():
                seconds = median_s(lambda: runner.family.forward(pool[size][:batch]), args.repeats, sync)
            model.record_grouped(size, batch, seconds)
        model.record_stages(size, prep_s[size], _post_s(runner, pool[size][0], args, sync))
    out = Path(args.out or f"benchmarks/results/costmodel_{args.model}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    save(model, out)
    summary = {"command": "gouache profile " + " ".join(sys.argv[2:]), "model": args.model, "device": args.device,
               "samples": len(samples), "fit": report.to_json()}
    out.with_suffix(".report.json").write_text(json.dumps(summary, indent=2))
    print(f"test MAPE {report.test_mape:.1f} %, worst held-out error {report.test_max_rel_error:.1%}, "
          f"R² {report.test_r2:.3f}; wrote {out}")
    return 0


def _prepare_pool(runner, sizes: list[int], max_batch: int, sync) -> tuple[dict[int, list], dict[int, float]]:
    """max_batch prepared states per size, and the median seconds of one preparation per size
    (after a warm-up preparation that is not kept)."""
    from gouache.request import ImageRequest

    pool, prep_s = {}, {}
    for size in sizes:
        times = []
        for i in range(max_batch + 1):
            request = ImageRequest(f"{size}-{i}", "a red fox", size, size, 20, 5.0, seed=i)
            start = time.perf_counter()
            runner.prepare(request)
            sync()
            times.append(time.perf_counter() - start)
            state = runner.states.pop(request.request_id)
            if i:
                pool.setdefault(size, []).append(state)
        prep_s[size] = statistics.median(times[1:])
    return pool, prep_s


def _post_s(runner, state, args, sync) -> float:
    """Seconds of one request's post-processing on the device: VAE decode, plus PNG encoding
    when the device is the CPU that the codec processes also run on."""
    import torch

    from gouache.engine.imaging import encode_image

    with torch.no_grad():
        pixels = runner.family.decode(state, state.latents)
        seconds = median_s(lambda: runner.family.decode(state, state.latents), args.repeats, sync)
    if args.device == "cpu":
        seconds += median_s(lambda: encode_image(pixels, "png"), args.repeats, sync)
    return seconds
