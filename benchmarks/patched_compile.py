"""A patched UNet forward as one compiled graph, the layout as data (issue 59, "Layout as data").

The server's eager patched forward (`gouache/runner/patch_ops.py`) regroups each resolution's
patches in Python for attention, so a static graph would be one per mix. With `as_data=True`
attention reads the layout as tensors only (each image's segment of tokens and text, attended
in `attend_segments`, which dynamo does not trace), as the halo exchange and the per-image
GroupNorm already do, so one graph can serve every mix of a patch side, its patch and image
counts dynamic (`torch._dynamo.mark_dynamic`): the way the server compiles it
(`CompiledDenoiser.patched`). This trial times, per mix of sizes (two CFG rows each):

- `patched eager`: the server's eager patched forward (attention per resolution group);
- `patched compiled`: `as_data=True` under `torch.compile`, one graph per patch side (and where
  dynamo splits the counts), the first call's compile seconds and graphs given;
- `grouped eager` / `grouped compiled`: one forward per size, compiled with dynamic rows as the
  server's plain steps are (`gouache.runner.compiled`).

Each way's largest difference from per-image forwards is checked against the exactness
tolerance. Medians of `--repeats` after a first call. Prints a table, writes JSON.

    .venv-test/bin/python benchmarks/patched_compile.py [--model shapes-unet] [--out ...]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from pathlib import Path

import torch
import torch._dynamo.utils

from gouache.models.zoo import load_pipeline
from gouache.runner.layout import PatchLayout
from gouache.runner.patch_ops import patch_unet, patched_unet_forward

TOL = 1e-4
MIXES = {  # image sides in pixels; each image takes two rows (CFG)
    "64,96,128": (64, 96, 128),
    "64,128": (64, 128),
    "96,128,128": (96, 128, 128),
    "64x3,96,128": (64, 64, 64, 96, 128),
}


def inputs(unet, sides: tuple[int, ...], text_len: int = 32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    samples = [torch.randn(unet.config.in_channels, s // 8, s // 8, generator=g) for s in sides for _ in range(2)]
    timestep = torch.linspace(900, 100, len(samples)).round()
    text = torch.randn(len(samples), text_len, unet.config.cross_attention_dim, generator=g)
    return samples, timestep, text


def layout_of(samples: list[torch.Tensor], factor: int, top: int) -> PatchLayout:
    """The server's choice (`Family.layout`): the largest side up to `top` that cuts every image."""
    common = math.gcd(*(side for x in samples for side in x.shape[-2:]))
    side = next(p for p in range(top - top % factor, 0, -factor) if common % p == 0)
    return PatchLayout.build([tuple(x.shape[-2:]) for x in samples], side)


class Ways:
    def __init__(self, unet, factor: int, top: int):
        self.unet, self.factor, self.top = unet, factor, top
        # the patched and the plain forward have graphs of their own: dynamo guards on the modules,
        # which patch_unet swaps for its halo convolutions and per-image norms
        self.body = torch.compile(self._body, dynamic=False)

    def _body(self, x, t, text):
        return self.unet(x, t, text, return_dict=False)[0]

    def patched_eager(self, samples, t, text):
        return patched_unet_forward(self.unet, layout_of(samples, self.factor, self.top), samples, t, text)

    def patched_compiled(self, samples, t, text):
        layout = layout_of(samples, self.factor, self.top)
        x = layout.split(samples)
        with patch_unet(self.unet, layout, as_data=True) as index:
            idx = index.tensors(x.device)
            per_patch = t.index_select(0, idx.caller)
            for tensor, dim in ((x, 0), (per_patch, 0), (idx.neighbours, 1), (idx.image, 0), (idx.caller, 0),
                                (idx.per_image, 0), (idx.offsets, 0), (idx.order, 0), (text, 0)):
                torch._dynamo.mark_dynamic(tensor, dim)
            return layout.merge(self.body(x, per_patch, text))

    def grouped(self, samples, t, text, compiled: bool):
        out, by_shape = [None] * len(samples), {}
        for i, x in enumerate(samples):
            by_shape.setdefault(x.shape, []).append(i)
        for rows in by_shape.values():
            x, tt, tx = torch.stack([samples[i] for i in rows]), t[rows], text[rows]
            if compiled:
                for tensor in (x, tt, tx):
                    torch._dynamo.mark_dynamic(tensor, 0)
            y = (self.body if compiled else self._body)(x, tt, tx)
            for k, i in enumerate(rows):
                out[i] = y[k]
        return out


def timed(fn, repeats: int) -> tuple[float, float, int, list[torch.Tensor]]:
    """(first call s, median ms after it, graphs the first call compiled, output)."""
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    start = time.perf_counter()
    out = fn()
    first = time.perf_counter() - start
    new = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return first, statistics.median(times) * 1000, new, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="shapes-unet")
    p.add_argument("--patch", type=int, default=256, help="largest patch side in pixels (the server's --patch-size)")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--out", default="benchmarks/results/patched_compile_cpu.json")
    args = p.parse_args()
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    unet = load_pipeline(args.model).unet.eval()
    ways = Ways(unet, 2 ** unet.num_upsamplers, args.patch // 8)
    rows = []
    with torch.no_grad():
        for name, sides in MIXES.items():
            samples, t, text = inputs(unet, sides)
            truth = [unet(x[None], t[i : i + 1], text[i : i + 1], return_dict=False)[0][0]
                     for i, x in enumerate(samples)]
            layout = layout_of(samples, ways.factor, ways.top)
            row = {"mix": name, "side": layout.patch, "patches": layout.num_patches,
                   "tokens": [layout.num_patches * (layout.patch >> level) ** 2 for level in range(1, 3)]}
            for way, fn in (("patched eager", lambda: ways.patched_eager(samples, t, text)),
                            ("patched compiled", lambda: ways.patched_compiled(samples, t, text)),
                            ("grouped eager", lambda: ways.grouped(samples, t, text, False)),
                            ("grouped compiled", lambda: ways.grouped(samples, t, text, True))):
                first, ms, graphs, out = timed(fn, args.repeats)
                diff = max((a - b).abs().max().item() for a, b in zip(out, truth))
                if diff > TOL:
                    raise AssertionError(f"{way} on {name} is {diff:.1e} off per-image forwards")
                row[way] = {"ms": ms, "first_s": first, "graphs": graphs, "max_diff": diff}
            rows.append(row)
            print(f"{name}: {json.dumps(row)}", flush=True)
    print(f"\n{args.model}, {args.repeats} repeats, medians (ms); first call s / graphs of the compiled ways\n")
    print("| mix | side | patches | patched eager | patched compiled | grouped eager | grouped compiled "
          "| patched / grouped, eager | compiled | first call s (graphs), patched compiled |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        ms = {way: r[way]["ms"] for way in ("patched eager", "patched compiled", "grouped eager", "grouped compiled")}
        eager, compiled = ms["patched eager"] / ms["grouped eager"], ms["patched compiled"] / ms["grouped compiled"]
        print(f"| {r['mix']} | {r['side']} | {r['patches']} | " + " | ".join(f"{v:.1f}" for v in ms.values())
              + f" | {eager:.2f} | {compiled:.2f} | {r['patched compiled']['first_s']:.0f}"
              f" ({r['patched compiled']['graphs']}) |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"model": args.model, "repeats": args.repeats, "rows": rows,
                                          "machine": platform.processor() or platform.machine()}, indent=2) + "\n")


if __name__ == "__main__":
    main()
