"""`gouache bench baselines`: gouache against what users build instead, from outside, one load.

Each server runs in a process of its own, one after the other, on the same trace: a plain
diffusers pipeline one request at a time (`diffusers-serial`), the same with static batching
of same-size requests arriving within 50 ms (`diffusers-static`, `gouache.bench.diffusers_server`),
and `gouache serve` (any flags: `--gouache-args`). Two phases per server, after one warm-up
request of every size:

- **burst**: `--burst` requests at once over the sizes (round robin): images per second from
  the first send to the last answer;
- **steady**: Poisson arrivals at `--rate` for `--duration` seconds, sizes drawn uniformly:
  latency percentiles, send to answer.

Every request is non-streaming, with the same prompt, steps and guidance. Prints a table,
writes JSON and markdown.

On a video model `--sizes` are clips, WxHxF (F frames), and each request is a video: POST
/v1/videos, then (gouache answers at once, `queued`) GET /v1/videos/{id} every `POLL_S` until it
is completed; the diffusers baselines answer once the clip is made. A video's latency is send to
the answer that says it is completed (its MP4 encoded), up to one poll late for gouache.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

from gouache.bench.serve import free_port, wait_healthy
from gouache.stats import percentile

SERVERS = ("diffusers-serial", "diffusers-static", "gouache")
DEFAULT_SIZES = "64x64,96x96,128x128,128x64,64x128"
PROMPT = "a red circle at the top left"
POLL_S = 0.05  # seconds between polls of a video's status


def add_arguments(p) -> None:
    p.add_argument("--model", default="shapes-unet", help="the model every server serves (default: %(default)s)")
    p.add_argument("--servers", default=",".join(SERVERS), help="comma-separated, of %(default)s")
    p.add_argument("--sizes", default=DEFAULT_SIZES,
                   help="WxH sizes of the load, or a video model's clips, WxHxF (default: %(default)s)")
    p.add_argument("--steps", type=int, default=20, help="denoising steps of every request (default: %(default)s)")
    p.add_argument("--guidance", type=float, default=3.0, help="guidance scale of every request (default: %(default)s)")
    p.add_argument("--burst", type=int, default=24, help="requests sent at once (default: %(default)s)")
    p.add_argument("--rate", type=float, default=1.0, help="steady arrivals per second, Poisson (default: %(default)s)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of steady arrivals (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the steady trace (default: %(default)s)")
    p.add_argument("--device", default="cpu", help="torch device every server runs its model on: cpu, cuda, cuda:1 "
                                                  "(default: %(default)s)")
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                   help="every server's weights and activations (default: %(default)s)")
    p.add_argument("--gouache-args", default="", help="extra `gouache serve` flags, e.g. '--compile' (default: none)")
    p.add_argument("--out", default="benchmarks/results/baselines_cpu.json",
                   help="JSON path; the table (.md) goes beside it (default: %(default)s)")


def run(args) -> int:
    servers = args.servers.split(",")
    unknown = sorted(set(servers) - set(SERVERS))
    if unknown:
        raise ValueError(f"unknown servers {unknown}; choose from {', '.join(SERVERS)}")
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]  # (w, h) or (w, h, frames)
    if len({len(size) for size in sizes}) > 1:
        raise ValueError(f"--sizes are all images (WxH) or all clips (WxHxF); got {args.sizes!r}")
    unit = "videos" if len(sizes[0]) == 3 else "images"
    rng = random.Random(args.seed)
    steady, t = [], rng.expovariate(args.rate)
    while t < args.duration:
        steady.append((t, rng.choice(sizes)))
        t += rng.expovariate(args.rate)
    burst = [(0.0, sizes[i % len(sizes)]) for i in range(args.burst)]
    rows = []
    for server in servers:
        proc, base_url = start(server, args)
        try:
            asyncio.run(load(base_url, [(0.0, size) for size in sizes], args))  # one of each size, untimed
            done, wall = asyncio.run(load(base_url, burst, args))
            burst_ok = [s for s in done if s is not None]
            done, _ = asyncio.run(load(base_url, steady, args))
            latencies = [s for s in done if s is not None]
            compiled = compile_counts(base_url) if server == "gouache" else {}
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        rows.append({"server": server, f"burst_{unit}_per_s": len(burst_ok) / wall, "burst_s": wall,
                     "burst_failed": len(burst) - len(burst_ok), "steady_requests": len(steady),
                     "steady_failed": len(steady) - len(latencies),
                     "p50_s": percentile(latencies, 50), "p95_s": percentile(latencies, 95),
                     "mean_s": sum(latencies) / max(len(latencies), 1), **compiled})
        print(f"{server}: done", file=sys.stderr)
    table = format_table(rows, unit)
    print(table)
    command = "gouache bench baselines " + " ".join(sys.argv[3:])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    machine = machine_name(args.device)
    out.write_text(json.dumps({"command": command.strip(), "model": args.model, "machine": machine,
                               "device": args.device, "dtype": args.dtype,
                               "sizes": args.sizes, "steps": args.steps, "burst": args.burst, "rate": args.rate,
                               "duration_s": args.duration, "results": rows}, indent=2) + "\n")
    out.with_suffix(".md").write_text(f"`{command.strip()}` on {machine}\n\n{table}\n")
    print(f"wrote {out}, {out.with_suffix('.md')}")
    return 0


def machine_name(device: str) -> str:
    """What ran the servers: the GPU's name where they ran on one, else the CPU's cores."""
    if device.startswith("cuda"):
        import torch

        return f"{torch.cuda.get_device_name(torch.device(device))} ({os.cpu_count()} CPU cores)"
    return f"{os.cpu_count()} CPU cores"


def start(server: str, args) -> tuple[subprocess.Popen, str]:
    port = free_port()
    if server == "gouache":
        command = [sys.executable, "-m", "gouache.cli", "serve", "--model", args.model, "--port", str(port),
                   "--max-queue-len", "1000", "--device", args.device, "--dtype", args.dtype,
                   *args.gouache_args.split()]
    else:
        command = [sys.executable, "-m", "gouache.bench.diffusers_server", "--model", args.model, "--port", str(port),
                   "--mode", server.removeprefix("diffusers-"), "--device", args.device, "--dtype", args.dtype]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base_url = f"http://127.0.0.1:{port}"
    if not wait_healthy(proc, base_url, timeout_s=900):
        proc.kill()
        raise RuntimeError(f"{server} did not become healthy: {proc.stderr.read()[-2000:]}")
    return proc, base_url


async def load(base_url: str, trace: list[tuple[float, tuple[int, ...]]], args) -> tuple[list[float | None], float]:
    """Send each (at seconds, (w, h) or a clip's (w, h, frames)) request at its time; each one's
    seconds to its answer (None if it failed), and the seconds from the start to the last answer."""
    async with httpx.AsyncClient(base_url=base_url, timeout=1200) as client:
        start = time.perf_counter()

        async def one(i: int, at: float, size: tuple[int, ...]) -> float | None:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
            body = {"prompt": PROMPT, "model": args.model, "size": f"{size[0]}x{size[1]}", "seed": i,
                    "num_inference_steps": args.steps, "guidance_scale": args.guidance}
            sent = time.perf_counter()
            if len(size) == 3:
                done = await made_video(client, {**body, "num_frames": size[2]})
            else:
                done = (await client.post("/v1/images/generations", json=body)).status_code == 200
            return time.perf_counter() - sent if done else None

        done = await asyncio.gather(*(one(i, at, size) for i, (at, size) in enumerate(trace)))
        return list(done), time.perf_counter() - start


async def made_video(client: httpx.AsyncClient, body: dict) -> bool:
    """Create a video and poll it until it is made: whether it was completed."""
    response = await client.post("/v1/videos", json=body)
    if response.status_code != 200:
        return False
    video = response.json()
    while video["status"] in ("queued", "in_progress"):
        await asyncio.sleep(POLL_S)
        video = (await client.get(f"/v1/videos/{video['id']}")).json()
    return video["status"] == "completed"


def compile_counts(base_url: str) -> dict:
    """Under --compile, what /metrics says of the run: steps by path and why, graphs compiled
    after the warm-up (a steady load of the warmed sizes makes none); {} without --compile."""
    steps, recompiles = {}, None
    for line in httpx.get(f"{base_url}/metrics", timeout=10).text.splitlines():
        if line.startswith("gouache_compile_steps_total{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            steps[f"{labels['path']} {labels['reason']}".strip()] = float(line.split()[-1])
        elif line.startswith("gouache_compile_recompiles_total "):
            recompiles = float(line.split()[-1])
    return {"compile_steps": steps, "recompiles": recompiles} if steps else {}


def format_table(rows: list[dict], unit: str = "images") -> str:
    lines = [f"| server | burst {unit}/s | burst s | steady p50 s | steady p95 s | steady mean s | failed |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['server']} | {r[f'burst_{unit}_per_s']:.2f} | {r['burst_s']:.1f} | {r['p50_s']:.2f} | "
                     f"{r['p95_s']:.2f} | {r['mean_s']:.2f} | {r['burst_failed'] + r['steady_failed']} |")
    compiled = [r for r in rows if r.get("compile_steps")]
    for r in compiled:
        paths = ", ".join(f"{path}: {n:g}" for path, n in r["compile_steps"].items())
        lines.append(f"\n{r['server']} under --compile: steps {paths}; graphs compiled after the warm-up: "
                     f"{r['recompiles']:g}")
    return "\n".join(lines)
