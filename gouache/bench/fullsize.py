"""`gouache bench fullsize`: every seed's saving on the published architectures (`sdxl-arch`:
SDXL's UNet, `sd3-arch`: SD3-medium's MMDiT; random weights in pipelines of their own, see
`gouache.models.zoo.arch_pipeline`), in bf16 on this machine's cores (or on a GPU, `--device
cuda`), where a step's arithmetic outweighs its overhead; and the device's matmul peak, so every
step time is also an MFU.

Each model runs in a process of its own; its rows are steps of in-process runners
(`runner.execute`: the forward, the sampler step, the composer), medians of `--repeats` after a
step untimed, variants interleaved repetition by repetition; on a GPU a step's time ends when its
queue is drained. A request's step runs its CFG rows (two per image). Variants: `eager` (bf16, the
baseline), `compiled` (on a GPU with CUDA graphs), `int8` and `fp8` (eager, over a copy of the
denoiser with its linear layers quantized: `gouache.runner.quantize`; fp8 on GPUs only). Rows:

- `peak_tflops`: large square matmuls (bf16, fp32) over `--torch-threads` threads, the best;
- `mfu`: one request's step at each size; its FLOPs counted (`torch.utils.flop_counter`,
  attention included) over the step's seconds over the bf16 peak;
- `patched_over_grouped`: mixes of sizes (two images each) in one patched UNet or packed DiT
  forward, against one forward per size, summed;
- `template_over_full`: an edit at the largest size replaying a template recorded from the same
  picture, against the same edit in full, per mask ratio;
- `lora`: four requests at the smallest size with four adapters of one rank in one forward
  (segmented), in a forward per adapter (`per adapter`, summed: what servers that batch by adapter
  do), and with one shared adapter (merged), each against no adapter in one forward;
- `block_cache`: the cache reusing a fixed share of its units (`FixedShare`: every other unit,
  alternating step by step) against exact, per image (two requests at the largest size: at
  256 px half a batch runs its kernels below their efficiency), per patch (patched UNet)
  and per token (packed DiT) over the first mix; and the share of unit-blocks it reused and the
  requests it evicted over its budget (8 GiB; 64 GiB on a GPU);
- `lora_loading`: one request's whole schedule (20 steps) at the smallest size, its adapter (the
  largest rank) read from its file as it starts, synchronously and with bounded asynchronous
  loading (joining by step 5), against no adapter and against the adapter already in memory;
- `park`: a paused request at the largest size parked in host memory (`--paused-host-mb`) and
  stepped back, against a step of its unparked twin: MiB parked, ms to park, ms to restore;
- `ulysses` (sd3-arch, CPU only): one request at the largest size, Ulysses degree 2 over two
  worker processes of one thread each, against degree 1 in one process of one thread and of two;
  with the collectives' share of the degree-2 step;
- `controlnet` (sdxl-arch): a random full-size ControlNet (`ControlNetModel.from_unet`) served
  by one service process of one thread, sync and async, against the plain step; the base
  runner on one thread too (the other core is the ControlNet's, as KATZ gives it a GPU). On a
  GPU the service shares the one GPU with the base.

On a GPU, the compiled variant captures CUDA graphs. `--out` with `{section}` in it writes each
section to its own file (`mfu`, `batching`, `edit`, `lora`, `lora_loading`, `block_cache`, `park`, `controlnet`,
`ulysses`), as `benchmarks/gpu.sh` names them. `--quick` times fewer, smaller rows (a few
minutes; the test runs it on the tiny models).

    gouache bench fullsize [--models sdxl-arch,sd3-arch] [--variants eager,compiled] [--device cuda] [--quick]
"""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STARTED = time.perf_counter()  # a child's log says when each section ended
VARIANTS = ("eager", "compiled", "int8", "fp8")
QUANTIZED = ("int8", "fp8")
SECTIONS = ("mfu", "patched", "template", "lora", "lora_loading", "block_cache", "park", "controlnet")
FILES = {"mfu": "mfu", "patched_over_grouped": "batching", "template_over_full": "edit", "lora": "lora",
         "lora_loading": "lora_loading",
         "block_cache": "block_cache", "park": "park", "controlnet": "controlnet", "ulysses": "ulysses"}  # summary key: --out's {section}


def add_arguments(p) -> None:
    p.add_argument("--models", default="sdxl-arch,sd3-arch",
                   help="comma-separated; a UNet and a DiT (default: %(default)s)")
    p.add_argument("--variants", default="eager", help=f"comma-separated, of {', '.join(VARIANTS)} (default: %(default)s)")
    p.add_argument("--sizes", default=None, help="square sizes in pixels, smallest and largest first and last "
                                                "(default: 256,512; --quick: 128,256)")
    p.add_argument("--mixes", default=None, help="mixed batches' sizes, '+'-joined, comma-separated, two images "
                                                "each (default: 256+512,256+384+512; --quick: 128+256)")
    p.add_argument("--masks", default="0.1,0.2,0.5", help="template edits' mask ratios (default: %(default)s)")
    p.add_argument("--ranks", default="16,64", help="segmented LoRA ranks (default: %(default)s)")
    p.add_argument("--share", type=float, default=0.5,
                   help="share of the block cache's units reused in its rows, one in n (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=None, help="timed steps per row, median (default: 3; --quick: 1)")
    p.add_argument("--torch-threads", type=int, default=2, help="intra-op threads (default: %(default)s)")
    p.add_argument("--device", default="cpu", help="cpu, or cuda[:N]: one GPU, without the ulysses rows "
                                                  "(default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="a smoke run: smaller sizes, one repeat, one rank, one mask (default: off)")
    p.add_argument("--skip", default=None,
                   help=f"comma-separated sections left out, of {', '.join(SECTIONS)}, ulysses (default: none)")
    p.add_argument("--compile-cache", default=None, metavar="DIR", help="compiled kernels kept here")
    p.add_argument("--out", default="benchmarks/results/fullsize_cpu.json",
                   help="JSON path; the tables (.md) go beside it; with {section} in it, a file per section "
                        "(default: %(default)s)")
    p.add_argument("--one", default=None, help="(internal) measure this model (or 'ulysses') here, print JSON")


def _settings(args) -> None:
    """--quick's defaults, and the checks of every argument."""
    args.sizes = [int(s) for s in (args.sizes or ("128,256" if args.quick else "256,512")).split(",")]
    args.mixes = [[int(s) for s in mix.split("+")]
                  for mix in (args.mixes or ("128+256" if args.quick else "256+512,256+384+512")).split(",")]
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.masks = [float(m) for m in args.masks.split(",")][:1 if args.quick else None]
    args.ranks = [int(r) for r in args.ranks.split(",")][:1 if args.quick else None]
    args.skip = [s for s in (args.skip or "").split(",") if s]
    variants = args.variants.split(",")
    if sorted(set(variants) - set(VARIANTS)) or "eager" not in variants:
        raise ValueError(f"--variants takes eager (always, the baseline) and any of {', '.join(VARIANTS[1:])}; "
                         f"got {args.variants!r}")
    if any(s % 128 for s in args.sizes) or any(len(mix) < 2 or any(s % 128 for s in mix) for mix in args.mixes):
        raise ValueError(f"--sizes and --mixes take multiples of 128 px (the patch), two or more sizes per mix; "
                         f"got {args.sizes}, {args.mixes}")
    if not all(0 < m <= 1 for m in args.masks):
        raise ValueError(f"--masks are shares of the image an edit repaints, in (0, 1]; got {args.masks}")
    if not 0 < args.share <= 0.5 or abs(1 / round(1 / args.share) - args.share) > 0.01:
        raise ValueError(f"--share is the share of units reused, one in n (0.5, 0.33, 0.25, ...); got {args.share}")
    if args.compile_cache and "compiled" not in variants:
        raise ValueError("--compile-cache keeps compiled kernels: it needs --variants eager,compiled")
    unknown = set(args.skip) - {*SECTIONS, "ulysses"}
    if unknown:
        raise ValueError(f"--skip takes {', '.join(SECTIONS)}, ulysses; got {', '.join(sorted(unknown))}")
    if args.device != "cpu" and not args.device.startswith("cuda"):
        raise ValueError(f"--device takes cpu or cuda[:N]; got {args.device!r}")
    if "fp8" in variants and args.device == "cpu":
        raise ValueError("--variants fp8 needs a GPU with float8 units (H100 or later): add --device cuda, or use int8")
    if args.device != "cpu" and "ulysses" not in args.skip:
        args.skip.append("ulysses")  # its degree 2 needs two devices; one GPU is measured


def run(args) -> int:
    raw = " ".join(sys.argv[3:])
    _settings(args)
    if args.one:
        if args.one == "ulysses":
            emit(measure_ulysses(args))
            # Its rows are written: leave without the interpreter's teardown, where this child has
            # aborted ("terminate called without an active exception", a C++ thread destroyed while
            # joinable; cause not found) in some runs, and so lost the rows.
            sys.stderr.flush()
            os._exit(0)
        measure(args.one, args)
        return 0
    peak = peak_tflops(args.torch_threads, (2048,) if args.quick else (2048, 4096, 8192), args.device)
    print(f"peak: bf16 {peak['bfloat16']:.3f} TFLOP/s, fp32 {peak['float32']:.3f} TFLOP/s", file=sys.stderr)
    command, results, ulysses = f"gouache bench fullsize {raw}".strip(), {}, None

    def written() -> list[Path]:  # after every section a child measures: a run cut short keeps what it had
        summary = summarize(results, peak, ulysses, args)
        return write_results(args.out, command, summary, {"models": results, "ulysses_raw": ulysses})

    for model in args.models.split(","):
        results[model] = {}
        _child(args, model, results[model], written)
    dit = next((m for m, r in results.items() if r["family"] == "dit"), None)
    if dit and "ulysses" not in args.skip:
        ulysses = {}
        _child(args, "ulysses", ulysses, written, dit)
    files = written()
    print(format_tables(summarize(results, peak, ulysses, args)))
    print("wrote " + ", ".join(f"{path}, {path.with_suffix('.md')}" for path in files))
    return 0


def emit(rows: dict) -> None:
    """(In a child) rows just measured, a JSON line on stdout for the parent, and the time so far."""
    print(json.dumps(rows), flush=True)
    print(f"{', '.join(rows)}: measured at {time.perf_counter() - STARTED:.0f} s", file=sys.stderr, flush=True)


def write_results(out: str, command: str, summary: dict, raw: dict) -> list[Path]:
    """JSON and markdown at `out`, with the raw rows; or, where `out` holds `{section}`, a pair
    per section measured (`FILES`' names), each with what every section shares. The JSON paths."""
    if "{section}" not in out:
        return [_write(Path(out), command, {**summary, **raw})]
    common = {k: v for k, v in summary.items() if k not in FILES}
    return [_write(Path(out.replace("{section}", name)), command, {**common, key: summary[key]})
            for key, name in FILES.items() if summary.get(key)]


def _write(out: Path, command: str, summary: dict) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": command, **summary}, indent=2) + "\n")
    out.with_suffix(".md").write_text(f"`{command}` on {summary['device']}\n\n{format_tables(summary)}\n")
    return out


def _child(args, one: str, rows: dict, progress, model: str | None = None) -> None:
    """`one`'s rows, measured in a process of its own, into `rows` as each section ends (then
    `progress()`); its log passes through. Tried again once if a signal killed it (a worker
    process aborting at shutdown took a whole run's rows with it once); an error is final."""
    command = [sys.executable, "-m", "gouache.cli", "bench", "fullsize", "--one", one,
               "--models", model or one, "--variants", args.variants,
               "--sizes", ",".join(map(str, args.sizes)), "--mixes", ",".join("+".join(map(str, m)) for m in args.mixes),
               "--masks", ",".join(map(str, args.masks)),
               "--ranks", ",".join(map(str, args.ranks)), "--share", str(args.share),
               "--repeats", str(args.repeats), "--torch-threads", str(args.torch_threads), "--device", args.device]
    command += ["--skip", ",".join(args.skip)] if args.skip else []
    command += ["--quick"] if args.quick else []
    command += ["--compile-cache", args.compile_cache] if args.compile_cache else []
    for attempt in range(2):
        start = time.perf_counter()
        rows.clear()
        with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as child:
            for line in child.stdout:
                if line.startswith("{"):  # a section's rows (anything else a library printed is not)
                    rows.update(json.loads(line))
                    progress()
        seconds = time.perf_counter() - start
        if not child.returncode:
            print(f"{one}: done in {seconds:.0f} s", file=sys.stderr)
            return
        if child.returncode > 0 or attempt:
            raise RuntimeError(f"measuring {one} failed (exit {child.returncode}) in {seconds:.0f} s, after "
                               f"{', '.join(rows) or 'no section'}; its error is logged above")
        print(f"{one}: killed by signal {-child.returncode} in {seconds:.0f} s; again", file=sys.stderr)


def peak_tflops(threads: int, sides: tuple[int, ...], device: str = "cpu") -> dict[str, float]:
    """The best of three n-by-n matmuls for each n of `sides`, in TFLOP/s, per dtype (on a GPU,
    each the mean of ten in a row, its queue drained)."""
    import torch

    torch.set_num_threads(threads)
    sync, times = device_sync(device), 1 if device == "cpu" else 10
    peak = {}
    for dtype in (torch.bfloat16, torch.float32):
        best = 0.0
        for n in sides:
            a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
            a @ b
            sync()
            for _ in range(3):
                start = time.perf_counter()
                for _ in range(times):
                    a @ b
                sync()
                best = max(best, 2 * n**3 * times / (time.perf_counter() - start) / 1e12)
        peak[str(dtype).removeprefix("torch.")] = best
    return peak


def device_sync(device: str):
    """What waits for `device`'s queued work: nothing on the CPU."""
    import torch

    return (lambda: torch.cuda.synchronize(device)) if device.startswith("cuda") else (lambda: None)


def device_name(device: str) -> str:
    import platform

    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"{platform.machine()} CPU, {os.cpu_count()} cores"


def flop_counter():
    """torch's FLOP counter, also counting the CPU's fused attention (which it leaves out)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

    def attention(query, key, value, *args, out_val=None, **kwargs) -> int:
        return sdpa_flop_count(query, key, value)

    return FlopCounterMode(display=False, custom_mapping={
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: attention})


def step_flops(runner, ids: tuple[str, ...]) -> int:
    """FLOPs of one step of `ids` (it runs: the requests move a step on)."""
    from gouache.sched.plan import Batch

    with flop_counter() as counter:
        out = runner.execute(Batch(ids))
    if out.failed:
        raise RuntimeError(f"counting FLOPs: {out.failed}")
    return counter.get_total_flops()


def measure(model: str, args) -> None:
    """Every section of one model under every variant (see the module's docstring), each
    emitted as it ends."""
    import torch

    from gouache.models.zoo import load_pipeline

    torch.set_num_threads(args.torch_threads)
    pipe = load_pipeline(model, "bfloat16", args.device)
    unet = hasattr(pipe, "unet")
    emit({"family": "unet" if unet else "dit", "sizes": args.sizes, "variants": args.variants.split(",")})  # loaded
    _denoiser_sections(pipe, unet, args)  # its runners (and their templates) freed on return
    if unet and "controlnet" not in args.skip:
        emit({"controlnet": _controlnet(pipe, args.sizes[0], args)})


def _denoiser_sections(pipe, unet: bool, args) -> None:
    from safetensors.torch import save_file

    from gouache.bench.interleaved import Interleaved
    from gouache.config import CompileConfig, LoraConfig, TemplateConfig
    from gouache.lora.files import random_lora
    from gouache.runner.model_runner import ModelRunner

    sizes, small, large = args.sizes, args.sizes[0], args.sizes[-1]
    steps = 2 * (2 + args.repeats)  # the most steps one request runs: two rows of a settle and the repeats each
    loras = Path(tempfile.mkdtemp(prefix="gouache-fullsize-loras-"))
    try:
        names = {}
        for rank in args.ranks:
            names[rank] = [f"r{rank}-{i}" for i in range(4)]
            for i, name in enumerate(names[rank]):
                save_file(random_lora(pipe, rank=rank, seed=100 * rank + i), str(loras / f"{name}.safetensors"))
        runners, pipes = {}, variant_pipes(pipe, args.variants.split(","))  # the copies made before any runner hooks pipe
        # a template in the GPU's memory, as a GPU server would hold a hot one (sd3-arch records 12 GB at 1024 px)
        templates = TemplateConfig(host_bytes=8 << 30, device_bytes=(64 << 30) if args.device.startswith("cuda") else 0)
        for variant in args.variants.split(","):
            compile = None
            if variant == "compiled":  # what a plain step of the mfu (2 rows) and LoRA rows (8) needs; the
                # largest size at one request compiles in its first (untimed) step
                compile = CompileConfig(enabled=True, buckets=(2, 8) if "lora" not in args.skip else (2,),
                                        sizes=((small, small),), cache_dir=args.compile_cache,
                                        cuda_graphs=args.device.startswith("cuda"))
            runners[variant] = runner = ModelRunner(
                pipes[variant], loras=LoraConfig(str(loras)), templates=templates, compile=compile)
            runner.warm_up(small)
            for name in runner.loras.store.names():
                runner.loras.store.load(name).result()
        bench = Interleaved(runners, args.repeats, steps, device_sync(args.device))
        print(f"runners and adapters ready at {time.perf_counter() - STARTED:.0f} s", file=sys.stderr, flush=True)
        if "mfu" not in args.skip:
            emit({"mfu": _mfu(bench, sizes)})
        if "patched" not in args.skip:
            emit({"patched": _patched(bench, args.mixes)})
        if "template" not in args.skip:
            template = _template(bench, large, args.masks, steps)
            emit({"template": template, "template_bytes": bench.runners["eager"].held().templates})  # per tier
        if "lora" not in args.skip:
            emit({"lora": _lora(bench, small, names)})
        if "lora_loading" not in args.skip:
            rank = max(names)
            emit({"lora_loading": _lora_loading(pipe, loras, names[rank][0], rank, small, args.quick, bench.repeats,
                                                device_sync(args.device))})
        if "block_cache" not in args.skip:
            # a GPU's budget: at 1024 px sdxl-arch's per-patch rows passed 8 GiB and were all evicted (H200)
            budget = (64 << 30) if args.device.startswith("cuda") else 8 << 30
            emit({"block_cache": _block_cache(bench, large, args.mixes[0], args.share, unet, budget)})
        if "park" not in args.skip:
            emit({"park": _park(bench, large, device_sync(args.device))})
    finally:
        shutil.rmtree(loras, ignore_errors=True)


def variant_pipes(pipe, variants: list[str]) -> dict:
    """Each variant's pipeline: `pipe` itself, or for int8 and fp8 one sharing every component of
    `pipe` but its denoiser, a quantized copy."""
    import copy

    from gouache.runner.quantize import quantize

    name = "unet" if getattr(pipe, "unet", None) is not None else "transformer"
    return {variant: quantize(type(pipe)(**{**pipe.components, name: copy.deepcopy(getattr(pipe, name))}), variant)
            if variant in QUANTIZED else pipe for variant in variants}


def _mfu(bench, sizes: list[int]) -> dict:
    rows = {}
    for size in sizes:
        ids = bench.prepare([(size, {})])
        rows[str(size)] = {"ms": bench.timed(f"step {size}", [ids]), "flops": step_flops(bench.runners["eager"], ids)}
        bench.release(ids)
    return rows


def _patched(bench, mixes: list[list[int]]) -> dict:
    rows = {}
    for mix in mixes:
        label = "+".join(map(str, mix))
        ids = bench.prepare([(size, {}) for size in mix for _ in range(2)])
        bench.together({f"mixed {label}": ([ids], True),
                        f"grouped {label}": ([ids[2 * i:2 * i + 2] for i in range(len(mix))], False)})
        bench.release(ids)
        rows[label] = {v: bench.ratio(v, f"mixed {label}", f"grouped {label}") for v in bench.variants}
    return rows


def _template(bench, size: int, masks: list[float], steps: int) -> dict:
    import numpy as np

    from gouache.bench.edit import picture
    from gouache.data.shapes import sample_scene
    from gouache.profile.edits import centred_mask
    from gouache.sched.plan import Batch

    image = picture(sample_scene(random.Random(1)), size, seed=1)
    token = bench.runners["eager"].family.token_pixels
    blank = np.zeros_like(centred_mask(size, token, masks[0])[0])
    edit = {"image": b"-", "prompt": "a red circle", "template_id": "fullsize"}  # one prompt: its text rows replay too
    register = bench.prepare([(size, {**edit, "register_template": True})], image, blank)
    for _ in range(steps):  # the template: every step's activations recorded
        for runner in bench.runners.values():
            out = runner.execute(Batch(register))
            if out.failed:
                raise RuntimeError(f"recording the template: {out.failed}")
    bench.release(register)
    rows = {}
    for ratio in masks:
        mask, share = centred_mask(size, token, ratio)
        replay = bench.prepare([(size, {**edit, "template_cache": True})], image, mask)
        full = bench.prepare([(size, {**edit, "template_cache": False})], image, mask)
        bench.together({f"template edit {ratio}": ([replay], False), f"full edit {ratio}": ([full], False)})
        bench.release(replay, full)
        rows[str(ratio)] = {"tokens": share, **{v: bench.ratio(v, f"template edit {ratio}", f"full edit {ratio}")
                                                 for v in bench.variants}}
    return rows


def _lora(bench, size: int, names: dict[int, list[str]]) -> dict:
    """Four requests with four adapters each their own (segmented), then with one adapter all
    (merged: the runtime merges it in its first step), each against no adapter beside it; nothing
    merged outside the merged row. A row's `mode` is how the runtime applied its adapters."""
    from gouache.bench.interleaved import STEPS

    bench.schedule = STEPS  # a whole schedule ahead: the runtime merges a shared adapter when it pays
    modes: dict[str, set[str]] = {}

    def unmerged() -> None:
        for runner in bench.runners.values():
            runner.loras.merged.set(())

    def timed(label: str, *batches: tuple[str, ...]) -> None:
        seen = modes.setdefault(label, set())
        bench.timed(label, list(batches), observe=lambda variant, out: seen.add(out.lora.mode or "none"))

    plain = bench.prepare([(size, {})] * 4)
    rows = {}
    for rank, four in names.items():
        mixed = bench.prepare([(size, {"loras": ((name, 1.0),)}) for name in four])
        unmerged()
        timed("no LoRA", plain)
        timed(f"segmented rank {rank}", mixed)
        rows[f"segmented rank {rank}"] = {v: bench.ratio(v, f"segmented rank {rank}", "no LoRA") for v in bench.variants}
        timed(f"per adapter rank {rank}", *((rid,) for rid in mixed))  # a forward per adapter, summed
        rows[f"per adapter rank {rank}"] = {v: bench.ratio(v, f"per adapter rank {rank}", "no LoRA")
                                            for v in bench.variants}
        bench.release(mixed)
    first = next(iter(names.values()))[0]
    merged = bench.prepare([(size, {"loras": ((first, 1.0),)})] * 4)
    unmerged()
    timed("no LoRA", plain)
    timed("merged", merged)
    rows["merged"] = {v: bench.ratio(v, "merged", "no LoRA") for v in bench.variants}
    for label, row in rows.items():
        row["mode"] = ",".join(sorted(modes[label]))
    unmerged()
    bench.release(plain, merged)
    return rows


def _lora_loading(pipe, directory: Path, name: str, rank: int, size: int, quick: bool, repeats: int, sync) -> dict:
    """One request of a whole schedule at `size`, its adapter `name` read from its file when it
    starts: synchronously (`LoraConfig.bound` 0: before its first step) and with bounded
    asynchronous loading (KATZ §6: joining by step `bound`, a quarter of the schedule), each on a
    new runner whose store holds nothing; against the same request without adapter and with its
    adapter already in host memory. Eager, medians of `repeats` after one untimed, the cases in
    turn. The file is this machine's: after the first read, the page cache's."""
    from gouache.bench.interleaved import request
    from gouache.config import LoraConfig
    from gouache.runner.model_runner import ModelRunner
    from gouache.sched.plan import Batch

    steps = 4 if quick else 20
    bound = steps // 4
    warm = ModelRunner(pipe, loras=LoraConfig(str(directory)))
    warm.loras.store.load(name).result()

    def cold(bound: int) -> ModelRunner:  # a new store: nothing read yet
        return ModelRunner(pipe, loras=LoraConfig(str(directory), bound=bound))

    cases = {"none": (lambda: warm, ()), "in memory": (lambda: warm, ((name, 1.0),)),
             "sync": (lambda: cold(0), ((name, 1.0),)), "bal": (lambda: cold(bound), ((name, 1.0),))}
    times: dict[str, list[float]] = {case: [] for case in cases}
    for rep in range(1 + repeats):
        for case, (runner_of, adapters) in cases.items():
            runner, rid = runner_of(), f"loading-{case}-{rep}"
            start = time.perf_counter()
            runner.prepare(request(rid, size, rep, steps, loras=adapters))
            while not runner.states[rid].done:
                out = runner.execute(Batch((rid,)))
                if out.failed:
                    raise RuntimeError(f"LoRA loading ({case}): {out.failed}")
            sync()
            if rep:
                times[case].append(time.perf_counter() - start)
            runner.release(rid)
            runner.loras.merged.set(())  # the shared pipeline's weights as loaded, for the next case
    seconds = {case: statistics.median(t) for case, t in times.items()}
    return {"size": size, "steps": steps, "bound": bound, "rank": rank,
            "file_mb": (directory / f"{name}.safetensors").stat().st_size / 2**20, "seconds": seconds,
            **{f"{case}_over_none": seconds[case] / seconds["none"] for case in ("in memory", "sync", "bal")}}


def _block_cache(bench, size: int, mix: list[int], share: float, unet: bool, budget: int) -> dict:
    from gouache.block_cache.store import BlockCache
    from gouache.config import BlockCacheConfig

    period = round(1 / share)
    for runner in bench.runners.values():
        runner.cache = BlockCache(BlockCacheConfig(budget_bytes=budget), fixed_share(period))
    counts = {"reused": 0, "computed": 0}

    def observe(variant: str, out) -> None:
        counts["reused"] += out.block_cache.reused
        counts["computed"] += out.block_cache.computed

    rows = {}
    cases = [("image", [(size, {})] * 2, False), ("patch" if unet else "token", [(s, {}) for s in mix for _ in range(2)], True)]
    for unit, specs, patched in cases:
        exact = bench.prepare(specs)
        cached = bench.prepare([(s, {**fields, "block_cache": 0.5}) for s, fields in specs])
        counts.update(reused=0, computed=0)
        evicted = sum(runner.cache.evictions for runner in bench.runners.values())
        bench.together({f"cached per {unit}": ([cached], patched), f"exact per {unit}": ([exact], patched)},
                       settle=2, observe=observe)
        reused = counts["reused"] / max(1, counts["reused"] + counts["computed"])
        evicted = sum(runner.cache.evictions for runner in bench.runners.values()) - evicted  # over the budget
        rows[unit] = {"reused": reused, "evictions": evicted,
                      **{v: bench.ratio(v, f"cached per {unit}", f"exact per {unit}") for v in bench.variants}}
        bench.release(exact, cached)
    return rows


def _park(bench, size: int, sync) -> dict:
    """A paused request at the largest size parked in host memory (`ModelRunner.park`, as
    `--paused-host-mb` does) and stepped back from it, against a step of its unparked twin, on
    the eager runner: the bytes parked, ms to park, ms of the step that restores it."""
    from gouache.sched.plan import Batch

    runner = bench.runners["eager"]
    resumed, twin = bench.prepare([(size, {}), (size, {})])
    times: dict[str, list[float]] = {"step": [], "park": [], "resumed step": []}
    parked = 0
    for rep in range(1 + bench.repeats):  # the first of each untimed
        for label, run in (("step", lambda: runner.execute(Batch((twin,)))), ("park", lambda: runner.park(resumed)),
                           ("resumed step", lambda: runner.execute(Batch((resumed,))))):
            start = time.perf_counter()
            out = run()
            sync()
            seconds = time.perf_counter() - start
            if label == "park":
                parked = out
            elif out.failed:
                raise RuntimeError(f"parking ({label}): {out.failed}")
            if rep:
                times[label].append(1e3 * seconds)
    bench.release((resumed, twin))
    ms = {label: statistics.median(t) for label, t in times.items()}
    return {"size": size, "parked_mb": parked / 2**20, "park_ms": ms["park"], "step_ms": ms["step"],
            "resumed_step_ms": ms["resumed step"], "restore_ms": ms["resumed step"] - ms["step"]}


def fixed_share(period: int):
    """A `CachePass` reusing every `period`-th cached unit (of those the cache may reuse),
    shifting by one each forward, whatever the inputs' change: a known share of reuse to time."""
    import torch

    from gouache.block_cache.store import CachePass

    class FixedShare(CachePass):
        forwards = 0

        def __init__(self, *args):
            super().__init__(*args)
            self.phase = FixedShare.forwards % period
            FixedShare.forwards += 1

        def unchanged(self, block, entry, x) -> torch.Tensor:
            rows = torch.arange(len(entry.inputs), device=x.device)
            return (rows + self.phase) % period == 0

    return FixedShare


def _controlnet(pipe, size: int, args) -> dict:
    """Wall seconds of a step: plain, and with a full-size ControlNet served sync and async (the
    service and the base runner on one thread each), interleaved."""
    import numpy as np
    import torch

    from gouache.bench.interleaved import request
    from gouache.config import ControlNetConfig
    from gouache.controlnet.model import Base, random_controlnet
    from gouache.controlnet.service import ControlService
    from gouache.runner.model_runner import ModelRunner
    from gouache.sched.plan import Batch

    torch.set_num_threads(1)
    sync = device_sync(args.device)
    directory = Path(tempfile.mkdtemp(prefix="gouache-fullsize-controlnet-"))
    service, runners = None, {}
    times: dict[str, list[float]] = {"plain": [], "sync": [], "async": []}
    try:
        random_controlnet(pipe, seed=0, std=0.02).save_pretrained(str(directory / "net"))
        service = ControlService(1, str(directory), Base.of(pipe), 16 << 30, threads=1)
        image = np.random.default_rng(0).integers(0, 256, (size, size, 3), dtype=np.uint8)
        for mode in times:
            config = None if mode == "plain" else ControlNetConfig(str(directory), 1, mode, service=service.address)
            runners[mode] = runner = ModelRunner(pipe, controlnets=config)
            fields = {} if mode == "plain" else {"controlnets": (("net", b"", 1.0),)}
            runner.prepare(request(mode, size, 0, 3 + args.repeats, **fields),
                           **({} if mode == "plain" else {"controls": [image]}))
        for rep in range(2 + args.repeats):  # two steps warm the service (and load the net)
            for mode, runner in runners.items():
                start = time.perf_counter()
                out = runner.execute(Batch((mode,)))
                sync()
                if out.failed:
                    raise RuntimeError(f"ControlNet {mode}: {out.failed}")
                if rep >= 2:
                    times[mode].append(1e3 * (time.perf_counter() - start))
    finally:
        for runner in runners.values():
            runner.controls.close()
        if service is not None:
            service.shutdown()
        shutil.rmtree(directory, ignore_errors=True)
        torch.set_num_threads(args.torch_threads)
    ms = {mode: statistics.median(t) for mode, t in times.items()}
    return {"size": size, "threads": 1, "ms": ms, "sync": ms["sync"] / ms["plain"], "async": ms["async"] / ms["plain"]}


def measure_ulysses(args) -> dict:
    """One request at the largest size: degree 1 in this process (one thread, then two) and
    degree 2 over two worker processes of one thread each, interleaved."""
    import torch

    from gouache.bench.interleaved import request
    from gouache.executor.multiproc import MultiprocExecutor
    from gouache.executor.pool import DevicePool
    from gouache.executor.worker import WorkerSpec
    from gouache.models.zoo import load_pipeline
    from gouache.runner.model_runner import ModelRunner
    from gouache.sched.plan import Batch

    model, size = args.models, args.sizes[-1]
    pipe = load_pipeline(model, "bfloat16")
    runner = ModelRunner(pipe)
    local = DevicePool.in_process(runner)
    executor = MultiprocExecutor(WorkerSpec(model, "bfloat16", torch_threads=1), 2)
    steps = 3 * (2 + args.repeats)
    times: dict[str, list[float]] = {"degree 1, 1 thread": [], "degree 1, 2 threads": [], "degree 2": []}
    collective: list[float] = []
    try:
        pool = DevicePool(runner, executor)
        alone, spread = request("alone", size, 0, steps), request("spread", size, 1, steps)
        runner.prepare(alone)
        runner.prepare(spread)
        for rep in range(2 + args.repeats):
            for case in times:
                torch.set_num_threads(2 if case == "degree 1, 2 threads" else 1)
                target, batch = (pool, Batch(("spread",), (0, 1))) if case == "degree 2" else (local, Batch(("alone",), (0,)))
                start = time.perf_counter()
                out = target.submit(batch).result()
                seconds = time.perf_counter() - start
                if out.failed:
                    raise RuntimeError(f"ulysses {case}: {out.failed}")
                if rep >= 2:
                    times[case].append(seconds)
                    if case == "degree 2":
                        collective.append(out.collective_s)
    finally:
        executor.shutdown()
        torch.set_num_threads(args.torch_threads)
    ms = {case: 1e3 * statistics.median(t) for case, t in times.items()}
    return {"model": model, "size": size, "ms": ms,
            "speedup_over_one_thread": ms["degree 1, 1 thread"] / ms["degree 2"],
            "over_two_threads": ms["degree 2"] / ms["degree 1, 2 threads"],
            "collective_share": statistics.median(collective) / (ms["degree 2"] / 1e3)}


def summarize(results: dict, peak: dict, ulysses: dict | None, args) -> dict:
    """The issue's keys, from each model's raw rows."""
    summary: dict = {"device": device_name(args.device), "peak_tflops": {"bf16": peak["bfloat16"], "fp32": peak["float32"]},
                     "torch_threads": args.torch_threads, "repeats": args.repeats, "quick": args.quick}
    for key in ("mfu", "patched_over_grouped", "template_over_full", "lora", "block_cache"):
        summary[key] = {}
    for model, r in results.items():
        if "mfu" in r:
            summary["mfu"][model] = {
                size: {v: {"ms": row["ms"][v]["ms"], "tflops": row["flops"] / 1e12,
                           "mfu": row["flops"] / (row["ms"][v]["ms"] / 1e3) / (peak["bfloat16"] * 1e12)}
                       for v in r["variants"]}
                for size, row in r["mfu"].items()}
        for key, raw in (("patched_over_grouped", "patched"), ("template_over_full", "template"),
                         ("lora", "lora"), ("block_cache", "block_cache")):
            if raw in r:
                summary[key][model] = r[raw]
        if "template_bytes" in r:
            summary.setdefault("template_bytes", {})[model] = r["template_bytes"]
        if "controlnet" in r:
            summary["controlnet"] = {model: r["controlnet"]}
        if "park" in r:
            summary.setdefault("park", {})[model] = r["park"]
        if "lora_loading" in r:
            summary.setdefault("lora_loading", {})[model] = r["lora_loading"]
    if ulysses is not None:
        summary["ulysses"] = ulysses
    return summary


def format_tables(summary: dict) -> str:
    lines = [f"{summary['device']}: peak bf16 {summary['peak_tflops']['bf16']:.3f} TFLOP/s, fp32 "
             f"{summary['peak_tflops']['fp32']:.3f} TFLOP/s ({summary['torch_threads']} threads); medians of "
             f"{summary['repeats']}", ""]

    def table(title: str, header: list[str], rows: list[list]) -> None:
        lines.extend([f"**{title}**", "", "| " + " | ".join(header) + " |", "|" + " --- |" * len(header)])
        lines.extend("| " + " | ".join(str(c) if isinstance(c, (str, int)) else f"{c:.2f}" for c in row) + " |" for row in rows)
        lines.append("")

    rows = [[model, size, v, cell["ms"], cell["tflops"], cell["mfu"]]
            for model, by_size in summary.get("mfu", {}).items() for size, cells in by_size.items()
            for v, cell in cells.items()]
    if rows:
        table("step (one request, CFG) and MFU", ["model", "px", "variant", "ms", "TFLOP per step", "MFU"], rows)
    for key, title in (("patched_over_grouped", "patched or packed / grouped (two images per size)"),
                       ("template_over_full", "template edit / full edit (tokens: share repainted)"),
                       ("lora", "LoRA step / no adapter (four requests)"),
                       ("block_cache", "block cache (fixed share) / exact (reused: share of unit-blocks)")):
        cells = [(model, name, row) for model, by_name in summary.get(key, {}).items() for name, row in by_name.items()]
        if not cells:  # a section left out (--skip)
            continue
        columns = list(dict.fromkeys(k for _, _, row in cells for k in row))
        table(title, ["model", "row", *columns], [[model, name, *(row.get(k, "") for k in columns)]
                                                  for model, name, row in cells])
    if "lora_loading" in summary:
        rows = [[model, f"{c['size']} px, {c['steps']} steps", f"{c['rank']} ({c['file_mb']:.1f} MiB)", c["seconds"]["none"],
                 c["in memory_over_none"], c["sync_over_none"], f"{c['bal_over_none']:.2f} (by step {c['bound']})"]
                for model, c in summary["lora_loading"].items()]
        table("a request whose adapter is not in memory / without adapter (whole schedule)",
              ["model", "request", "rank (file)", "none s", "in memory", "read sync", "read async (BAL)"], rows)
    if "park" in summary:
        rows = [[model, f"{p['size']} px", p["parked_mb"], p["park_ms"], p["step_ms"], p["restore_ms"]]
                for model, p in summary["park"].items()]
        table("a paused request parked in host memory (eager)", ["model", "size", "MiB", "park ms", "step ms",
                                                                  "restore ms (resumed step - step)"], rows)
    if "controlnet" in summary:
        rows = [[model, f"{c['size']} px", c["ms"]["plain"], c["sync"], c["async"]] for model, c in summary["controlnet"].items()]
        table("ControlNet service (one thread each) / plain step", ["model", "size", "plain ms", "sync", "async"], rows)
    if "ulysses" in summary:
        u = summary["ulysses"]
        table(f"Ulysses, {u['model']} at {u['size']} px", ["case", "ms"], [[case, ms] for case, ms in u["ms"].items()])
        lines.append(f"degree 2 over degree 1 on one thread: {u['speedup_over_one_thread']:.2f}x; over one process on two "
                     f"threads: {u['over_two_threads']:.2f} of its time; collectives {100 * u['collective_share']:.0f} %")
    return "\n".join(lines)
