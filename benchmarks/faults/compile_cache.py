"""Issue 57's compile-cache drill: a compiled server killed at a random moment of its warm-up
must not stop the next start on the same `--compile-cache`, and servers compiling at once on
one cache must all come up.

`--runs N` (kill runs): each run starts `gouache serve --compile --compile-cache DIR` on an
empty DIR in its own process group, SIGKILLs the whole group (as a pod kill does: the
compiler's processes too) at a moment drawn uniformly from the first `--kill-window-s` seconds of
its warm-up (`--truncate`: then also empties one kernel, the issue's reproduction), and starts
the same command again. A run passes when the restart is healthy within `--start-timeout-s`,
its image equals the eager server's (max pixel difference <= `TOLERANCE`), and its steps ran
compiled. The table counts the damaged kernels each restart moved aside.

`--concurrent`: two servers, one `--replicas 2` server and one with two worker processes
(`--executor multiproc --devices 2 --policy fixed-sp-1`: each request on one of them) start at
once on one empty cache; each must come up with the eager image.

    .venv/bin/python benchmarks/faults/compile_cache.py --runs 10 [--truncate] [--concurrent] [--out results.json]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

from gouache.bench.serve import free_port, wait_healthy

TOLERANCE = 2  # pixel levels of 255: compiled latents equal eager ones to 1e-4, rounding to 8 bits may differ by one
REQUEST = {"prompt": "a red circle at the top left and a blue square at the bottom right on a white background",
           "seed": 7, "response_format": "b64_json"}


@dataclass
class RunResult:
    run: int
    kind: str  # "kill" (killed in warm-up, then restarted) or the concurrent server's flags
    kill_at_s: float | None  # seconds after the start the first server was killed
    truncated: str | None  # the kernel emptied after the kill (--truncate)
    healthy_s: float | None  # the (re)start's time to /health; None: it did not come up
    moved_aside: int  # damaged kernels the (re)start moved aside
    compiled_steps: float  # steps that ran compiled (/metrics)
    compile_failed_steps: float  # steps that ran eagerly because a graph failed to compile
    max_diff: int | None  # largest pixel difference from the eager server's image
    error: str | None = None
    passed: bool = False


class Server:
    """A `gouache serve` in its own process group, logging to a file."""

    def __init__(self, args: argparse.Namespace, cache: Path, log: Path, extra: tuple[str, ...] = (), compile=True):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        flags = ["--compile", "--compile-cache", str(cache), "--compile-buckets", args.buckets] if compile else []
        cmd = [sys.executable, "-m", "gouache.cli", "serve", "--model", args.model, "--port", str(self.port),
               *flags, *extra]
        self.log_path = log
        self.log = log.open("w")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def healthy(self, timeout_s: float) -> float | None:
        return round(time.monotonic() - self.started, 1) if wait_healthy(self.proc, self.url, timeout_s) else None

    def image(self) -> np.ndarray:
        response = httpx.post(f"{self.url}/v1/images/generations", json={"model": self.model(), **REQUEST},
                              timeout=300)
        response.raise_for_status()
        data = base64.b64decode(response.json()["data"][0]["b64_json"])
        return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.int16)

    def model(self) -> str:
        return httpx.get(f"{self.url}/v1/models", timeout=10).json()["data"][0]["id"]

    def metric(self, name: str, **labels: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        want = ",".join(f'{k}="{v}"' for k, v in labels.items())
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith(name + ("{" + want if want else "")))

    def moved_aside(self) -> int:
        return len(re.findall("moved a damaged kernel aside", self.log_path.read_text()))

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


def check(server: Server, reference: np.ndarray, result: RunResult, timeout_s: float) -> None:
    result.healthy_s = server.healthy(timeout_s)
    result.moved_aside = server.moved_aside()
    if result.healthy_s is None:
        raise RuntimeError(f"did not come up:\n{server.log_path.read_text()[-2000:]}")
    result.max_diff = int(np.abs(server.image() - reference).max())
    result.compiled_steps = server.metric("gouache_compile_steps_total", path="compiled")
    result.compile_failed_steps = server.metric("gouache_compile_steps_total", path="eager", reason="compile_failed")
    result.passed = result.max_diff <= TOLERANCE and result.compiled_steps > 0 and not result.compile_failed_steps


def kill_run(args: argparse.Namespace, run: int, root: Path, reference: np.ndarray, rng: random.Random) -> RunResult:
    cache = root / f"cache-{run}"
    result = RunResult(run, "kill", round(rng.uniform(0.5, args.kill_window_s), 1), None, None, 0, 0, 0, None)
    first = Server(args, cache, root / f"run{run}-killed.log")
    try:
        time.sleep(result.kill_at_s)
    finally:
        first.kill()
    kernels = sorted(cache.rglob("*.so"))
    if args.truncate and kernels:
        victim = rng.choice(kernels)
        victim.write_bytes(b"")
        result.truncated = victim.name
    second = Server(args, cache, root / f"run{run}-restart.log")
    try:
        check(second, reference, result, args.start_timeout_s)
    except (RuntimeError, httpx.HTTPError) as error:
        result.error = f"{type(error).__name__}: {error}"
    finally:
        second.kill()
    return result


def concurrent_run(args: argparse.Namespace, root: Path, reference: np.ndarray) -> list[RunResult]:
    cache = root / "cache-concurrent"
    kinds = [(), (), ("--replicas", "2"), ("--executor", "multiproc", "--devices", "2", "--policy", "fixed-sp-1")]
    servers = [Server(args, cache, root / f"concurrent-{i}.log", extra) for i, extra in enumerate(kinds)]
    results = []
    try:
        for i, (server, extra) in enumerate(zip(servers, kinds)):
            result = RunResult(i, " ".join(extra) or "plain", None, None, None, 0, 0, 0, None)
            try:
                check(server, reference, result, args.start_timeout_s)
            except (RuntimeError, httpx.HTTPError) as error:
                result.error = f"{type(error).__name__}: {error}"
            results.append(result)
    finally:
        for server in servers:
            server.kill()
    return results


def print_row(r: RunResult) -> None:
    verdict = "pass" if r.passed else f"FAIL {r.error or ''}"[:200]
    print(f"{r.run:>3}  {r.kind:<52}  {r.kill_at_s if r.kill_at_s is not None else '':>8}  "
          f"{'yes' if r.truncated else '':>9}  {r.healthy_s if r.healthy_s is not None else 'no':>9}  "
          f"{r.moved_aside:>11}  {r.compiled_steps:>8g}  {r.compile_failed_steps:>6g}  "
          f"{r.max_diff if r.max_diff is not None else '':>8}  {verdict}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=10, help="kill runs (default: %(default)s)")
    p.add_argument("--model", default="shapes-unet")
    p.add_argument("--buckets", default="1,2", help="the servers' --compile-buckets")
    p.add_argument("--kill-window-s", type=float, default=60.0,
                   help="kills land uniformly in this many seconds after the start (shapes-unet's cold warm-up with "
                        "buckets 1,2 takes about 60 s on 2 cores)")
    p.add_argument("--truncate", action="store_true", help="also empty one kernel after each kill")
    p.add_argument("--concurrent", action="store_true", help="also start four compiled servers at once on one cache")
    p.add_argument("--start-timeout-s", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="also write the runs as JSON here")
    args = p.parse_args()
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="compile-cache-drill-"))
    eager = Server(args, root / "unused", root / "eager.log", compile=False)
    try:
        if eager.healthy(args.start_timeout_s) is None:
            raise SystemExit(f"the eager server did not start:\n{(root / 'eager.log').read_text()[-2000:]}")
        reference = eager.image()
    finally:
        eager.kill()
    print(f"{'run':>3}  {'kind':<52}  {'kill s':>8}  {'truncated':>9}  {'healthy s':>9}  {'moved aside':>11}  "
          f"{'compiled':>8}  {'failed':>6}  {'max diff':>8}  result")
    results = []
    for run in range(args.runs):
        results.append(kill_run(args, run, root, reference, rng))
        print_row(results[-1])
    if args.concurrent:
        for result in concurrent_run(args, root, reference):
            results.append(result)
            print_row(result)
    passed = sum(r.passed for r in results)
    print(f"{passed}/{len(results)} runs passed; logs in {root}" if passed < len(results) else
          f"{passed}/{len(results)} runs passed")
    if passed == len(results):
        shutil.rmtree(root, ignore_errors=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                        "runs": [asdict(r) for r in results]}, indent=2))
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
