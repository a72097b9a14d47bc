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
denoiser with its linear layers quantized: `gouache.runner.quantize`; fp8 on GPUs only), and
`compiled+int8`, `compiled+fp8` (the same copies compiled: where fp8's scaling can fuse). Rows:

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
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from gouache.bench.fullsize_sections import COMPILED, QUANTIZED, device_sync, emit, measure, measure_ulysses

VARIANTS = ("eager", *QUANTIZED, *COMPILED)
SECTIONS = ("mfu", "patched", "template", "lora", "lora_loading", "block_cache", "park", "controlnet")
# summary key: --out's {section}
FILES = {"mfu": "mfu", "patched_over_grouped": "batching", "template_over_full": "edit", "lora": "lora",
         "lora_loading": "lora_loading",
         "block_cache": "block_cache", "park": "park", "controlnet": "controlnet", "ulysses": "ulysses"}


def add_arguments(p) -> None:
    p.add_argument("--models", default="sdxl-arch,sd3-arch",
                   help="comma-separated; a UNet and a DiT (default: %(default)s)")
    p.add_argument("--variants", default="eager",
                   help=f"comma-separated, of {', '.join(VARIANTS)} (default: %(default)s)")
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
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: smaller sizes, one repeat, one rank, one mask (default: off)")
    p.add_argument("--skip", default=None,
                   help=f"comma-separated sections left out, of {', '.join(SECTIONS)}, ulysses (default: none)")
    p.add_argument("--compile-cache", default=None, metavar="DIR", help="compiled kernels kept here")
    p.add_argument("--compile-backend", default="inductor", choices=("inductor", "eager"),
                   help="the compiled variant's torch.compile backend; eager traces the same graphs without "
                        "generating kernels (a smoke run's compiled paths in seconds; no CUDA graphs) "
                        "(default: %(default)s)")
    p.add_argument("--compile-graphs", type=int, default=None,
                   help="graphs the compiled variant warms up at most: a row graph per size and bucket, the rest "
                        "token buckets of a DiT's packed forward of the mixes and of its template replays "
                        "(default: 16)")
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
    compiles = set(variants) & set(COMPILED)
    if args.compile_cache and not compiles:
        raise ValueError("--compile-cache keeps compiled kernels: it needs --variants eager,compiled")
    if args.compile_backend != "inductor" and not compiles:
        raise ValueError("--compile-backend picks the compiled variant's backend: it needs --variants eager,compiled")
    if args.compile_graphs is not None and not compiles:
        raise ValueError("--compile-graphs bounds the compiled variant's graphs: it needs --variants eager,compiled")
    unknown = set(args.skip) - {*SECTIONS, "ulysses"}
    if unknown:
        raise ValueError(f"--skip takes {', '.join(SECTIONS)}, ulysses; got {', '.join(sorted(unknown))}")
    if args.device != "cpu" and not args.device.startswith("cuda"):
        raise ValueError(f"--device takes cpu or cuda[:N]; got {args.device!r}")
    if {"fp8", "compiled+fp8"} & set(variants) and args.device == "cpu":
        raise ValueError("--variants fp8 needs a GPU with float8 units (H100 or later): add --device cuda, or use int8")
    if args.device != "cpu" and "ulysses" not in args.skip:
        args.skip.append("ulysses")  # its degree 2 needs two devices; one GPU is measured


def run(args) -> int:
    raw = " ".join(sys.argv[3:])
    _settings(args)
    if args.one:
        # the engine's progress (the compiled variant's warm-up, graph by graph) in the child's log
        logging.basicConfig(format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
        logging.getLogger("gouache").setLevel(logging.INFO)
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
               "--sizes", ",".join(map(str, args.sizes)),
               "--mixes", ",".join("+".join(map(str, m)) for m in args.mixes),
               "--masks", ",".join(map(str, args.masks)),
               "--ranks", ",".join(map(str, args.ranks)), "--share", str(args.share),
               "--repeats", str(args.repeats), "--torch-threads", str(args.torch_threads), "--device", args.device]
    command += ["--skip", ",".join(args.skip)] if args.skip else []
    command += ["--quick"] if args.quick else []
    command += ["--compile-cache", args.compile_cache] if args.compile_cache else []
    command += ["--compile-graphs", str(args.compile_graphs)] if args.compile_graphs is not None else []
    command += ["--compile-backend", args.compile_backend]
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


def device_name(device: str) -> str:
    import platform

    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"{platform.machine()} CPU, {os.cpu_count()} cores"


def summarize(results: dict, peak: dict, ulysses: dict | None, args) -> dict:
    """The issue's keys, from each model's raw rows."""
    summary: dict = {"device": device_name(args.device),
                     "peak_tflops": {"bf16": peak["bfloat16"], "fp32": peak["float32"]},
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
        if "steps" in r:  # each row's median ms and compile paths per variant, in every section's file
            summary.setdefault("steps", {})[model] = r["steps"]
    if ulysses is not None:
        summary["ulysses"] = ulysses
    return summary


def format_tables(summary: dict) -> str:
    lines = [f"{summary['device']}: peak bf16 {summary['peak_tflops']['bf16']:.3f} TFLOP/s, fp32 "
             f"{summary['peak_tflops']['fp32']:.3f} TFLOP/s ({summary['torch_threads']} threads); medians of "
             f"{summary['repeats']}", ""]

    def table(title: str, header: list[str], rows: list[list]) -> None:
        lines.extend([f"**{title}**", "", "| " + " | ".join(header) + " |", "|" + " --- |" * len(header)])
        lines.extend("| " + " | ".join(str(c) if isinstance(c, (str, int)) else f"{c:.2f}" for c in row) + " |"
                     for row in rows)
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
        rows = [[model, f"{c['size']} px, {c['steps']} steps", f"{c['rank']} ({c['file_mb']:.1f} MiB)",
                 c["seconds"]["none"], c["in memory_over_none"], c["sync_over_none"],
                 f"{c['bal_over_none']:.2f} (by step {c['bound']})"]
                for model, c in summary["lora_loading"].items()]
        table("a request whose adapter is not in memory / without adapter (whole schedule)",
              ["model", "request", "rank (file)", "none s", "in memory", "read sync", "read async (BAL)"], rows)
    if "park" in summary:
        rows = [[model, f"{p['size']} px", p["parked_mb"], p["park_ms"], p["step_ms"], p["restore_ms"]]
                for model, p in summary["park"].items()]
        table("a paused request parked in host memory (eager)", ["model", "size", "MiB", "park ms", "step ms",
                                                                  "restore ms (resumed step - step)"], rows)
    if "controlnet" in summary:
        rows = [[model, f"{c['size']} px", c["ms"]["plain"], c["sync"], c["async"]]
                for model, c in summary["controlnet"].items()]
        table("ControlNet service (one thread each) / plain step", ["model", "size", "plain ms", "sync", "async"], rows)
    if "ulysses" in summary:
        u = summary["ulysses"]
        table(f"Ulysses, {u['model']} at {u['size']} px", ["case", "ms"], [[case, ms] for case, ms in u["ms"].items()])
        lines.append(f"degree 2 over degree 1 on one thread: {u['speedup_over_one_thread']:.2f}x; "
                     f"over one process on two threads: {u['over_two_threads']:.2f} of its time; "
                     f"collectives {100 * u['collective_share']:.0f} %")
    return "\n".join(lines)
