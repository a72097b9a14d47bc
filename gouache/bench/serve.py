"""`gouache bench serve`: the same Poisson load against a server per policy, in one run.

Each policy gets its own server process (same model, same port range); the arrival trace
(times, sizes, step counts, seeds) is drawn once from `--seed`, so every policy sees the
identical load. Requests stream, so the client sees when denoising starts (queueing time).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from tqdm import tqdm

from gouache.stats import percentile


@dataclass
class TraceItem:
    at: float  # seconds after the start of the run
    width: int
    height: int
    steps: int
    seed: int


@dataclass
class Sample:
    latency_s: float  # send -> last image
    queueing_s: float  # send -> first denoising step reported
    ok: bool


def add_arguments(p) -> None:
    p.add_argument("--model", default="tiny-sdxl", help="model each server serves (default: %(default)s)")
    p.add_argument("--policies", default="orca,fcfs-static",
                   help="comma-separated policies to compare (default: %(default)s)")
    p.add_argument("--rate", type=float, default=1.0,
                   help="mean arrivals in requests/s, Poisson (default: %(default)s)")
    p.add_argument("--requests", type=int, default=40, help="requests per policy (default: %(default)s)")
    p.add_argument("--sizes", default="256x256,384x384,256x384",
                   help="comma-separated WxH in pixels, drawn uniformly (default: %(default)s)")
    p.add_argument("--steps", default="10,20,30",
                   help="comma-separated step counts, drawn uniformly (default: %(default)s)")
    p.add_argument("--max-batch-size", type=int, default=8, help="each server's images per step (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival trace (default: %(default)s)")
    p.add_argument("--out", default="benchmarks/results/serve.json", help="JSON output path (default: %(default)s)")


def make_trace(n: int, rate: float, sizes: list[tuple[int, int]], steps: list[int], seed: int) -> list[TraceItem]:
    rng = random.Random(seed)
    t, trace = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        w, h = rng.choice(sizes)
        trace.append(TraceItem(round(t, 4), w, h, rng.choice(steps), seed * 1000 + i))
    return trace


def summarize(samples: list[Sample], wall_s: float) -> dict:
    ok = [s for s in samples if s.ok]
    lat = [s.latency_s for s in ok] or [float("nan")]
    que = [s.queueing_s for s in ok] or [float("nan")]
    return {
        "completed": len(ok),
        "failed": len(samples) - len(ok),
        "throughput_rps": len(ok) / wall_s,
        "latency_p50_s": percentile(lat, 50),
        "latency_p95_s": percentile(lat, 95),
        "latency_p99_s": percentile(lat, 99),
        "latency_mean_s": statistics.fmean(lat),
        "queueing_mean_s": statistics.fmean(que),
        "queueing_p50_s": percentile(que, 50),
        "queueing_p95_s": percentile(que, 95),
    }


async def _one(client: httpx.AsyncClient, item: TraceItem, model: str) -> Sample:
    body = {"prompt": "a red fox in the snow", "model": model, "size": f"{item.width}x{item.height}",
            "num_inference_steps": item.steps, "seed": item.seed, "stream": True}
    start = time.perf_counter()
    first_step = None
    ok = False
    async with client.stream("POST", "/v1/images/generations", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("event: gouache.progress") and first_step is None:
                first_step = time.perf_counter() - start
            elif line.startswith("event: image_generation.completed"):
                ok = True
    end = time.perf_counter() - start
    return Sample(end, first_step if first_step is not None else end, ok and response.status_code == 200)


async def drive(base_url: str, trace: list[TraceItem], model: str) -> tuple[list[Sample], float]:
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        bar = tqdm(total=len(trace), desc="requests", unit="req", disable=os.environ.get("CI") == "true")
        start = time.perf_counter()

        async def fire(item: TraceItem) -> Sample:
            await asyncio.sleep(max(0.0, item.at - (time.perf_counter() - start)))
            sample = await _one(client, item, model)
            bar.update()
            return sample

        samples = await asyncio.gather(*(fire(item) for item in trace))
        bar.close()
        return list(samples), time.perf_counter() - start


def scrape(base_url: str) -> dict:
    """Engine-side means from /metrics: queueing (arrival -> first step) and per-step overhead."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        values[name] = float(value) if value and not line.startswith("#") else values.get(name)
    out = {}
    for key, metric in (("engine_queueing_mean_s", "gouache_queueing_seconds"),
                        ("step_overhead_mean_ms", "gouache_step_overhead_seconds"),
                        ("step_latency_mean_ms", "gouache_step_latency_seconds")):
        count = values.get(f"{metric}_count") or 0.0
        mean = values.get(f"{metric}_sum", 0.0) / count if count else float("nan")
        out[key] = mean * (1000 if key.endswith("_ms") else 1)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, base_url: str, timeout_s: float = 300) -> bool:
    """Poll /health until it answers 200 (True), or the process exits or time runs out (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return False


def start_server(model: str, policy: str, max_batch: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "gouache.cli", "serve", "--model", model, "--policy", policy, "--port", str(port),
           "--max-batch-size", str(max_batch), "--max-queue-len", "1000"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base_url = f"http://127.0.0.1:{port}"
    if wait_healthy(proc, base_url):
        return proc, base_url
    if proc.poll() is not None:
        raise RuntimeError(f"server for {policy} exited: {proc.stderr.read()[-2000:]}")
    proc.kill()
    raise RuntimeError(f"server for {policy} did not become healthy in 300 s")


def bench_policy(model: str, policy: str, trace: list[TraceItem], max_batch: int) -> dict:
    proc, base_url = start_server(model, policy, max_batch)
    try:
        warmup = [TraceItem(0.0, trace[0].width, trace[0].height, 2, 0)]
        asyncio.run(drive(base_url, warmup, model))
        samples, wall = asyncio.run(drive(base_url, trace, model))
        return {"policy": policy, **summarize(samples, wall), **scrape(base_url)}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def format_table(rows: list[dict]) -> str:
    cols = [("policy", "policy", "{}"), ("done", "completed", "{}"), ("tput r/s", "throughput_rps", "{:.3f}"),
            ("p50 s", "latency_p50_s", "{:.2f}"), ("p95 s", "latency_p95_s", "{:.2f}"),
            ("p99 s", "latency_p99_s", "{:.2f}"), ("queue mean s", "queueing_mean_s", "{:.2f}"),
            ("queue p95 s", "queueing_p95_s", "{:.2f}"), ("overhead ms/step", "step_overhead_mean_ms", "{:.2f}")]
    lines = ["| " + " | ".join(c[0] for c in cols) + " |", "|" + "---|" * len(cols)]
    for row in rows:
        lines.append("| " + " | ".join(fmt.format(row[key]) for _, key, fmt in cols) + " |")
    return "\n".join(lines)


def run(args) -> int:
    from gouache.sched.policies import POLICIES

    policies = args.policies.split(",")
    unknown = [p for p in policies if p not in POLICIES]
    planned = [p for p in policies if p in POLICIES and POLICIES[p].needs_predictor]
    if unknown or planned:  # refused before any server starts, not as a server that never comes up
        raise ValueError(f"unknown policies {unknown}" if unknown else
                         f"{', '.join(planned)} need a cost model, which bench serve does not pass; "
                         "use `gouache bench soak --cost-model` or `gouache bench sim-to-real`")
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]
    steps = [int(s) for s in args.steps.split(",")]
    trace = make_trace(args.requests, args.rate, sizes, steps, args.seed)
    rows = [bench_policy(args.model, policy, trace, args.max_batch_size) for policy in policies]
    table = format_table(rows)
    print(table)
    command = "gouache bench serve " + " ".join(sys.argv[3:])
    result = {"command": command.strip(), "model": args.model, "rate": args.rate, "sizes": args.sizes,
              "steps": args.steps, "max_batch_size": args.max_batch_size, "machine": f"{os.cpu_count()} CPU cores",
              "trace": [asdict(t) for t in trace], "results": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    Path(args.out).with_suffix(".md").write_text(f"`{command.strip()}`\n\n{table}\n")
    print(f"wrote {args.out}")
    return 0
