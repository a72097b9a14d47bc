"""What a `gouache bench fullsize` child measures of one model (or Ulysses), section by section,
each emitted as it ends; the sections are described in `gouache.bench.fullsize`. The adapters'
sections (LoRA, LoRA loading, ControlNet) are in `gouache.bench.fullsize_adapters`."""

from __future__ import annotations

import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from gouache.bench.fullsize_adapters import controlnet, lora, lora_loading
from gouache.bench.interleaved import request
from gouache.uploads import EditMask, Upload

STARTED = time.perf_counter()  # a child's log says when each section ended
QUANTIZED = ("int8", "fp8")  # variants over a quantized copy of the denoiser (`variant_pipes`), eager or compiled
COMPILED = ("compiled", *(f"compiled+{kind}" for kind in QUANTIZED))  # the variants that compile
# graphs a compiled variant warms up at most: its row graphs (a size and row bucket each), then a DiT's
# token and replay buckets; 8 left sd3-arch's packed and replay steps at 256+512 px none (they ran eagerly)
GRAPHS = 16


def emit(rows: dict) -> None:
    """(In a child) rows just measured, a JSON line on stdout for the parent, and the time so far."""
    print(json.dumps(rows), flush=True)
    print(f"{', '.join(rows)}: measured at {time.perf_counter() - STARTED:.0f} s", file=sys.stderr, flush=True)


def device_sync(device: str):
    """What waits for `device`'s queued work: nothing on the CPU."""
    import torch

    return (lambda: torch.cuda.synchronize(device)) if device.startswith("cuda") else (lambda: None)


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
        emit({"controlnet": controlnet(pipe, args.sizes[0], args.repeats, args.torch_threads,
                                        device_sync(args.device))})


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
        names = {}  # adapters only where a section serves them (a full-size one takes seconds to write and load)
        for rank in args.ranks if {"lora", "lora_loading"} - set(args.skip) else ():
            names[rank] = [f"r{rank}-{i}" for i in range(4)]
            for i, name in enumerate(names[rank]):
                save_file(random_lora(pipe, rank=rank, seed=100 * rank + i), str(loras / f"{name}.safetensors"))
        # the copies made before any runner hooks pipe
        runners, pipes = {}, variant_pipes(pipe, args.variants.split(","))
        # a template in the GPU's memory, as a GPU server would hold a hot one (sd3-arch records 12 GB at 1024 px)
        templates = TemplateConfig(host_bytes=8 << 30, device_bytes=(64 << 30) if args.device.startswith("cuda") else 0)
        rows = None  # a request's rows (two with CFG), from the eager runner, built first
        for variant in sorted(args.variants.split(","), key=lambda v: v != "eager"):
            compile = None
            if variant in COMPILED:
                buckets, compiled_sizes = compile_plan(args, rows)
                compile = CompileConfig(enabled=True, buckets=buckets, sizes=tuple((s, s) for s in compiled_sizes),
                                        cache_dir=args.compile_cache, backend=args.compile_backend,
                                        cuda_graphs=graphs_captured(args), graphs=args.compile_graphs or GRAPHS)
            runners[variant] = runner = ModelRunner(
                pipes[variant], lora=LoraConfig(str(loras)), templates=templates, compile=compile)
            runner.warm_up(small)
            rows = rows or (2 if runner.family.uses_cfg(request("rows", small, 0)) else 1)
            for name in runner.lora_runtime.store.names():
                runner.lora_runtime.store.load(name).result()
        bench = Interleaved(runners, args.repeats, steps, device_sync(args.device))
        print(f"runners and adapters ready at {time.perf_counter() - STARTED:.0f} s", file=sys.stderr, flush=True)

        def measured(rows: dict) -> None:  # a section's rows, and every step's ms and compile paths so far
            emit({**rows, "steps": bench.steps})

        if "mfu" not in args.skip:
            measured({"mfu": _mfu(bench, sizes)})
        if "patched" not in args.skip:
            measured({"patched": _patched(bench, args.mixes)})
        if "template" not in args.skip:
            template = _template(bench, large, args.masks, steps)
            measured({"template": template, "template_bytes": bench.runners["eager"].held().templates})  # per tier
        if "lora" not in args.skip:
            measured({"lora": lora(bench, small, names)})
        if "lora_loading" not in args.skip:
            rank = max(names)
            measured({"lora_loading": lora_loading(pipe, loras, names[rank][0], rank, small, args.quick,
                                                   bench.repeats, device_sync(args.device))})
        if "block_cache" not in args.skip:
            # a GPU's budget: at 1024 px sdxl-arch's per-patch rows passed 8 GiB and were all evicted (H200)
            budget = (64 << 30) if args.device.startswith("cuda") else 8 << 30
            measured({"block_cache": _block_cache(bench, large, args.mixes[0], args.share, unet, budget)})
        if "park" not in args.skip:
            measured({"park": _park(bench, large, device_sync(args.device))})
    finally:
        shutil.rmtree(loras, ignore_errors=True)


def compile_plan(args, rows: int) -> tuple[tuple[int, ...], list[int]]:
    """The compiled variant's row buckets and sizes (`rows`: a request's, two with CFG): those
    the sections measured step at, so that no graph is compiled for a section left out (on a GPU
    each costs tens of seconds). A DiT's packed forward of a mix runs in compiled pieces where
    the mix's sizes are compiled, its template replay where the edit's size is
    (`gouache.runner.pieces`)."""
    small, large = args.sizes[0], args.sizes[-1]
    measured = {  # section: the requests of its steps, the sizes they run at
        "mfu": ((1,), args.sizes),
        # two images of a size apart (grouped), a mix of them together
        "patched": ((2, 2 * max(map(len, args.mixes))), sorted({s for m in args.mixes for s in m})),
        "template": ((1,), [large]),
        "lora": ((1, 4), [small]),  # four requests together, or one per adapter
        "block_cache": ((2, 2 * len(args.mixes[0])), [large, *args.mixes[0]]),  # two at the largest size, a mix
    }
    buckets, sizes = set(), set()
    for section, (requests, at) in measured.items():
        if section not in args.skip:
            buckets.update(rows * n for n in requests)
            sizes.update(at)
    return tuple(sorted(buckets or {rows})), sorted(sizes or {small})


def graphs_captured(args) -> bool:
    """Whether the compiled variant captures CUDA graphs: on a GPU, with kernels generated."""
    return args.device.startswith("cuda") and args.compile_backend == "inductor"


def variant_pipes(pipe, variants: list[str]) -> dict:
    """Each variant's pipeline: `pipe` itself, or for int8 and fp8 (eager or compiled) one sharing
    every component of `pipe` but its denoiser, a quantized copy."""
    import copy

    from gouache.runner.quantize import quantize

    name = "unet" if getattr(pipe, "unet", None) is not None else "transformer"
    pipes = {}
    for variant in variants:
        kind = variant.removeprefix("compiled+")
        pipes[variant] = (quantize(type(pipe)(**{**pipe.components, name: copy.deepcopy(getattr(pipe, name))}), kind)
                          if kind in QUANTIZED else pipe)
    return pipes


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

    from gouache.bench.edit_cases import picture
    from gouache.data.shapes import sample_scene
    from gouache.profile.edits import centred_mask
    from gouache.sched.plan import Batch

    image = picture(sample_scene(random.Random(1)), size, seed=1)
    token = bench.runners["eager"].family.token_pixels
    blank = np.zeros_like(centred_mask(size, token, masks[0])[0])
    edit = {"image": b"-", "prompt": "a red circle", "template_id": "fullsize"}  # one prompt: its text rows replay too
    register = bench.prepare([(size, {**edit, "register_template": True})], Upload(image, EditMask(blank)))
    for _ in range(steps):  # the template: every step's activations recorded
        for runner in bench.runners.values():
            out = runner.execute(Batch(register))
            if out.failed:
                raise RuntimeError(f"recording the template: {out.failed}")
    bench.release(register)
    rows = {}
    for ratio in masks:
        mask, share = centred_mask(size, token, ratio)
        replay = bench.prepare([(size, {**edit, "template_cache": True})], Upload(image, EditMask(mask)))
        full = bench.prepare([(size, {**edit, "template_cache": False})], Upload(image, EditMask(mask)))
        bench.together({f"template edit {ratio}": ([replay], False), f"full edit {ratio}": ([full], False)})
        bench.release(replay, full)
        rows[str(ratio)] = {"tokens": share, **{v: bench.ratio(v, f"template edit {ratio}", f"full edit {ratio}")
                                                 for v in bench.variants}}
    return rows


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
    cases = [("image", [(size, {})] * 2, False),
             ("patch" if unet else "token", [(s, {}) for s in mix for _ in range(2)], True)]
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


def measure_ulysses(args) -> dict:
    """One request at the largest size: degree 1 in this process (one thread, then two) and
    degree 2 over two worker processes of one thread each, interleaved."""
    import torch

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
                target, batch = ((pool, Batch(("spread",), (0, 1))) if case == "degree 2"
                                 else (local, Batch(("alone",), (0,))))
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
