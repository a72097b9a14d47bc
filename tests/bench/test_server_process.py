import contextlib
import os
import signal
import subprocess
import sys

import pytest

from gouache.bench.server_process import ServerWatch

pytestmark = pytest.mark.slow

# A parent whose child starts a grandchild; both print their pid once they exist. The parent
# exits when its stdin closes and leaves the two behind, as a server that leaks workers does.
SLEEPER = "import time; time.sleep(60)"
CHILD = ("import os, subprocess, sys, time; "
         f"g = subprocess.Popen([sys.executable, '-c', {SLEEPER!r}], stdout=subprocess.DEVNULL); "
         "print(os.getpid(), g.pid, flush=True); time.sleep(60)")
PARENT = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {CHILD!r}]); sys.stdin.readline()"


def test_watch_samples_the_tree_and_reports_descendants_alive_after_the_parent_exits():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    pids = {int(pid) for pid in parent.stdout.readline().split()}
    watch = ServerWatch(parent.pid, "http://127.0.0.1:9", interval_s=60)  # port 9: /health never answers
    try:
        sample = watch.sample("start")
        assert set(watch.seen) == pids
        assert sample.processes == 2 and sample.rss_mb > 0 and sample.fds > 0 and sample.health is None
        assert len(watch.alive()) == 2
        parent.stdin.close()
        assert parent.wait(timeout=30) == 0
        leaked = watch.alive()
        assert {p["pid"] for p in leaked} == pids
        assert all("time.sleep(60)" in p["cmdline"] for p in leaked)
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        parent.stdout.close()
