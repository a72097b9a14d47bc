"""`gouache bench speed`: the speed layer, per model, eager against compiled (and compiled int8
where asked), and the seeds' savings measured again under it.

Each model runs in a process of its own (compile settings are process-wide). Every variant
has its own in-process runner over the same weights (int8: a copy quantized), all prepared
with the same requests, and the variants' steps are interleaved repetition by repetition, so
a noisy neighbour slows all of them alike; medians of `runner.execute` wall times (the
forward, the sampler step, the composer), after a step of each untimed (and any compile it
needs). Rows of the table:

- `step b=N`: one step of N requests of the largest size (CFG rows included);
- `patched / grouped`: mixed sizes (S, M, L: a half, three quarters and all of --size) in one
  patched or packed forward against one forward per size, summed;
- `merged LoRA / none`, `segmented LoRA / none`: two requests with one shared adapter
  (merged into the weights), with two adapters (each on its own rows), against no adapters;
- `segmented LoRA / none, patched`: the mixed sizes with two adapters among them (a UNet's
  patched forward runs one per set; a DiT's packed one takes them per token) against the same
  patched or packed forward without;
- `instruction edit / generation` (FLUX.1 Kontext, FLUX.2, Qwen-Image-Edit): two edits whose
  upload is a reference (its tokens after the image's) against two generations;
- `ControlNet / none` (UNets): two requests with one ControlNet each (in process, sync),
  against the same without;
- `block cache / exact`: two requests asking for block reuse at 0.1 (per image), steady
  state, against the same without;
- `template edit / full edit` (at --template-size): an edit repainting a centred fifth of the
  image (`--mask`) replaying a template registered from the same picture, against the same
  edit in full (on runners of their own, compiled at that size: a DiT's replays run in
  compiled pieces).

Under compile, a step whose techniques the graph does not hold runs eagerly (docs/speed.md):
the table says which ran how (`paths`). Prints a table, writes JSON and markdown.

    gouache bench speed [--models shapes-unet,shapes-dit,tiny-sdxl,tiny-flux] [--variants eager,compiled]
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from gouache.uploads import EditMask, Upload

VARIANTS = ("eager", "compiled", "compiled+int8")
DEFAULT_MODELS = "shapes-unet,shapes-dit,tiny-sdxl,tiny-flux"
EDIT_GRAPHS = 8  # the template rows' runner: its row graph, then computed-token buckets of a DiT's replays


def add_arguments(p) -> None:
    p.add_argument("--models", default=DEFAULT_MODELS, help="comma-separated models (default: %(default)s)")
    p.add_argument("--variants", default="eager,compiled",
                   help=f"comma-separated, of {', '.join(VARIANTS)} (default: %(default)s)")
    p.add_argument("--size", type=int, default=128, help="the largest size L in pixels, square (default: %(default)s)")
    p.add_argument("--template-size", type=int, default=256,
                   help="side in pixels of the template rows' edits (default: %(default)s)")
    p.add_argument("--mask", type=float, default=0.2, help="mask ratio of the template rows (default: %(default)s)")
    p.add_argument("--batches", default="1,8", help="request counts of the step rows (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=7,
                   help="timed steps per row and variant, median (default: %(default)s)")
    p.add_argument("--torch-threads", type=int, default=2, help="intra-op threads (default: %(default)s)")
    p.add_argument("--compile-graphs", type=int, default=None,
                   help="graphs a compiled variant warms up at most: a row graph per size and bucket, the rest "
                        "token buckets of packed DiT forwards (default: 16; the template rows' runner: "
                        f"{EDIT_GRAPHS})")
    p.add_argument("--compile-cache", default=None, metavar="DIR",
                   help="compiled kernels kept here, so a rerun compiles in seconds (default: torch's own)")
    p.add_argument("--out", default="benchmarks/results/speed_cpu.json",
                   help="JSON path; the table (.md) goes beside it (default: %(default)s)")
    p.add_argument("--one", default=None, help="(internal) measure this model in this process, print JSON")


def run(args) -> int:
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown or "eager" not in variants:
        raise ValueError(f"--variants takes eager (always, the baseline) and any of {', '.join(VARIANTS[1:])}; "
                         f"got {args.variants!r}")
    if args.compile_graphs is not None and variants == ["eager"]:
        raise ValueError("--compile-graphs bounds compiled variants' graphs: add compiled to --variants")
    if not 0 < args.mask <= 1:
        raise ValueError(f"--mask is the share of the image an edit repaints, in (0, 1]; got {args.mask}")
    if args.one:
        print(json.dumps(measure(args.one, args)))
        return 0
    results = {}
    for model in args.models.split(","):
        command = [sys.executable, "-m", "gouache.cli", "bench", "speed", "--one", model, "--variants", args.variants,
                   "--size", str(args.size), "--template-size", str(args.template_size), "--mask", str(args.mask),
                   "--batches", args.batches, "--repeats", str(args.repeats),
                   "--torch-threads", str(args.torch_threads)]
        if args.compile_graphs is not None:
            command += ["--compile-graphs", str(args.compile_graphs)]
        if args.compile_cache:
            command += ["--compile-cache", args.compile_cache]
        child = subprocess.run(command, capture_output=True, text=True)
        if child.returncode:
            raise RuntimeError(f"measuring {model} failed:\n{child.stderr[-4000:]}")
        results[model] = json.loads(child.stdout.strip().splitlines()[-1])
        print(f"{model}: done", file=sys.stderr)
    table = format_table(results, variants)
    print(table)
    command = "gouache bench speed " + " ".join(sys.argv[3:])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": command.strip(), "size": args.size, "template_size": args.template_size,
                               "mask": args.mask, "repeats": args.repeats,
                               "torch_threads": args.torch_threads, "variants": variants, "results": results},
                              indent=2) + "\n")
    out.with_suffix(".md").write_text(f"`{command.strip()}`\n\n{table}\n")
    print(f"wrote {out}, {out.with_suffix('.md')}")
    return 0


def measure(model: str, args) -> dict:
    """Every row of one model under every variant (see the module's docstring)."""
    import torch
    from safetensors.torch import save_file

    from gouache.bench.edit_cases import picture
    from gouache.bench.interleaved import STEPS, Interleaved, request
    from gouache.config import CompileConfig, ControlNetConfig, LoraConfig, TemplateConfig
    from gouache.controlnet.model import random_controlnet, supports_controlnets
    from gouache.data.shapes import sample_scene
    from gouache.lora.files import random_lora
    from gouache.models.zoo import load_pipeline
    from gouache.profile.edits import centred_mask
    from gouache.runner.describe import instruction_edits
    from gouache.runner.families import make_family
    from gouache.runner.model_runner import ModelRunner
    from gouache.runner.quantize import quantize
    from gouache.sched.plan import Batch

    torch.set_num_threads(args.torch_threads)
    variants = args.variants.split(",")
    large = args.size
    sizes = {"S": large // 2, "M": large * 3 // 4, "L": large}
    batches = [int(b) for b in args.batches.split(",")]
    edit = args.template_size
    # a group serves two rows of up to 3 + repeats steps; no fewer than STEPS, as block reuse depends on
    # how far apart steps are and a short schedule would make neighbouring steps far apart
    steps = max(STEPS, 2 * (3 + args.repeats))
    loras = tempfile.mkdtemp(prefix="gouache-speed-loras-")
    base = load_pipeline(model)
    for seed, name in enumerate(("ink", "paper")):
        save_file(random_lora(base, rank=8, seed=seed), os.path.join(loras, f"{name}.safetensors"))
    controls = None if supports_controlnets(base) else tempfile.mkdtemp(prefix="gouache-speed-controlnets-")
    if controls:
        random_controlnet(base, seed=0).save_pretrained(os.path.join(controls, "edges"))
    runners, editors = {}, {}
    for variant in variants:
        pipe = base if variant != "compiled+int8" else quantize(load_pipeline(model), "int8")
        rows = 2 if make_family(pipe, None).uses_cfg(request("probe", large, 0)) else 1
        # the row buckets of every row's step (3: the mixed sizes'), the mixed sizes compiled: a DiT's
        # packed forward then runs in compiled pieces (`gouache.runner.pieces`)
        compile = CompileConfig(enabled=True, buckets=tuple(sorted({rows * b for b in (*batches, 1, 2, 3)})),
                                sizes=tuple((s, s) for s in sizes.values()), cache_dir=args.compile_cache,
                                graphs=args.compile_graphs or 16) if variant != "eager" else None
        runners[variant] = runner = ModelRunner(pipe, lora=LoraConfig(loras), templates=TemplateConfig(),
                                                controlnet=ControlNetConfig(controls), compile=compile)
        runner.warm_up(large)
        for name in runner.lora_runtime.store.names():
            runner.lora_runtime.store.load(name).result()
        # the template rows on a runner of their own, compiled at their size and one request's rows (a
        # DiT's replays in pieces of a few computed-token buckets), so that the mixed sizes' token
        # buckets above stay those of their mixes
        edits = CompileConfig(enabled=True, buckets=(rows,), sizes=((edit, edit),), cache_dir=args.compile_cache,
                              graphs=EDIT_GRAPHS) if variant != "eager" else None
        editors[variant] = editor = ModelRunner(pipe, templates=TemplateConfig(), compile=edits)
        editor.warm_up(edit)
    bench = Interleaved(runners, args.repeats, steps)
    for b in batches:
        ids = bench.prepare([(large, {})] * b)
        bench.timed(f"step b={b}", [ids])
        bench.release(ids)
    mixed = bench.prepare([(sizes[s], {}) for s in "SML"])
    bench.together({"patched": ([mixed], True), "grouped": ([(rid,) for rid in mixed], False)})
    adapted = bench.prepare([(sizes[s], {"loras": ((name, 1.0),)}) for s, name in zip("SML", ("ink", "paper", "ink"))])
    bench.together({"patched, segmented LoRA": ([adapted], True), "patched, no LoRA": ([mixed], True)})
    bench.release(mixed, adapted)
    plain = bench.prepare([(large, {})] * 2)
    merged = bench.prepare([(large, {"loras": (("ink", 1.0),)})] * 2)
    segmented = bench.prepare([(large, {"loras": (("ink", 1.0),)}), (large, {"loras": (("paper", 1.0),)})])
    bench.timed("no LoRA", [plain])
    bench.timed("merged LoRA", [merged])
    bench.timed("segmented LoRA", [segmented])
    if instruction_edits(base):  # the upload a reference whose tokens follow the image's
        upload = Upload(picture(sample_scene(random.Random(3)), large, seed=3))
        instructed = bench.prepare([(large, {"image": b"-"})] * 2, upload)
        bench.together({"instruction edit": ([instructed], False), "generation": ([plain], False)})
        bench.release(instructed)
    if controls:
        image = picture(sample_scene(random.Random(2)), large, seed=2)
        controlled = bench.prepare([(large, {"controlnets": (("edges", b"-", 1.0),)})] * 2, controls=[image])
        bench.together({"ControlNet": ([controlled], False), "no ControlNet": ([plain], False)})
        bench.release(controlled)
    cached = bench.prepare([(large, {"block_cache": 0.1})] * 2)
    bench.together({"block cache": ([cached], False), "exact": ([plain], False)}, settle=3)
    bench.release(plain, merged, segmented, cached)
    image = picture(sample_scene(random.Random(1)), edit, seed=1)
    mask, _ = centred_mask(edit, runners["eager"].family.token_pixels, args.mask)
    editing = Interleaved(editors, args.repeats, steps)
    register = editing.prepare([(edit, {"image": b"-", "template_id": "speed", "register_template": True})],
                               Upload(image, EditMask(np.zeros_like(mask))))
    for _ in range(steps):  # the template: every step's activations recorded
        for editor in editors.values():
            editor.execute(Batch(register))
    editing.release(register)
    replay = editing.prepare([(edit, {"image": b"-", "template_id": "speed", "template_cache": True})],
                             Upload(image, EditMask(mask)))
    full = editing.prepare([(edit, {"image": b"-", "template_cache": False})], Upload(image, EditMask(mask)))
    bench.steps.update(editing.together({"template edit": ([replay], False), "full edit": ([full], False)}))
    editing.release(replay, full)
    ratios = {variant: {
        "patched / grouped": bench.ratio(variant, "patched", "grouped"),
        "merged LoRA / none": bench.ratio(variant, "merged LoRA", "no LoRA"),
        "segmented LoRA / none": bench.ratio(variant, "segmented LoRA", "no LoRA"),
        "segmented LoRA / none, patched": bench.ratio(variant, "patched, segmented LoRA", "patched, no LoRA"),
        **({"ControlNet / none": bench.ratio(variant, "ControlNet", "no ControlNet")} if controls else {}),
        **({"instruction edit / generation": bench.ratio(variant, "instruction edit", "generation")}
           if "instruction edit" in bench.steps else {}),
        "block cache / exact": bench.ratio(variant, "block cache", "exact"),
        "template edit / full edit": bench.ratio(variant, "template edit", "full edit"),
    } for variant in variants}
    return {"sizes": sizes, "steps": bench.steps, "ratios": ratios}


def format_table(results: dict, variants: list[str]) -> str:
    lines = ["| model | row | " + " | ".join(f"{v} ms" for v in variants) + " | "
             + " | ".join(f"{v} / eager" for v in variants[1:]) + " | paths |",
             "| --- | --- | " + " | ".join("---" for _ in variants) + " | " + " | ".join("---" for _ in variants[1:])
             + " | --- |"]
    for model, result in results.items():
        for label, row in result["steps"].items():
            eager = row["eager"]["ms"]
            paths = "; ".join(f"{v}: " + ", ".join(f"{k} {n}" for k, n in row[v]["paths"].items())
                              for v in variants[1:] if row[v]["paths"])
            lines.append(f"| {model} | {label} | " + " | ".join(f"{row[v]['ms']:.1f}" for v in variants) + " | "
                         + " | ".join(f"{row[v]['ms'] / eager:.2f}" for v in variants[1:]) + f" | {paths} |")
    lines += ["", "| model | ratio | " + " | ".join(variants) + " |",
              "| --- | --- | " + " | ".join("---" for _ in variants) + " |"]
    for model, result in results.items():
        for name in next(iter(result["ratios"].values())):
            lines.append(f"| {model} | {name} | " + " | ".join(f"{result['ratios'][v][name]:.2f}" for v in variants)
                         + " |")
    return "\n".join(lines)
