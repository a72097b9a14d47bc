"""A request that arrives alone, through the engine and in the plain diffusers pipeline (issue 59:
"a request that arrives alone must finish as fast as a plain pipeline runs it").

The engine is built as `gouache serve` builds it (`build_engine`: its start thread, its step
thread and stages; docs/speed.md "One OpenMP team") and sent one request at a time, each
awaited to its image (PNG-encoded by a codec process); the pipeline is called in the main
thread on the same prompt, size, steps and guidance. Medians over repeats after a first,
dropped, call of each. Prints a table, writes JSON.

    .venv-test/bin/python benchmarks/lone_request.py [--model shapes-unet] [--size 128] [--steps 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path


async def engine_seconds(model: str, size: int, steps: int, guidance: float, repeats: int) -> list[float]:
    from gouache.config import EngineConfig, ModelConfig, SchedulerConfig
    from gouache.engine.build import build_engine
    from gouache.request import ImageRequest

    engine = build_engine(ModelConfig(model), EngineConfig(), SchedulerConfig(policy="orca"))
    await engine.start()
    times = []
    try:
        for k in range(repeats + 1):
            start = time.perf_counter()
            handle = await engine.submit([ImageRequest(f"lone{k}-0", "a red circle", size, size, steps, guidance,
                                                       seed=k)])
            await handle.images()
            times.append(time.perf_counter() - start)
    finally:
        await engine.aclose()
    return times[1:]


def pipeline_seconds(model: str, size: int, steps: int, guidance: float, repeats: int) -> list[float]:
    import torch

    from gouache.models.zoo import load_pipeline

    pipe = load_pipeline(model)
    pipe.set_progress_bar_config(disable=True)
    times = []
    for k in range(repeats + 1):
        start = time.perf_counter()
        pipe("a red circle", height=size, width=size, num_inference_steps=steps, guidance_scale=guidance,
             generator=torch.Generator().manual_seed(k))
        times.append(time.perf_counter() - start)
    return times[1:]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="shapes-unet", help="built-in or a directory (default: %(default)s)")
    p.add_argument("--size", type=int, default=128, help="square side in pixels (default: %(default)s)")
    p.add_argument("--steps", type=int, default=20, help="denoising steps (default: %(default)s)")
    p.add_argument("--guidance", type=float, default=3.0, help="guidance scale (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=7, help="timed requests of each, median (default: %(default)s)")
    p.add_argument("--out", default="benchmarks/results/lone_request_cpu.json",
                   help="JSON path (default: %(default)s); the table (.md) goes beside it")
    args = p.parse_args()
    shape = (args.model, args.size, args.steps, args.guidance, args.repeats)
    engine = asyncio.run(engine_seconds(*shape))
    pipeline = pipeline_seconds(*shape)
    medians = {"engine": statistics.median(engine), "pipeline": statistics.median(pipeline)}
    table = "\n".join([
        f"`python {' '.join(sys.argv)}`: {args.model}, {args.size} px, {args.steps} steps, one request at a time",
        "", "| path | median s | min s | max s |", "| --- | --- | --- | --- |",
        *(f"| {name} | {statistics.median(t):.3f} | {min(t):.3f} | {max(t):.3f} |"
          for name, t in (("engine", engine), ("pipeline", pipeline))),
        "", f"engine / pipeline: {medians['engine'] / medians['pipeline']:.2f}"])
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": "python " + " ".join(sys.argv), "model": args.model, "size": args.size,
                               "steps": args.steps, "engine_s": engine, "pipeline_s": pipeline,
                               "ratio": medians["engine"] / medians["pipeline"]}, indent=2))
    out.with_suffix(".md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
