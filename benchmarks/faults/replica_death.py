"""Issue 32's replica-death report, repeated: a replica killed (or hung) under streams must
not hang /v1/status nor the server's SIGTERM.

Each run starts a real `gouache serve --replicas 2` (in its own process group, with a TMPDIR
of its own so that what it leaves behind can be listed), streams requests until both replicas
are denoising, SIGKILLs one replica (`--fault stop`: SIGSTOPs it, a hung replica), calls
/v1/status `--status-delay-s` later with a timeout, then SIGTERMs the server and times its exit.
A run passes when the status answered in time and listed the faulty replica as not alive, every
stream ended (its images or an explicit error), the server exited 0 within its grace plus
`EXIT_MARGIN_S`, and neither a file under its TMPDIR (torch's compile cache aside) nor a process
of its tree was left.

    .venv/bin/python benchmarks/faults/replica_death.py --runs 10 [--fault stop] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from gouache.bench.serve import free_port, wait_healthy
from gouache.bench.server_process import ServerWatch

# beyond the grace, what a SIGTERM may take at worst: a hung replica's drain margin and close
# (`replicas.calls.Deadlines`, 10 s each), and the processes' exit
EXIT_MARGIN_S = 25.0
KEPT_BY_DESIGN = {"torchinductor_root"}  # torch's compile cache: made on import, kept for the next run
FAULTS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}
RUNNING_TIMEOUT_S = 60.0  # how long both replicas get to start denoising a stream before the run is void


@dataclass
class RunResult:
    run: int
    status_s: float | None  # how long /v1/status took to answer after the kill; None if it did not in time
    dead_listed: bool  # the status listed exactly one replica as not alive
    exit_s: float | None  # SIGTERM to the server's exit; None if it did not exit in time
    exit_code: int | None
    streams: dict[str, int] = field(default_factory=dict)  # outcome ("completed", an error code, "no end") -> count
    left_files: list[str] = field(default_factory=list)  # what the server left under its TMPDIR
    leaked: int = 0  # processes of the server's tree still alive after it exited
    second_sigterm: bool = False  # the first SIGTERM did not end the server in time, so a second was sent
    error: str | None = None  # why the run could not go through its scenario, if it could not
    passed: bool = False


class Stream(threading.Thread):
    """One streamed generation; `outcome` is "completed", the error's code, or "no end"."""

    def __init__(self, url: str, model: str, steps: int):
        super().__init__(daemon=True)
        self.url, self.body = url, {"model": model, "prompt": "a red circle", "size": "64x64", "stream": True,
                                    "num_inference_steps": steps}
        self.outcome = "no end"

    def run(self) -> None:
        event = ""
        try:
            with httpx.stream("POST", f"{self.url}/v1/images/generations", json=self.body, timeout=120) as response:
                if response.status_code != 200:
                    self.outcome = f"http {response.status_code}"
                    return
                for line in response.iter_lines():
                    if line.startswith("event: "):
                        event = line.removeprefix("event: ")
                    elif line.startswith("data: ") and event == "error":
                        self.outcome = json.loads(line.removeprefix("data: "))["error"]["code"]
                    elif line.startswith("data: ") and event.endswith(".completed"):
                        self.outcome = "completed"
        except httpx.HTTPError as error:
            self.outcome = f"{type(error).__name__}"


def children(pid: int) -> list[int]:
    """The direct children of `pid` (Linux: /proc)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                text = Path(f"/proc/{name}/stat").read_text()
            except OSError:
                continue
            if int(text[text.rindex(")") + 2:].split()[1]) == pid:
                found.append(int(name))
    return found


def replica_pids(server: int) -> list[int]:
    """The server's replica processes: its multiprocessing-spawned children (not the resource tracker)."""
    pids = []
    for pid in children(server):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "spawn_main" in cmdline:
            pids.append(pid)
    return sorted(pids)


def wait_both_running(url: str) -> None:
    deadline = time.monotonic() + RUNNING_TIMEOUT_S
    while time.monotonic() < deadline:
        replicas = httpx.get(f"{url}/v1/status", timeout=10).json()["replicas"]
        if all(any(r["status"] == "running" and r["step"] > 0 for r in replica.get("requests", []))
               for replica in replicas):
            return
        time.sleep(0.1)
    raise RuntimeError(f"the replicas were not both denoising within {RUNNING_TIMEOUT_S:g} s")


def one_run(args: argparse.Namespace, run: int) -> RunResult:
    root = Path(tempfile.mkdtemp(prefix="replica-death-"))
    tmp = root / "tmp"
    tmp.mkdir()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "gouache.cli", "serve", "--model", args.model, "--replicas", "2",
           "--shutdown-grace-s", str(args.grace_s), "--port", str(port)]
    log = (root / "server.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TMPDIR": str(tmp)},
                            start_new_session=True)
    result = RunResult(run, None, False, None, None)
    try:
        if not wait_healthy(proc, url):
            raise RuntimeError(f"the server did not start:\n{(root / 'server.log').read_text()[-2000:]}")
        watch = ServerWatch(proc.pid, url, interval_s=1.0)
        streams = [Stream(url, args.model, args.steps) for _ in range(args.streams)]
        for stream in streams:
            stream.start()
        wait_both_running(url)
        watch.sample("before the fault")
        os.kill(replica_pids(proc.pid)[0], FAULTS[args.fault])
        time.sleep(args.status_delay_s)
        start = time.monotonic()
        try:
            replicas = httpx.get(f"{url}/v1/status", timeout=args.status_timeout_s).json()["replicas"]
            result.status_s = round(time.monotonic() - start, 3)
            result.dead_listed = sorted(r["alive"] for r in replicas) == [False, True]
        except httpx.TimeoutException:
            pass
        watch.sample("before SIGTERM")
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            result.exit_code = proc.wait(timeout=args.grace_s + EXIT_MARGIN_S)
            result.exit_s = round(time.monotonic() - start, 2)
        except subprocess.TimeoutExpired:  # as the user did: a second SIGTERM skips the rest
            result.second_sigterm = True
            proc.send_signal(signal.SIGTERM)
            try:
                result.exit_code = proc.wait(timeout=EXIT_MARGIN_S)
            except subprocess.TimeoutExpired:
                pass
        for stream in streams:
            stream.join(5)
            result.streams[stream.outcome] = result.streams.get(stream.outcome, 0) + 1
        time.sleep(2.0)  # multiprocessing's resource tracker exits a moment after the server
        result.leaked = len(watch.alive())
        result.left_files = sorted(p.name for p in tmp.iterdir() if p.name not in KEPT_BY_DESIGN)
    except (RuntimeError, httpx.HTTPError) as error:
        result.error = f"{type(error).__name__}: {error}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    if result.error or result.exit_code != 0 or result.left_files or result.leaked:
        print(f"run {run}: server log kept at {root / 'server.log'}", file=sys.stderr)
    else:
        shutil.rmtree(root, ignore_errors=True)
    result.passed = (result.error is None and result.status_s is not None and result.dead_listed
                     and result.exit_s is not None and result.exit_code == 0 and "no end" not in result.streams
                     and not result.left_files and not result.leaked)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--model", default="tiny-sd")
    p.add_argument("--fault", choices=sorted(FAULTS), default="kill", help="kill: SIGKILL a replica; stop: SIGSTOP it")
    p.add_argument("--streams", type=int, default=4, help="streamed requests in flight at the fault")
    p.add_argument("--steps", type=int, default=200, help="each stream's steps: enough to outlast the fault")
    p.add_argument("--status-delay-s", type=float, default=0.3, help="from the fault to the /v1/status call")
    p.add_argument("--status-timeout-s", type=float, default=15.0,
                   help="how long /v1/status may take to answer (a hung replica's status call has 10 s)")
    p.add_argument("--grace-s", type=float, default=5.0, help="the server's --shutdown-grace-s")
    p.add_argument("--out", type=Path, help="also write the runs as JSON here")
    args = p.parse_args()
    results = []
    print(f"{'run':>3}  {'status s':>8}  {'dead listed':>11}  {'exit s':>6}  {'code':>4}  {'leaked':>6}  "
          f"{'left files':>10}  streams  result")
    for run in range(args.runs):
        r = one_run(args, run)
        results.append(r)
        streams = ", ".join(f"{k} {v}" for k, v in sorted(r.streams.items()))
        verdict = "pass" if r.passed else f"FAIL {r.error or ' '.join(r.left_files)}"
        print(f"{r.run:>3}  {r.status_s if r.status_s is not None else 'hung':>8}  {str(r.dead_listed):>11}  "
              f"{r.exit_s if r.exit_s is not None else 'hung':>6}  {str(r.exit_code):>4}  {r.leaked:>6}  "
              f"{len(r.left_files):>10}  {streams}  {verdict}", flush=True)
    print(f"{sum(r.passed for r in results)}/{len(results)} runs passed")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
