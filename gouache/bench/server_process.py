"""A `gouache serve` process under watch: its process tree's memory, its open files, its
/health, and whether SIGTERM ends it and all its children. Linux only (reads /proc)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from gouache.bench.serve import free_port, wait_healthy

LEAK_GRACE_S = 2.0  # after the server exits, how long its children get to exit too


@dataclass
class ProcSample:
    t_s: float  # seconds since the watch started
    rss_mb: float  # VmRSS of the server and all its descendants, MiB
    fds: int  # open file descriptors of the server process
    processes: int  # the server's live descendants
    health: int | None  # /health status; None if it did not answer within 5 s
    mark: str | None = None  # the moment of the run this sample was taken for, if any


def _stat(pid: int) -> tuple[int, int, str] | None:
    """(parent pid, start time in clock ticks, state) of a process; None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # the name in parentheses may hold spaces
    return int(fields[1]), int(fields[19]), fields[0]


def descendants(root: int) -> dict[int, int]:
    """pid -> start time of every live process below `root` (the start time tells a reused pid apart)."""
    stats = {int(name): _stat(int(name)) for name in os.listdir("/proc") if name.isdigit()}
    children = defaultdict(list)
    for pid, stat in stats.items():
        if stat is not None:
            children[stat[0]].append(pid)
    found, todo = {}, [root]
    while todo:
        for child in children[todo.pop()]:
            found[child] = stats[child][1]
            todo.append(child)
    return found


def _rss_kb(pid: int) -> int:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _fd_count(pid: int) -> int:
    with contextlib.suppress(OSError):
        return len(os.listdir(f"/proc/{pid}/fd"))
    return 0


def _cmdline(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    return ""


def _health(base_url: str) -> int | None:
    try:
        return httpx.get(f"{base_url}/health", timeout=5).status_code
    except httpx.HTTPError:
        return None


class ServerWatch(threading.Thread):
    """Samples a server's process tree and /health every `interval_s` until `stop()`."""

    def __init__(self, pid: int, base_url: str, interval_s: float):
        super().__init__(name="gouache-soak-watch", daemon=True)
        self.pid, self.base_url, self.interval_s = pid, base_url, interval_s
        self.samples: list[ProcSample] = []
        self.seen: dict[int, int] = {}  # every descendant ever sampled: pid -> start time
        self._t0 = time.monotonic()
        self._lock = threading.Lock()
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(self.interval_s):
            self.sample()

    def sample(self, mark: str | None = None) -> ProcSample:
        tree = descendants(self.pid)
        rss_kb = sum(_rss_kb(pid) for pid in (self.pid, *tree))
        sample = ProcSample(round(time.monotonic() - self._t0, 2), round(rss_kb / 1024, 1), _fd_count(self.pid),
                            len(tree), _health(self.base_url), mark)
        with self._lock:
            self.seen.update(tree)
            self.samples.append(sample)
        return sample

    def stop(self) -> None:
        self._done.set()
        self.join()

    def alive(self) -> list[dict]:
        """The descendants ever seen that still run (zombies excluded), with their command lines."""
        alive = []
        for pid, started in sorted(self.seen.items()):
            stat = _stat(pid)
            if stat is not None and stat[1] == started and stat[2] != "Z":
                alive.append({"pid": pid, "cmdline": _cmdline(pid)})
        return alive


@contextlib.contextmanager
def server_process(serve_args: list[str], log_path: Path) -> Iterator[tuple[subprocess.Popen, str]]:
    """`gouache serve serve_args --port P` in a process group of its own, healthy, output to
    `log_path`; on the way out (Ctrl-C and errors included) the whole group is killed."""
    port = free_port()
    cmd = [sys.executable, "-m", "gouache.cli", "serve", *serve_args, "--port", str(port)]
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            base_url = f"http://127.0.0.1:{port}"
            if not wait_healthy(proc, base_url):
                tail = log_path.read_text()[-2000:]
                raise RuntimeError(f"`{' '.join(cmd)}` did not become healthy (exit code {proc.poll()}):\n{tail}")
            yield proc, base_url
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def terminate(proc: subprocess.Popen, watch: ServerWatch, timeout_s: float) -> dict:
    """SIGTERM the server alone, as a process manager does; its exit code (None if it did not
    exit within `timeout_s`) and the descendants still alive `LEAK_GRACE_S` later."""
    proc.send_signal(signal.SIGTERM)
    try:
        exit_code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        exit_code = None
    time.sleep(LEAK_GRACE_S)
    return {"exit_code": exit_code, "children_seen": len(watch.seen), "leaked": watch.alive()}
