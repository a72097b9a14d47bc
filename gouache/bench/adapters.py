"""`gouache bench adapters`: what LoRA serving costs, and what bounded asynchronous loading
(BAL, KATZ §6) gives and takes, on one model in one run.

On a model that only edits (shapes-edit) every request is an instruction edit of a shapes scene
(every kind in turn), and the workflow mixes (generations) are not run.

- **Bound.** K for the trained adapter (`--lora`, default the model's palette style: each shape
  drawn in the next colour), as `gouache profile-lora` finds it.
- **Latency** (in-process runner, one request at a time): a request without adapters, with its
  adapter in host memory, and with an adapter not in memory, loaded synchronously (K = 0) and
  with BAL at K. Reading a file from this machine's page cache takes milliseconds, far less
  than an adapter of a real model from its store (KATZ: a 341 MiB LoRA), so the read is made
  to last a share (`--load-shares`) of the plain request's latency: the storage is emulated,
  the loading thread, the joining and the waiting are the server's own.
- **Fidelity** of BAL at its worst: the adapter arrives exactly at step K. Against synchronous
  loading: SSIM, and how often the checker sees the adapter's effect (a shape found in the
  style's colour for the one asked, e.g. green for red); the base model's rate beside them. For
  instruction edits also carried out, rest kept and both, against the edit as the adapter
  draws it (`train.lora.restyle_edit`).
- **Workflow mixes** (KATZ's mC/nL: m ControlNets, n LoRAs): a request's latency served
  sequentially, as a diffusers pipeline serves it, against the ControlNet service and BAL
  (`gouache.bench.workflows`).
- **Throughput** (in-process engine, Poisson arrivals): every request picks one of
  `--adapters` random adapters by Zipf popularity; requests of different adapters in one
  forward (gouache) against a forward per adapter set (`per-adapter`, what servers that keep
  adapters in separate batches do), and the same load without adapters. Adapters are read
  before the clock starts.

Writes JSON, a markdown table, a plot (latency ratio vs emulated load time; the mixes) and a
contact sheet of the first fidelity prompts (`..._sheet.png`).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from gouache.bench import workflows
from gouache.bench.fidelity import edit_rates, ssim
from gouache.bench.load import run_load
from gouache.bench.prompts import encoded_upload
from gouache.bench.results import write_results
from gouache.bench.sheet import contact_sheet, difference
from gouache.data.checker import check, check_edit
from gouache.data.prompts import Prompt, shapes_prompts
from gouache.data.shapes import Scene, Shape

SHEET_ROWS = 8  # fidelity prompts on the contact sheet
# a generation's latency cases: one shape, whatever the caption (text is padded to one length)
LATENCY_SCENE = Scene((Shape("circle", "red", "center"),), "white")


def add_arguments(p) -> None:
    p.add_argument("--model", default="shapes-unet",
                   help="built-in model name or local directory (default: %(default)s)")
    p.add_argument("--lora-dir", default=None, help="directory of --lora (default: the model's trained adapters)")
    p.add_argument("--lora", default="palette", help="the adapter whose bound, latency and fidelity are measured "
                                                     "(default: %(default)s)")
    p.add_argument("--size", type=int, default=128, help="pixels per side (default: %(default)s)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's)")
    p.add_argument("--threshold", type=float, default=0.99, help="profile-lora's threshold (default: %(default)s)")
    p.add_argument("--load-shares", default="0.1,0.25,0.5",
                   help="emulated adapter read times, as shares of a plain request's latency (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=7, help="requests per latency case, the cases in turn; medians "
                                                         "(default: %(default)s)")
    p.add_argument("--fidelity", type=int, default=24, help="prompts of the fidelity comparison (default: %(default)s)")
    p.add_argument("--requests", type=int, default=32,
                   help="requests of the throughput load, 0: none (default: %(default)s)")
    p.add_argument("--adapters", type=int, default=50, help="random adapters of the load (default: %(default)s)")
    p.add_argument("--zipf", type=float, default=1.0, help="popularity exponent of the adapters (default: %(default)s)")
    p.add_argument("--rate", type=float, default=None, help="arrivals per second (default: 3 / plain request latency)")
    p.add_argument("--torch-threads", type=int, default=None, help="intra-op threads of torch (default: torch's)")
    workflows.add_arguments(p)
    p.add_argument("--out", default=None,
                   help="JSON to write; .md, .png and the contact sheet _sheet.png beside it "
                        "(default: benchmarks/results/adapters/adapters_<model>.json)")


def run(args) -> int:
    import torch

    from gouache.models.zoo import load_pipeline
    from gouache.runner.describe import model_info
    from gouache.train.lora import lora_dir

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    workflows.check_flags(args)
    out = Path(args.out or f"benchmarks/results/adapters/adapters_{args.model}.json")
    shares = [float(s) for s in args.load_shares.split(",")]
    if not all(s > 0 for s in shares):
        raise ValueError(f"--load-shares must be positive, got {args.load_shares!r}")
    directory = Path(args.lora_dir) if args.lora_dir else lora_dir(args.model)
    if not (directory / f"{args.lora}.safetensors").is_file():
        raise ValueError(f"no {args.lora}.safetensors in {directory}; give --lora-dir and --lora (`gouache train lora` "
                         "writes the shapes UNet's, `gouache train edit-lora` shapes-edit's)")
    pipe = load_pipeline(args.model)
    info = model_info(pipe, args.model)
    if args.mixes is None:  # the default: none on a model that only edits
        args.mixes = workflows.MIXES if info.generation else ""
        workflows.check_flags(args)
    elif args.mixes and not info.generation:
        raise ValueError(f"--mixes: the workflow mixes are text-to-image generations (with ControlNets and "
                         f"LoRAs); {args.model} only edits (give --mixes '')")
    steps = args.steps or info.default_steps
    bench = Bench(pipe, info, directory, args.lora, args.size, steps)
    prompts = shapes_prompts(not info.generation, max(args.fidelity, 4), args.size, random.Random("adapters"))
    similarity, bound = bench.bound(prompts[:4], args.threshold)
    latency_prompt = prompts[0] if prompts[0].edit else Prompt(LATENCY_SCENE, args.size, args.size, seed=0)
    result = {"command": "gouache bench adapters " + " ".join(sys.argv[3:]), "model": args.model, "lora": args.lora,
              "device": "cpu", "torch_threads": torch.get_num_threads(), "size": args.size, "steps": steps,
              "threshold": args.threshold, "similarity": similarity, "bound": bound,
              "prompts": "captions" if info.generation else "instruction edits",
              "latency": bench.latency(latency_prompt, bound, shares, args.repeats)}
    if args.fidelity:
        result["fidelity"] = bench.fidelity(prompts[: args.fidelity], sorted({bound, steps // 4, steps // 2}),
                                            out.with_name(out.stem + "_sheet.png"))
    if args.mixes:
        result["workflows"] = workflows.workflows(bench, args, bound)
    if args.requests:
        rate = args.rate or 3 / result["latency"]["none_s"]
        result["throughput"] = throughput(args, info, steps, rate)
    write_results(out, result, report(result), lambda path: plot(result, path))
    return 0


class Bench:
    """One adapter of one model, on in-process runners, one request at a time."""

    def __init__(self, pipe, info, directory: Path, lora: str, size: int, steps: int):
        self.pipe, self.info, self.directory, self.lora = pipe, info, directory, lora
        self.size, self.steps = size, steps
        self._ids = 0

    def runner(self, bound: int = 0, read_s: float = 0.0, gate: threading.Event | None = None,
               directory: Path | None = None, controlnet=None):
        """A runner whose adapter reads take `read_s` longer, or wait for `gate` (cold: a new
        store), with the adapters of `directory` (default: the bench's) and `controlnets`."""
        from gouache.config import LoraConfig
        from gouache.lora.store import LoraStore
        from gouache.runner.model_runner import ModelRunner

        class SlowStore(LoraStore):  # storage slower than the page cache, emulated
            def _read(self, *args):
                time.sleep(read_s)
                if gate is not None:
                    gate.wait()
                return super()._read(*args)

        directory = directory or self.directory
        runner = ModelRunner(self.pipe, lora=LoraConfig(str(directory), bound=bound), controlnet=controlnet)
        runner.lora_runtime.store = SlowStore(directory, self.pipe)
        return runner

    def generate(self, runner, prompt: Prompt, loras=(), controls=(), on_step=None) -> tuple[np.ndarray, float]:
        """(image, seconds from preparation to decoded image) of one request (an edit's upload
        with it); `controls`: its ControlNets (name, conditioning image, scale)."""
        from gouache.sched.plan import Batch

        self._ids += 1
        rid = f"bench-{self._ids}"
        start = time.perf_counter()
        request, upload = prompt.prepared(rid, self.steps, self.info.default_guidance, loras=tuple(loras),
                                          controlnets=tuple((name, b"", scale) for name, _, scale in controls))
        state = runner.prepare(request, upload, controls=[image for _, image, _ in controls])
        denoising = runner.states[rid]
        while not denoising.done:
            if on_step is not None:
                on_step(denoising.step)
            out = runner.execute(Batch((rid,)))
            if out.failed:
                raise RuntimeError(f"request failed: {out.failed[rid]}")
        image = runner.decode(state.request_id)
        runner.release(rid)
        return image, time.perf_counter() - start

    def bound(self, prompts: list[Prompt], threshold: float) -> tuple[list[float], int]:
        from gouache.profile.lora import first_below, similarities

        runner = self.runner()
        similarity = similarities(runner, self.info, ((self.lora, 1.0),), prompts, self.steps)
        return [round(s, 5) for s in similarity], first_below(similarity, threshold)

    def latency(self, prompt: Prompt, bound: int, shares: list[float], repeats: int) -> dict:
        """Median seconds of each case of `prompt` (the k-th repeat with seed k); the cases take
        turns within every repeat, so that a shared machine's drift falls on all of them alike."""
        loras = ((self.lora, 1.0),)
        warm = self.runner()
        warm.lora_runtime.store.load(self.lora).result()
        cases = {"none": (lambda: warm, ()), "cached": (lambda: warm, loras)}
        for share in shares:
            cases[f"sync {share}"] = (lambda share=share: self.runner(0, share * none_s), loras)
            cases[f"bal {share}"] = (lambda share=share: self.runner(bound, share * none_s), loras)
        none_s = self.generate(warm, replace(prompt, seed=0))[1]  # a warm-up, and the scale of the emulated reads
        runs: dict[str, list[float]] = {case: [] for case in cases}
        for k in range(repeats):
            for case, (runner_of, adapters) in cases.items():
                warm.lora_runtime.merged.set(())  # every case starts from a server with nothing merged
                runs[case].append(self.generate(runner_of(), replace(prompt, seed=k), adapters)[1])
        seconds = {case: statistics.median(times) for case, times in runs.items()}
        plain = seconds["none"]
        rows = [{"load_share": share, "read_s": share * none_s, "sync_s": seconds[f"sync {share}"],
                 "bal_s": seconds[f"bal {share}"], "sync_ratio": seconds[f"sync {share}"] / plain,
                 "bal_ratio": seconds[f"bal {share}"] / plain} for share in shares]
        return {"none_s": plain, "cached_s": seconds["cached"], "cached_ratio": seconds["cached"] / plain,
                "bound": bound, "repeats": repeats, "rows": rows}

    def fidelity(self, prompts: list[Prompt], bounds: list[int], sheet: Path) -> dict:
        """The adapter from step 0 against the adapter arriving at step K (BAL's worst case); the
        first SHEET_ROWS prompts' images on a contact sheet at `sheet`."""
        loras = ((self.lora, 1.0),)
        base, sync = self.runner(), self.runner()
        sync.lora_runtime.store.load(self.lora).result()
        images = {"base": [], "sync": []}
        for prompt in prompts:
            images["base"].append(self.generate(base, prompt)[0])
            images["sync"].append(self.generate(sync, prompt, loras)[0])
        rows, lates = [], []
        for bound in bounds:
            late = []
            for prompt in prompts:
                gate = threading.Event()
                runner = self.runner(bound, gate=gate)
                late.append(self.generate(runner, prompt, loras, on_step=lambda step: step >= bound and gate.set())[0])
            lates.append(late)
            rows.append({"bound": bound, "effect_seen": _seen(late, prompts), **_styled_edits(late, prompts),
                         "ssim_mean": statistics.mean(ssim(a, b) for a, b in zip(late, images["sync"])),
                         "ssim_min": min(ssim(a, b) for a, b in zip(late, images["sync"]))})
        write_sheet(prompts, images, dict(zip(bounds, lates)), sheet)
        seen = _seen(images["sync"], prompts)
        for row in rows:
            row["kept"] = row["effect_seen"] / seen if seen else None
        return {"prompts": len(prompts), "base_seen": _seen(images["base"], prompts), "sync_seen": seen,
                **{f"sync_{key}": value for key, value in _styled_edits(images["sync"], prompts).items()}, "rows": rows}


def write_sheet(prompts: list[Prompt], images: dict[str, list[np.ndarray]], late: dict[int, list[np.ndarray]],
                path: Path) -> None:
    """[upload |] without the adapter | adapter from step 0 | arriving at each step K | |step 0 -
    the latest| x4, one row per prompt (its caption or instruction under it)."""
    edits = prompts[0].edit is not None
    last = max(late)
    titles = (["upload"] if edits else []) + ["without the adapter", "adapter from step 0"] + [
        f"adapter arriving at step {bound}" for bound in late] + [f"|step 0 - step {last}| x4"]
    rows = []
    for k, prompt in enumerate(prompts[:SHEET_ROWS]):
        shown = [images["base"][k], images["sync"][k], *(late[bound][k] for bound in late),
                 difference(images["sync"][k], late[last][k])]
        rows.append(([prompt.upload(), *shown] if edits else shown, prompt.caption))
    contact_sheet(titles, rows, path)


def _seen(images: list[np.ndarray], prompts: list[Prompt]) -> float:
    """The share of asked shapes (an edit's: its target's) the checker finds in the style's colour
    in their own cell (of any kind): in another cell it may be another shape asked in that colour."""
    from gouache.train.lora import restyle

    found = [shape.colour_ok and shape.position_ok for image, prompt in zip(images, prompts)
             for shape in check(image, restyle(prompt.scene)).shapes]
    return sum(found) / len(found)


def _styled_edits(images: list[np.ndarray], prompts: list[Prompt]) -> dict:
    """For instruction edits, {"rates": carried out, rest kept and both}, judged against each edit
    as the adapter draws it (`restyle_edit`); {} for generations."""
    from gouache.train.lora import restyle_edit

    if prompts[0].edit is None:
        return {}
    return {"rates": edit_rates([check_edit(image, restyle_edit(p.edit)) for image, p in zip(images, prompts)])}


def throughput(args, info, steps: int, rate: float) -> dict:
    """The same Zipf-over-adapters Poisson load, adapters mixed in a forward and per adapter."""
    import tempfile

    from safetensors.torch import save_file

    from gouache.lora.files import random_lora
    from gouache.models.zoo import load_pipeline

    pipe = load_pipeline(args.model)
    rng = random.Random("adapters-load")
    weights = [1 / (i + 1) ** args.zipf for i in range(args.adapters)]
    load = [(rng.expovariate(rate), rng.choices(range(args.adapters), weights)[0],
             shapes_prompts(not info.generation, 1, args.size, rng, start=k)[0]) for k in range(args.requests)]
    runs = {}
    with tempfile.TemporaryDirectory(prefix="gouache-loras-") as directory:
        for i in range(args.adapters):
            save_file(random_lora(pipe, rank=8, seed=i), f"{directory}/a{i}.safetensors")
        for batching in ("mixed", "per-adapter", "none"):  # none: the same load without adapters
            runs[batching] = asyncio.run(_serve(args, info, steps, directory, batching, load))
    mixed, split = runs["mixed"], runs["per-adapter"]
    return {"requests": args.requests, "adapters": args.adapters, "zipf": args.zipf, "rate_per_s": rate, "runs": runs,
            "distinct_adapters": len({a for _, a, _ in load}),
            "throughput_ratio": mixed["per_s"] / split["per_s"],
            "latency_ratio": mixed["mean_latency_s"] / split["mean_latency_s"],
            "throughput_vs_none": mixed["per_s"] / runs["none"]["per_s"]}


async def _serve(args, info, steps: int, directory: str, batching: str, load) -> dict:
    from gouache.config import EngineConfig, LoraConfig, ModelConfig, SchedulerConfig
    from gouache.engine.build import build_engine
    from gouache.request import ImageRequest

    adapters = batching != "none"
    config = EngineConfig(max_queue_len=len(load) + 1, torch_threads=args.torch_threads,
                          lora=LoraConfig(directory, batching=batching if adapters else "mixed"))
    engine = build_engine(ModelConfig(args.model), config, SchedulerConfig(policy="orca"))
    await engine.start()
    try:
        for name in {a for _, a, _ in load} if adapters else ():
            await engine.register_lora(f"a{name}")  # read before the clock starts: batching alone is measured

        def job(k, adapter, prompt: Prompt):
            upload = encoded_upload(prompt)  # before the clock
            return lambda: [ImageRequest(f"load-{k}-0", prompt.caption, args.size, args.size, steps,
                                         info.default_guidance, k, image=upload,
                                         loras=((f"a{adapter}", 1.0),) if adapters else (),
                                         arrival_time=time.monotonic())]

        measured = await run_load(engine, [(gap, job(k, a, p)) for k, (gap, a, p) in enumerate(load)])
        modes = {s.labels["mode"]: s.value for m in engine.metrics.registry.collect() if m.name == "gouache_lora_steps"
                 for s in m.samples if s.name.endswith("_total")}
    finally:
        await engine.aclose()
    return {"batching": batching, **measured, "steps_by_mode": modes}


def report(result: dict) -> str:
    lat = result["latency"]
    lines = [f"{result['model']} at {result['size']} px, {result['steps']} steps, adapter {result['lora']!r}: "
             f"bound K = {result['bound']} (cosine < {result['threshold']})", "",
             f"plain request {lat['none_s']:.3f} s; adapter in host memory {lat['cached_ratio']:.2f}x", "",
             "| emulated read (share of plain) | read s | synchronous / plain | BAL at K / plain |",
             "|---|---|---|---|"]
    lines += [f"| {r['load_share']:g} | {r['read_s']:.3f} | {r['sync_ratio']:.2f} | {r['bal_ratio']:.2f} |"
              for r in lat["rows"]]
    if "fidelity" in result:
        fid = result["fidelity"]
        lines += ["", f"Fidelity, {fid['prompts']} {result['prompts']}: the checker finds {fid['sync_seen']:.0%} "
                      f"of the shapes in the style's colour with the adapter from step 0, {fid['base_seen']:.0%} "
                      "without it.", "",
                  "| adapter arrives at step | style seen | kept vs synchronous | SSIM vs synchronous mean (min) |",
                  "|---|---|---|---|"]
        lines += [f"| {r['bound']} | {r['effect_seen']:.0%} "
                  f"| {'n/a' if r['kept'] is None else format(r['kept'], '.2f')} "
                  f"| {r['ssim_mean']:.3f} ({r['ssim_min']:.3f}) |" for r in fid["rows"]]
        if "sync_rates" in fid:
            lines += ["", "The instruction edits, judged as the adapter draws them (restyled): carried out, rest kept, "
                          "both:", "", "| adapter arrives at step | carried out | rest kept | both |",
                      "|---|---|---|---|"]
            shown = [("0 (synchronous)", fid["sync_rates"]), *[(str(r["bound"]), r["rates"]) for r in fid["rows"]]]
            keys = ("carried_out", "rest_kept", "all")
            lines += [f"| {label} | " + " | ".join(f"{100 * rates[k]:.0f} %" for k in keys) + " |"
                      for label, rates in shown]
    if "workflows" in result:
        lines += workflows.report(result["workflows"])
    if "throughput" in result:
        tp = result["throughput"]
        lines += ["", f"Throughput, {tp['requests']} requests over {tp['distinct_adapters']} of {tp['adapters']} "
                      f"adapters (Zipf {tp['zipf']:g}), Poisson {tp['rate_per_s']:.2f}/s:", "",
                  "| batching | requests/s | mean latency s | p90 s | steps by mode |", "|---|---|---|---|---|"]
        lines += [f"| {name} | {r['per_s']:.2f} | {r['mean_latency_s']:.2f} | {r['p90_latency_s']:.2f} | "
                  f"{', '.join(f'{m} {int(n)}' for m, n in sorted(r['steps_by_mode'].items()))} |"
                  for name, r in tp["runs"].items()]
        lines += ["", f"mixed / per-adapter: throughput {tp['throughput_ratio']:.2f}, mean latency "
                      f"{tp['latency_ratio']:.2f}; mixed / no adapters: throughput {tp['throughput_vs_none']:.2f}"]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["latency"]["rows"]
    mixes = "workflows" in result
    fig, axes = plt.subplots(1, 2 if mixes else 1, figsize=(10 if mixes else 5, 3.5))
    ax = axes[0] if mixes else axes
    if mixes:
        workflows.draw(axes[1], result["workflows"])
    shares = [r["load_share"] for r in rows]
    ax.plot(shares, [r["sync_ratio"] for r in rows], "o-", label="synchronous loading")
    ax.plot(shares, [r["bal_ratio"] for r in rows], "s-", label=f"BAL, K = {result['bound']}")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("adapter read time / plain request latency (emulated)")
    ax.set_ylabel("latency / plain request")
    ax.set_title(f"{result['model']} {result['size']} px, uncached adapter, CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
