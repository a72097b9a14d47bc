"""KATZ's workflow mixes for `gouache bench adapters`: a request with m ControlNets and n LoRAs
(mC/nL), its latency served the sequential way of a diffusers pipeline against gouache's.

- **sequential**: what a pipeline that loads a request's adapters does (KATZ Eq. 1): its
  ControlNets read from disk and its LoRAs read and merged before the first step, the
  ControlNets run before the UNet at every step, in this process.
- **gouache sync**: the ControlNets on the ControlNet service (`--workers` processes, their
  caches warm, as the popular ones are), beside the UNet's encoder; the LoRAs not in memory,
  loaded with BAL at the profiled bound.
- **gouache async**: the same with the ControlNets' residuals a step late.

Every case starts from a server with nothing merged; the cases take turns within each repeat.
"""

from __future__ import annotations

import random
import shutil
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np

from gouache.cli_flags import Given, given, refuse_ignored
from gouache.data.prompts import Prompt
from gouache.data.shapes import sample_scene

MIXES = "0C/0L,0C/1L,1C/0L,1C/1L,2C/2L,3C/2L"
CASES = ("sequential", "gouache sync", "gouache async")


def add_arguments(p) -> None:
    p.add_argument("--mixes", default=None,
                   help=f"workflow mixes mC/nL: m ControlNets, n LoRAs; '' skips them (default: {MIXES}; none on a "
                        "model that only edits)")
    p.add_argument("--controlnet-workers", type=int, default=2, action=Given,
                   help="ControlNet service processes of the gouache cases (default: %(default)s)")


def check_flags(args) -> None:
    """--controlnet-workers only with mixes to run, and at least one."""
    if "controlnet_workers" in given(args) and args.mixes == "":
        refuse_ignored({"controlnet_workers": "with --mixes '' (the default on a model that only edits) no "
                                              "workflow mix runs a ControlNet"})
    if args.controlnet_workers < 1:
        raise ValueError(f"--controlnet-workers must be at least 1, got {args.controlnet_workers}")


def parse_mixes(text: str) -> list[tuple[int, int]]:
    mixes = []
    for part in filter(None, text.split(",")):
        try:
            c, lora = part.strip().upper().split("/")
            mixes.append((int(c.removesuffix("C")), int(lora.removesuffix("L"))))
        except ValueError:
            raise ValueError(f"--mixes takes mC/nL items such as 1C/2L, got {part!r}") from None
    if any(c > 3 or n > 2 for c, n in mixes):
        raise ValueError("--mixes: at most 3 ControlNets and 2 LoRAs")
    return mixes


def workflows(bench, args, bound: int) -> dict:
    """Median request latency of each mix and case, relative to 0C/0L served sequentially."""
    from safetensors.torch import save_file

    from gouache.config import ControlNetConfig
    from gouache.controlnet.model import Base, random_controlnet
    from gouache.controlnet.service import ControlService
    from gouache.lora.files import random_lora

    mixes = parse_mixes(args.mixes)
    directory = Path(tempfile.mkdtemp(prefix="gouache-workflows-"))
    service = None
    try:
        loras = [bench.lora, "grain"]
        shutil.copy(bench.directory / f"{bench.lora}.safetensors", directory / f"{bench.lora}.safetensors")
        save_file(random_lora(bench.pipe, rank=8, seed=7), str(directory / "grain.safetensors"))
        nets = [f"control{i}" for i in range(3)]
        for i, name in enumerate(nets):
            random_controlnet(bench.pipe, seed=i, std=0.05).save_pretrained(str(directory / name))
        service = ControlService(args.controlnet_workers, str(directory), Base.of(bench.pipe), 4 << 30, threads=1)
        configs = {"sequential": ControlNetConfig(str(directory)),
                   "gouache sync": ControlNetConfig(str(directory), args.controlnet_workers, "sync",
                                                    service=service.address),
                   "gouache async": ControlNetConfig(str(directory), args.controlnet_workers, "async",
                                                     service=service.address)}
        rng = random.Random("workflows")
        prompt = Prompt(sample_scene(rng), bench.size, bench.size, seed=0)
        image_rng = np.random.default_rng(0)
        images = [image_rng.integers(0, 256, (bench.size, bench.size, 3), dtype=np.uint8) for _ in nets]
        runs: dict[tuple, list[float]] = {}
        for k in range(args.repeats + 1):  # the first round warms the service's caches and is dropped
            for c, n in mixes:
                for case in CASES:
                    runner = bench.runner(0 if case == "sequential" else bound, directory=directory,
                                          controlnet=configs[case])
                    runner.lora_runtime.merged.set(())
                    controls = [(name, images[i], 1.0) for i, name in enumerate(nets[:c])]
                    seconds = bench.generate(runner, replace(prompt, seed=k), [(lora, 1.0) for lora in loras[:n]],
                                             controls)[1]
                    runner.controls.close()
                    if k:
                        runs.setdefault((c, n, case), []).append(seconds)
    finally:
        if service is not None:
            service.shutdown()
        shutil.rmtree(directory, ignore_errors=True)
    plain = statistics.median(runs[0, 0, "sequential"]) if (0, 0) in mixes else None
    rows = []
    for c, n in mixes:
        row = {"mix": f"{c}C/{n}L"}
        for case in CASES:
            row[case] = statistics.median(runs[c, n, case])
            if plain:
                row[f"{case} ratio"] = row[case] / plain
        rows.append(row)
    return {"controlnet_workers": args.controlnet_workers, "repeats": args.repeats, "bound": bound, "plain_s": plain,
            "rows": rows}


def report(result: dict) -> list[str]:
    lines = ["", f"Workflow mixes (KATZ), a request's latency; ControlNet service of {result['controlnet_workers']} "
                 f"processes, LoRAs not in memory (gouache: BAL at K = {result['bound']}), medians of "
                 f"{result['repeats']}; ratios to 0C/0L served sequentially ({result['plain_s']:.3f} s):", "",
             "| mix | sequential | gouache sync | gouache async |", "|---|---|---|---|"]
    for row in result["rows"]:
        cells = [f"{row[case]:.3f} s ({row[case + ' ratio']:.2f})" if result["plain_s"] else f"{row[case]:.3f} s"
                 for case in CASES]
        lines.append(f"| {row['mix']} | " + " | ".join(cells) + " |")
    return lines


def draw(ax, result: dict) -> None:
    rows = result["rows"]
    x = np.arange(len(rows))
    for i, case in enumerate(CASES):
        ax.bar(x + (i - 1) * 0.27, [row[case] for row in rows], 0.27, label=case)
    ax.set_xticks(x, [row["mix"] for row in rows])
    ax.set_ylabel("request latency (s)")
    ax.set_title("workflow mixes mC/nL")
    ax.legend(fontsize=8)
