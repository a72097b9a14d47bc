"""What every process gouache starts does first: leave SIGINT / SIGTERM to its parent, which
stops it itself, and exit once that parent is gone (a killed parent's children would otherwise
live on, reparented, holding memory and devices)."""

from __future__ import annotations

import os
import signal
import threading
import time

PARENT_CHECK_S = 1.0


def become_child() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_S)
        os._exit(1)

    threading.Thread(target=watch, name="gouache-parent-watch", daemon=True).start()
