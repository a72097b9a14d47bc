"""The adapter sections of a `gouache bench fullsize` child (`gouache.bench.fullsize_sections`):
LoRA rows (segmented, per adapter, merged), LoRA loading (synchronous and bounded asynchronous)
and a full-size ControlNet served sync and async."""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path


def lora(bench, size: int, names: dict[int, list[str]]) -> dict:
    """Four requests with four adapters each their own (segmented), then with one adapter all
    (merged: the runtime merges it in its first step), each against no adapter beside it; nothing
    merged outside the merged row. A row's `mode` is how the runtime applied its adapters."""
    from gouache.bench.interleaved import STEPS

    bench.schedule = STEPS  # a whole schedule ahead: the runtime merges a shared adapter when it pays
    modes: dict[str, set[str]] = {}

    def unmerged() -> None:
        for runner in bench.runners.values():
            runner.lora_runtime.merged.set(())

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
        rows[f"segmented rank {rank}"] = {v: bench.ratio(v, f"segmented rank {rank}", "no LoRA")
                                          for v in bench.variants}
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


def lora_loading(pipe, directory: Path, name: str, rank: int, size: int, quick: bool, repeats: int, sync) -> dict:
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
    warm = ModelRunner(pipe, lora=LoraConfig(str(directory)))
    warm.lora_runtime.store.load(name).result()

    def cold(bound: int) -> ModelRunner:  # a new store: nothing read yet
        return ModelRunner(pipe, lora=LoraConfig(str(directory), bound=bound))

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
            runner.lora_runtime.merged.set(())  # the shared pipeline's weights as loaded, for the next case
    seconds = {case: statistics.median(t) for case, t in times.items()}
    return {"size": size, "steps": steps, "bound": bound, "rank": rank,
            "file_mb": (directory / f"{name}.safetensors").stat().st_size / 2**20, "seconds": seconds,
            **{f"{case}_over_none": seconds[case] / seconds["none"] for case in ("in memory", "sync", "bal")}}


def controlnet(pipe, size: int, repeats: int, torch_threads: int, sync) -> dict:
    """Wall seconds of a step: plain, and with a full-size ControlNet served sync and async (the
    service and the base runner on one thread each), interleaved; `torch_threads` restored after."""
    import numpy as np
    import torch

    from gouache.bench.interleaved import request
    from gouache.config import ControlNetConfig
    from gouache.controlnet.model import Base, random_controlnet
    from gouache.controlnet.service import ControlService
    from gouache.runner.model_runner import ModelRunner
    from gouache.sched.plan import Batch

    torch.set_num_threads(1)
    directory = Path(tempfile.mkdtemp(prefix="gouache-fullsize-controlnet-"))
    service, runners = None, {}
    times: dict[str, list[float]] = {"plain": [], "sync": [], "async": []}
    try:
        random_controlnet(pipe, seed=0, std=0.02).save_pretrained(str(directory / "net"))
        service = ControlService(1, str(directory), Base.of(pipe), 16 << 30, threads=1)
        image = np.random.default_rng(0).integers(0, 256, (size, size, 3), dtype=np.uint8)
        for mode in times:
            config = None if mode == "plain" else ControlNetConfig(str(directory), 1, mode, service=service.address)
            runners[mode] = runner = ModelRunner(pipe, controlnet=config)
            fields = {} if mode == "plain" else {"controlnets": (("net", b"", 1.0),)}
            runner.prepare(request(mode, size, 0, 3 + repeats, **fields),
                           **({} if mode == "plain" else {"controls": [image]}))
        for rep in range(2 + repeats):  # two steps warm the service (and load the net)
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
        torch.set_num_threads(torch_threads)
    ms = {mode: statistics.median(t) for mode, t in times.items()}
    return {"size": size, "threads": 1, "ms": ms, "sync": ms["sync"] / ms["plain"], "async": ms["async"] / ms["plain"]}
