"""What every process gouache starts does first: keep freed memory (`heap`), leave SIGINT /
SIGTERM to its parent, which stops it itself, and exit once that parent is gone (a killed
parent's children would otherwise live on, reparented, holding memory and devices)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

from gouache.heap import keep_freed_memory

PARENT_CHECK_S = 1.0


def become_child(name: str | None = None) -> None:
    """`name`: the process's name in ps and top (Linux, 15 characters), so that operators and
    fault drills tell gouache's processes apart."""
    keep_freed_memory()
    if name is not None:
        with contextlib.suppress(OSError):
            Path("/proc/self/comm").write_text(name[:15])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_S)
        os._exit(1)

    threading.Thread(target=watch, name="gouache-parent-watch", daemon=True).start()
