"""Fault drill for issue 32, item 3: a `fixed-sp-2` server loses one of its two workers.

Each run starts `gouache serve --model tiny-sd --policy fixed-sp-2 --executor multiproc
--devices 2`, sends a few requests at once, SIGKILLs one device's worker (found by its process
name, `gouache-dev-<rank>`) while the first of them runs, and checks within a bound that

- every request is answered (an error is fine: the one on the dead worker gets 500, the rest 503),
- /health no longer answers 200 "ok" (503 "dead", or the server has exited),
- a new request is answered 503 (or the server has exited, with status 1: its engine died).

Before the fix the waiting requests got no answer until the 600 s request timeout and /health
said ok. Prints one row per run and the pass count; `--out` also writes them as JSON.

    .venv/bin/python benchmarks/faults/fixed_sp_worker_death.py --runs 10
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from gouache.bench.server_process import descendants, server_process

SERVE = ["--model", "tiny-sd", "--policy", "fixed-sp-2", "--executor", "multiproc", "--devices", "2"]
EXIT_ENGINE_DIED = 1  # gouache.api.server.ENGINE_DIED


@dataclass
class RunResult:
    """What one run saw, and whether it passed."""

    answers: list[int | None] = field(default_factory=list)  # HTTP status of each request; None: none in time
    errors: list[str] = field(default_factory=list)  # the error message of each request answered with one
    health: int | None = None  # /health status after the kill; None: the server no longer answers
    health_status: str | None = None  # its body's "status"
    new_request: int | None = None  # HTTP status of a request sent after the kill; None: no answer
    exit_code: int | None = None  # the server's, once it exited; None: still running at the end
    answered_s: float = 0.0  # from the kill to the last answer
    passed: bool = False
    why: str = ""  # what failed, if anything


def worker_pid(server_pid: int, rank: int, timeout_s: float = 60) -> int:
    """The pid of device `rank`'s worker process below the server."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for pid in descendants(server_pid):
            try:
                if Path(f"/proc/{pid}/comm").read_text().strip() == f"gouache-dev-{rank}":
                    return pid
            except OSError:
                continue
        time.sleep(0.2)
    raise RuntimeError(f"no process named gouache-dev-{rank} below the server (pid {server_pid})")


def generate(url: str, seed: int, steps: int, timeout_s: float) -> tuple[int | None, str]:
    """(HTTP status, error message or "") of one generation; (None, why) without an answer."""
    body = {"model": "tiny-sd", "prompt": "a red circle", "size": "64x64", "num_inference_steps": steps, "seed": seed}
    try:
        response = httpx.post(f"{url}/v1/images/generations", json=body, timeout=timeout_s)
    except httpx.HTTPError as error:
        return None, f"{type(error).__name__}: {error}"
    if response.status_code == 200:
        return 200, ""
    try:
        return response.status_code, response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response.status_code, response.text[:500]


def wait_running(url: str, timeout_s: float) -> None:
    """Until the server says some request is running (so the kill lands mid-request)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/v1/status", timeout=2).json()["running"] > 0:
                return
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(0.05)
    raise RuntimeError(f"no request was running within {timeout_s:g} s")


def health(url: str) -> tuple[int | None, str | None]:
    try:
        response = httpx.get(f"{url}/health", timeout=5)
    except httpx.HTTPError:
        return None, None
    return response.status_code, response.json().get("status")


def one_run(args: argparse.Namespace, log_path: Path) -> RunResult:
    result = RunResult()
    with server_process([*SERVE, *args.serve], log_path) as (proc, url):
        victim = worker_pid(proc.pid, args.kill_rank)
        with ThreadPoolExecutor(args.requests) as pool:
            answers = [pool.submit(generate, url, seed, args.steps, args.bound_s + 30) for seed in range(args.requests)]
            wait_running(url, 60)
            os.kill(victim, signal.SIGKILL)
            killed = time.monotonic()
            result.answers, result.errors = (list(x) for x in zip(*(a.result() for a in answers)))
            result.answered_s = round(time.monotonic() - killed, 2)
        result.health, result.health_status = health(url)
        result.new_request = generate(url, 99, args.steps, timeout_s=30)[0]
        try:
            result.exit_code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    result.passed, result.why = judge(result, args.bound_s)
    return result


def judge(r: RunResult, bound_s: float) -> tuple[bool, str]:
    exited = r.exit_code == EXIT_ENGINE_DIED
    if None in r.answers or r.answered_s > bound_s:
        return False, f"not every request answered within {bound_s:g} s: {r.answers} after {r.answered_s} s"
    if r.health == 200 or r.health_status == "ok" or (r.health is None and not exited):
        return False, f"/health said {r.health} {r.health_status!r} after the kill"
    if r.new_request != 503 and not (r.new_request is None and exited):
        return False, f"a new request got {r.new_request} (the server's exit code: {r.exit_code})"
    if r.exit_code not in (None, EXIT_ENGINE_DIED):
        return False, f"the server exited with {r.exit_code}, not {EXIT_ENGINE_DIED}"
    return True, ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--requests", type=int, default=3, help="sent at once before the kill")
    parser.add_argument("--steps", type=int, default=60, help="denoising steps per request: the kill lands mid-run")
    parser.add_argument("--kill-rank", type=int, default=1, help="the device whose worker is killed")
    parser.add_argument("--bound-s", type=float, default=60.0,
                        help="every request must be answered this soon after the kill")
    parser.add_argument("--out", type=Path, help="also write the runs as JSON here")
    parser.add_argument("serve", nargs="*", help="more `gouache serve` flags, after --")
    args = parser.parse_args(argv)

    results = []
    print(f"{'run':>3}  {'answers':<18} {'health':<12} {'new':>4} {'exit':>4} {'answered_s':>10}  result")
    with tempfile.TemporaryDirectory() as logs:
        for run in range(args.runs):
            log_path = Path(logs) / f"serve-{run}.log"
            try:
                r = one_run(args, log_path)
            except Exception as error:  # a run that could not even start is a failed run, with its log
                r = RunResult(why=f"{type(error).__name__}: {error}; log tail: {log_path.read_text()[-1000:]}")
            results.append(r)
            print(f"{run:>3}  {str(r.answers):<18} {f'{r.health} {r.health_status}':<12} {str(r.new_request):>4} "
                  f"{str(r.exit_code):>4} {r.answered_s:>10}  {'pass' if r.passed else 'FAIL ' + r.why}", flush=True)
    passed = sum(r.passed for r in results)
    print(f"{passed}/{len(results)} runs passed")
    if args.out:
        args.out.write_text(json.dumps({"serve": [*SERVE, *args.serve], "passed": passed,
                                        "runs": [asdict(r) for r in results]}, indent=1))
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
