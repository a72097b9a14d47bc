"""gouache's processes come from a fork server that imported torch once (spawned where there is a
GPU), and each exits when the process that started it is gone, although its parent in the process
tree is the fork server."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.api.test_lifecycle import _running

ROOT = Path(__file__).resolve().parents[1]

PARENT = """
import sys, time
from gouache.children import processes
from tests.test_children import child

context = processes()
ready = context.Queue()
context.Process(target=child, args=(ready,)).start()
print(*ready.get(timeout=120), flush=True)
time.sleep(600)
"""


def child(ready) -> None:
    from gouache.children import become_child

    torch_at_start = "torch" in sys.modules  # before this process imported anything itself
    become_child("gouache-test")
    ready.put((os.getpid(), torch_at_start))
    time.sleep(600)


@pytest.mark.slow
def test_a_child_starts_with_torch_imported_and_exits_when_its_starter_is_killed():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        pid, torch_at_start = parent.stdout.readline().split()
        pid = int(pid)
        assert torch_at_start == "True"
        assert Path(f"/proc/{pid}/comm").read_text().strip() == "gouache-test"
        assert int(Path(f"/proc/{pid}/stat").read_text().split()[3]) != parent.pid  # the fork server's child
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 10
        while _running(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(pid)
    finally:
        parent.kill()
        parent.wait()


def test_processes_are_spawned_where_torch_sees_a_gpu(monkeypatch):
    # A fork server's imports ask torch about CUDA, and its forks then fail at their first CUDA
    # call (seen on an H200): with a GPU, every process starts afresh.
    import torch

    from gouache.children import processes

    assert processes().get_start_method() == "forkserver"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert processes().get_start_method() == "spawn"
