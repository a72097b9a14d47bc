"""`gouache serve` as a process manager runs it: signals, drain, a killed worker, no leftovers."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from gouache.bench.server_process import descendants
from gouache.sched.policies import make_policy

pytestmark = pytest.mark.slow
STEP_S_AT_256 = 0.03  # about, for tiny-sdxl on this CPU: only to size requests that outlast a signal


class Server:
    """One `gouache serve` process in its own process group, and what it leaves behind."""

    def __init__(self, *flags: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "gouache.cli", "serve", "--model", "tiny-sdxl", "--port", str(self.port), *flags]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 180
        while not self._healthy():
            assert self.proc.poll() is None, self.proc.stderr.read()
            assert time.monotonic() < deadline, "server did not become healthy"
            time.sleep(0.3)
        self.children = set(descendants(self.proc.pid))  # the codec worker and multiprocessing's tracker

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def wait(self) -> tuple[int, str]:
        """Exit status and stderr, once it exited."""
        _, stderr = self.proc.communicate(timeout=60)
        return self.proc.returncode, stderr

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def survivors(pids: set[int], wait_s: float = 5.0) -> list[str]:
    """Command lines of `pids` still running after `wait_s` (multiprocessing's resource tracker
    exits when it reads the end of its pipe, a moment after the server)."""
    deadline = time.monotonic() + wait_s
    while True:
        running = [pid for pid in pids if _running(pid)]
        if not running or time.monotonic() > deadline:
            return [Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode() for pid in running]
        time.sleep(0.1)


def _running(pid: int) -> bool:
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def codec_worker(server: Server) -> int:
    workers = [pid for pid in server.children if Path(f"/proc/{pid}/comm").read_text().strip() == "gouache-codec"]
    assert len(workers) == 1, workers
    return workers[0]


class Stream:
    """A streamed generation read event by event."""

    def __init__(self, client: httpx.Client, url: str, steps: int):
        body = {"prompt": "a fox", "size": "256x256", "num_inference_steps": steps, "stream": True}
        self._context = client.stream("POST", f"{url}/v1/images/generations", json=body, timeout=120)
        self.response = self._context.__enter__()
        self._lines = self.response.iter_lines()

    def next_event(self) -> tuple[str, dict]:
        name = None
        for line in self._lines:
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                return name, json.loads(line.removeprefix("data: "))
        raise EOFError

    def last_event(self) -> str:
        name = None
        try:
            while True:
                name, _ = self.next_event()
        except EOFError:
            return name


def generate(url: str, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{url}/v1/images/generations", json={"prompt": "a fox", "size": "64x64",
                                                            "num_inference_steps": 2}, timeout=timeout)


def test_sigterm_drains_running_requests_refuses_new_ones_and_leaves_no_process():
    """Before: SIGTERM left the codec worker and the resource tracker running, reparented to PID 1."""
    server = Server("--shutdown-grace-s", "30")
    try:
        with httpx.Client() as client:
            stream = Stream(client, server.url, steps=int(3.0 / STEP_S_AT_256))
            assert stream.next_event()[0] == "gouache.progress"
            os.kill(server.proc.pid, signal.SIGTERM)
            time.sleep(0.3)
            refused, health = generate(server.url), httpx.get(f"{server.url}/health", timeout=5)
            last = stream.last_event()
        code, stderr = server.wait()
    finally:
        server.kill()
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    assert int(refused.headers["retry-after"]) >= 1
    assert health.status_code == 503 and health.json()["status"] == "draining"
    assert last == "image_generation.completed"
    assert code == 0 and "Traceback" not in stderr
    assert server.children and survivors(server.children) == []


def test_sigint_to_the_group_past_the_grace_cancels_with_an_explicit_error():
    """Before: SIGINT printed a KeyboardInterrupt traceback; Ctrl-C signals the whole group."""
    server = Server("--shutdown-grace-s", "0.5")
    try:
        with httpx.Client() as client:
            stream = Stream(client, server.url, steps=200)
            assert stream.next_event()[0] == "gouache.progress"
            os.killpg(server.proc.pid, signal.SIGINT)
            name, data = stream.next_event()
            while name == "gouache.progress":
                name, data = stream.next_event()
        code, stderr = server.wait()
    finally:
        server.kill()
    assert name == "error" and data["error"]["code"] == "shutting_down"
    assert code == 0 and "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    assert survivors(server.children) == []


def test_a_killed_codec_worker_is_replaced_and_the_next_request_is_served_within_5_s():
    server = Server()
    try:
        with httpx.Client() as client:
            stream = Stream(client, server.url, steps=int(1.0 / STEP_S_AT_256))
            assert stream.next_event()[0] == "gouache.progress"
            os.kill(codec_worker(server), signal.SIGKILL)
            in_flight = stream.last_event()
        started = time.monotonic()
        after = generate(server.url, timeout=5)
        served_in = time.monotonic() - started
        server.children = set(descendants(server.proc.pid))
        replacement = codec_worker(server)
    finally:
        server.kill()
    assert in_flight in ("image_generation.completed", "error")  # never lost, never hung
    assert after.status_code == 200 and served_in < 5
    assert replacement


def test_the_server_exits_1_when_the_engine_loop_dies():
    """Before: the engine thread died and the server went on serving 503s and /health 200 "ok"
    (tests/api/test_auth.py checks /health's 503, test_supervision.py the engine's "dead")."""
    import asyncio

    from gouache.api.server import serve
    from gouache.config import EngineConfig, SchedulerConfig, ServerConfig
    from gouache.engine.client import AsyncEngine
    from gouache.models.zoo import load_pipeline
    from gouache.runner.describe import model_info

    pipe = load_pipeline("tiny-sdxl")
    engine = AsyncEngine(pipe, model_info(pipe, "tiny-sdxl"), EngineConfig(), make_policy(SchedulerConfig()))

    def broken_advance(run, stepped, now, steps=1):
        raise SystemError("a bug in the loop")

    engine.scheduler.advance = broken_advance
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def scenario():
        server = asyncio.create_task(serve(engine, ServerConfig(port=port)))
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            while True:
                try:
                    await client.get("/health")
                    break
                except httpx.HTTPError:
                    await asyncio.sleep(0.1)
            failed = await client.post("/v1/images/generations", json={"prompt": "a fox", "size": "64x64"})
        return failed, await asyncio.wait_for(server, 30)

    failed, exit_code = asyncio.run(scenario())
    assert failed.status_code == 503 and failed.json()["error"]["code"] == "engine_stopped"
    assert exit_code == 1
