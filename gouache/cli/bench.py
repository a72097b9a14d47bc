"""`gouache bench KIND`: the benchmarks, one module of `gouache.bench` each."""

from __future__ import annotations

import argparse
from types import ModuleType


def kinds() -> dict[str, tuple[ModuleType, str]]:
    """kind -> (its module, its line in `gouache bench --help`), in that help's order."""
    from gouache.bench import (
        adapters,
        baselines,
        batching,
        edit,
        fidelity,
        fullsize,
        fuzz,
        overhead,
        parallel,
        reuse_compare,
        serve,
        sim_to_real,
        soak,
        speed,
        tiers,
        video,
    )

    return {
        "fuzz": (fuzz, "requests generated from the server's OpenAPI schema on every endpoint: 2xx or 4xx only"),
        "adapters": (adapters, "LoRA serving: loading bound, latency with uncached adapters (BAL), fidelity, "
                               "mixed-adapter throughput vs per-adapter batches"),
        "parallel": (parallel, "worker processes on this machine: executor overhead, collectives per step, hand-offs"),
        "sim-to-real": (sim_to_real, "live engine vs simulator on one workload"),
        "tiers": (tiers, "service tiers, preemption and tenants under overload, live and simulated"),
        "overhead": (overhead, "scheduling decision time vs queue length"),
        "serve": (serve, "load-test servers under several policies"),
        "soak": (soak, "overload each policy for minutes: lost requests, latency, memory, fds, leaked processes"),
        "baselines": (baselines, "gouache vs a plain diffusers server, serial and with static batching, under one "
                                 "load"),
        "speed": (speed, "eager vs compiled (vs int8) steps, and the seeds' savings under compile"),
        "fullsize": (fullsize, "the seeds' savings on the full-size architectures in bf16, against the matmul peak "
                               "(MFU)"),
        "batching": (batching, "step latency of mixed-size batches, patched vs grouped"),
        "fidelity": (fidelity, "a candidate configuration's images vs the exact ones: SSIM, PSNR, prompt alignment"),
        "edit": (edit, "mask-aware template edits: latency vs mask ratio, fidelity, throughput vs fcfs-static"),
        "reuse-compare": (reuse_compare, "the block cache's reuse predictor vs the threshold at equal SSIM, from "
                                         "fidelity runs"),
        "video": (video, "the block cache on a video model's clips, per clip and per token: per-frame SSIM, reuse, "
                         "step time"),
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    subparsers = p.add_subparsers(dest="bench", required=True, metavar="KIND")
    for kind, (module, help) in kinds().items():
        module.add_arguments(subparsers.add_parser(kind, help=help))


def run(args) -> int:
    return kinds()[args.bench][0].run(args)
