"""Which threads run torch on several CPU threads: one, the thread that runs the steps.

PyTorch's CPU build runs an operator's work on OpenMP (libgomp), which gives every thread that
calls into torch a team of worker threads of its own, kept until that thread ends. Once the
teams hold more threads than the machine has CPUs, libgomp stops its workers spinning between
parallel regions (a 100-spin wait in place of about 3 ms) and wakes them through the kernel at
every operator. A denoiser step is hundreds of small operators: on 2 cores a shapes-unet step
at 128 px took 50 ms in the engine's step thread, whose process had teams in its main, prep and
post threads too, against 14 ms when the step thread's team was the only one (docs/speed.md,
"One OpenMP team"). Shrinking a team later does not give its workers back.

So the step thread runs torch on the server's threads (`--torch-threads`, else torch's
default); every other thread that touches torch (start-up in the main thread, the prep and
post stages, the LoRA and template readers) runs it on one thread (`single`), and the start-up
work that must run as the steps do (the batch probe times steps; a compiled graph's kernels
take the thread count they were generated under) runs in a thread of its own that ends when it
is done, its team with it (`in_thread`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def step_threads(configured: int | None) -> int:
    """The intra-op threads of the step thread: `configured`, else torch's default for this process."""
    return configured or torch.get_num_threads()


def single() -> None:
    """Run this thread's torch operators on itself alone (no OpenMP team of its own)."""
    own(1)


def own(threads: int) -> None:
    """Run this thread's torch operators on `threads` threads, whatever other threads set.

    A thread's count is set from a process-wide value the first time the thread asks for it
    (`get_num_threads` or its first parallel operator), and `set_num_threads` writes that value
    too: a thread that set its count before asking would take the count of whichever thread set
    it last. Asking first fixes the thread's own count, then setting it holds."""
    torch.get_num_threads()
    torch.set_num_threads(threads)


def in_thread(fn: Callable[[], T], threads: int, name: str) -> T:
    """`fn()` in a new thread whose torch operators run on `threads` threads; its result, or what
    it raised. The thread and its OpenMP team end with it."""
    out: list = []

    def run() -> None:
        own(threads)
        try:
            out.append((True, fn()))
        except BaseException as error:  # handed to the caller, which raises it in its own thread
            out.append((False, error))

    thread = threading.Thread(target=run, name=name, daemon=True)  # an interrupted start does not wait for it
    thread.start()
    thread.join()
    ok, value = out[0]
    if not ok:
        raise value
    return value
