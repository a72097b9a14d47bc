"""`gouache bench batching`: one denoising step of a mixed-size batch, in one forward vs grouped.

Grouped is what `orca` does (one forward per resolution); one forward is what `patched` does:
UNets over the patches of every image (method "patched"), DiTs over every image's tokens
packed into one sequence (method "packed"). Both run the engine's own step path
(family.forward / family.predict_patched) on prepared requests, CFG rows included. A UNet's
split/merge cost is timed on its own. A one-size mix runs as the model's own batch in both
modes, so for those mixes the patching (packing) machinery is also timed forced on
(`forced_ms`): both do the same arithmetic there, so `forced_vs_grouped` - 1 is the
machinery's own overhead, which `gouache reproduce --batching-costs` charges. The JSON keeps
the keys `patched_ms` / `patched_vs_grouped` for either method.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from gouache.cli_flags import Given, given, parse_shape, refuse_ignored
from gouache.model_info import shown
from gouache.sched.interface import Resolution
from gouache.stats import median_s

DEFAULT_MIXES = "SSS,SML,SSM,MML,LLL,4S,4M,4L,4S4M4L"


def add_arguments(p) -> None:
    p.add_argument("--model", default="tiny-sdxl",
                   help="a pipeline (built-in or directory), or sdxl-arch / sd3-arch / flux-arch "
                        "(bare full-size denoiser) (default: %(default)s)")
    p.add_argument("--device", default="cpu", help="torch device (default: %(default)s)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                   help="weights and activations (default: %(default)s)")
    p.add_argument("--sizes", default="256,384,512",
                   help="S,M,L: three sizes in pixels, each a square's side, WxH, or a video model's clip WxHxF "
                        "(F frames) (default: %(default)s)")
    p.add_argument("--mixes", default=DEFAULT_MIXES,
                   help="comma-separated batch compositions, e.g. SML or 4S4M4L (default: %(default)s)")
    p.add_argument("--patch-size", type=int, default=128, help="patch side in pixels (default: %(default)s)")
    p.add_argument("--steps", type=int, default=20, action=Given,
                   help="schedule length of the prepared requests; pipelines only (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=5,
                   help="timed repetitions per mix, median reported (default: %(default)s)")
    p.add_argument("--out", default="benchmarks/results/batching.json",
                   help="JSON path; the table (.md) and plot (.png) go beside it (default: %(default)s)")


def parse_mix(mix: str) -> list[str]:
    """'SML' -> [S, M, L]; '4S2L' -> [S, S, S, S, L, L]."""
    if not re.fullmatch(r"(\d*[SML])+", mix):
        raise ValueError(f"mix must be letters S/M/L with optional counts, like SML or 4S4M, got {mix!r}")
    return [letter for count, letter in re.findall(r"(\d*)([SML])", mix) for _ in range(int(count or 1))]


def run(args) -> int:
    import torch

    from gouache.models.arch import ARCH_CONFIGS

    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    shapes = [parse_shape(s) for s in args.sizes.split(",")]
    if len(shapes) != 3:
        raise ValueError(f"--sizes must be three sizes, S,M,L; got {args.sizes!r}")
    sizes = dict(zip("SML", shapes))
    if args.model in ARCH_CONFIGS:
        if "steps" in given(args):
            refuse_ignored({"steps": f"{args.model} is a bare denoiser timed on random inputs, with no schedule"})
        if any(len(res) == 3 for res in shapes):
            raise ValueError(f"--sizes: {args.model} is an image denoiser; clips (WxHxF) need a video pipeline")
    measure = _arch_rows if args.model in ARCH_CONFIGS else _pipeline_rows
    rows = measure(args, sizes, sync)
    table = format_table(rows)
    print(table)
    command = "gouache bench batching " + " ".join(sys.argv[3:])
    result = {"command": command.strip(), "model": args.model, "device": _device_name(args.device), "dtype": args.dtype,
              "sizes": {letter: shown(res) for letter, res in sizes.items()}, "patch_size": args.patch_size,
              "results": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    out.with_suffix(".md").write_text(f"`{command.strip()}` on {result['device']}\n\n{table}\n")
    plot(rows, out.with_suffix(".png"), f"{args.model} on {result['device']}")
    print(f"wrote {out}, {out.with_suffix('.md')}, {out.with_suffix('.png')}")
    return 0


def _pipeline_rows(args, sizes: dict[str, Resolution], sync) -> list[dict]:
    """The engine's own step path on prepared requests of a pipeline (CFG rows included); a video
    model's clips of every shape in one packed forward, or one forward per shape."""
    import torch

    from gouache.models.zoo import load_pipeline
    from gouache.request import ImageRequest
    from gouache.runner.model_runner import ModelRunner

    pipe = load_pipeline(args.model, args.dtype, args.device)
    pipe.set_progress_bar_config(disable=True)
    runner = ModelRunner(pipe, args.patch_size)
    family = runner.family
    rows = []
    for mix in args.mixes.split(","):
        letters = parse_mix(mix)
        states = []
        for i, letter in enumerate(letters):
            height, width, *frames = sizes[letter]
            request = ImageRequest(f"{mix}-{i}", "a red fox", width, height, args.steps, 5.0, seed=i,
                                   num_frames=frames[0] if frames else 1)
            runner.prepare(request)
            states.append(runner.states.pop(request.request_id))
        groups: dict[Resolution, list] = {}
        for letter, state in zip(letters, states):
            groups.setdefault(sizes[letter], []).append(state)
        with torch.no_grad():
            grouped = median_s(lambda: [family.forward(g) for g in groups.values()], args.repeats, sync)
            patched = median_s(lambda: family.predict_patched(states), args.repeats, sync)
            forced = None
            if len(groups) == 1:
                forced = median_s(lambda: family.predict_patched(states, whole_batches=False), args.repeats, sync)
        split_merge = None
        if family.patches:
            samples = [s.latents[0] for s in states]
            layout = family.layout(samples)
            split_merge = median_s(lambda: layout.merge(layout.split(samples)), args.repeats, sync)
        rows.append(_row(mix, len(letters), len(groups), grouped, patched, split_merge, family.patches, forced))
    return rows


def _arch_rows(args, sizes: dict[str, Resolution], sync) -> list[dict]:
    """A bare full-size denoiser with random conditioning, one image per entry of the mix (no CFG)."""
    import torch

    from gouache.bench.denoiser_inputs import DenoiserBench
    from gouache.models.arch import build_arch

    model = build_arch(args.model, args.device, args.dtype)
    rows = []
    for mix in args.mixes.split(","):
        letters = parse_mix(mix)
        bench = DenoiserBench(model, [(sizes[x][0] // 8, sizes[x][1] // 8) for x in letters])
        patches = bench.family == "unet"
        layout = bench.layout(args.patch_size // 8) if patches else None
        with torch.no_grad():
            grouped = median_s(bench.grouped, args.repeats, sync)
            patched = median_s(lambda: bench.one_forward(layout), args.repeats, sync)
            forced = None
            if len(set(letters)) == 1:
                forced = median_s(lambda: bench.one_forward(layout, whole_batches=False), args.repeats, sync)
        split_merge = (median_s(lambda: layout.merge(layout.split(bench.samples)), args.repeats, sync)
                       if patches else None)
        rows.append(_row(mix, len(letters), len(set(letters)), grouped, patched, split_merge, patches, forced))
    return rows


def _row(mix: str, images: int, resolutions: int, grouped: float, patched: float, split_merge: float | None,
         patches: bool, forced: float | None) -> dict:
    method = "patched" if patches else "packed"
    print(f"{mix}: grouped {grouped * 1e3:.1f} ms, {method} {patched * 1e3:.1f} ms", file=sys.stderr)
    return {"mix": mix, "images": images, "resolutions": resolutions, "method": method, "grouped_ms": grouped * 1e3,
            "patched_ms": patched * 1e3, "patched_vs_grouped": patched / grouped,
            "forced_ms": None if forced is None else forced * 1e3,
            "forced_vs_grouped": None if forced is None else forced / grouped,
            "split_merge_ms": None if split_merge is None else split_merge * 1e3}


def _device_name(device: str) -> str:
    import os

    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"


def format_table(rows: list[dict]) -> str:
    method = rows[0]["method"]
    lines = [f"| mix | images | resolutions | grouped ms | {method} ms | {method} / grouped "
             f"| forced {method} / grouped | split+merge ms |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        split_merge = "-" if r["split_merge_ms"] is None else f"{r['split_merge_ms']:.2f}"
        forced = "-" if r.get("forced_vs_grouped") is None else f"{r['forced_vs_grouped']:.2f}"
        lines.append(f"| {r['mix']} | {r['images']} | {r['resolutions']} | {r['grouped_ms']:.1f} | "
                     f"{r['patched_ms']:.1f} | {r['patched_vs_grouped']:.2f} | {forced} | {split_merge} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["grouped_ms"] for r in rows], 0.4, label="grouped (one forward per resolution)")
    ax.bar([i + 0.2 for i in x], [r["patched_ms"] for r in rows], 0.4, label=f"{rows[0]['method']} (one forward)")
    ax.set_xticks(list(x), [r["mix"] for r in rows])
    ax.set_ylabel("step latency (ms)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
