"""How gouache starts its processes (`processes`), and what each does first (`become_child`):
keep freed memory (`heap`), leave SIGINT / SIGTERM to its parent, which stops it itself, and
exit once that parent is gone (a killed parent's children would otherwise live on, holding
memory and devices)."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
import time
from multiprocessing import connection
from pathlib import Path

from gouache.heap import keep_freed_memory

PARENT_CHECK_S = 1.0

# What the fork server imports once for every process it forks: torch, diffusers and the model
# code (through the executor's worker), the replica's engine and the ControlNet service.
PRELOAD = ["gouache.executor.multiproc", "gouache.replicas.process", "gouache.controlnet.service"]


def processes() -> multiprocessing.context.BaseContext:
    """The multiprocessing context of every process gouache starts: forked from a fork server
    that imported `PRELOAD` once. Spawn imported torch, diffusers and transformers again in each
    process, 6-7 s of a 2-core CPU before a worker could build its model. The fork server is a
    fresh process that runs nothing but imports, so its children inherit no threads and no
    model (never fork the process that holds one). It starts with the first process and keeps
    the environment of that moment.

    Where torch sees a GPU, processes are spawned instead: the libraries' imports ask torch
    whether CUDA is there, which marks the fork server, and every process forked from it then
    fails at its first CUDA call ("Cannot re-initialize CUDA in forked subprocess", seen on an
    H200 in the ControlNet service)."""
    import torch

    if torch.cuda.is_available():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def become_child(name: str | None = None) -> None:
    """`name`: the process's name in ps and top (Linux, 15 characters), so that operators and
    fault drills tell gouache's processes apart."""
    keep_freed_memory()
    if name is not None:
        with contextlib.suppress(OSError):
            Path("/proc/self/comm").write_text(name[:15])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent, ppid = multiprocessing.parent_process(), os.getppid()

    def watch() -> None:
        # A forked child's parent is the fork server, which outlives the process that asked
        # for the child: that process's sentinel (a pipe it holds) tells when it is gone.
        if parent is not None:
            connection.wait([parent.sentinel])
        else:  # not started by multiprocessing (a Ray actor)
            while os.getppid() == ppid:
                time.sleep(PARENT_CHECK_S)
        os._exit(1)

    threading.Thread(target=watch, name="gouache-parent-watch", daemon=True).start()
