"""What `GET /v1/status` shows of one engine: its requests (size, step) and its recent steps
(latency, engine overhead, batch per device block), finished images and requests per second. The engine
thread records; the API reads a snapshot."""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque

WINDOW_S = 60.0  # images and requests per second over this many seconds
RECENT_STEPS = 64  # steps the latency medians are taken over


class StatusBook:
    def __init__(self):
        self._steps: deque[tuple[float, float]] = deque(maxlen=RECENT_STEPS)  # (step s, overhead s)
        self._images: deque[float] = deque(maxlen=4096)  # time.monotonic() of each image returned
        self._requests: deque[float] = deque(maxlen=4096)  # ... of each request's last image
        self._blocks: dict[str, dict] = {}  # device block -> its last step
        self._lock = threading.Lock()

    def step(self, devices: tuple[int, ...], request_ids: list[str], step_s: float, forward_s: float) -> None:
        with self._lock:
            self._steps.append((step_s, step_s - forward_s))
            self._blocks[",".join(map(str, devices))] = {"requests": len(request_ids), "step_ms": 1000 * step_s}

    def finished(self, request_done: bool) -> None:
        """An image was returned; `request_done`: its request's last."""
        now = time.monotonic()
        with self._lock:
            self._images.append(now)
            if request_done:
                self._requests.append(now)

    def snapshot(self) -> dict:
        now = time.monotonic()
        with self._lock:
            steps, blocks = list(self._steps), {k: dict(v) for k, v in self._blocks.items()}
            images, requests = (sum(1 for t in times if now - t <= WINDOW_S)
                                for times in (self._images, self._requests))
        return {
            "steps": {"recent": len(steps),
                      "latency_ms_median": 1000 * statistics.median(s for s, _ in steps) if steps else None,
                      "overhead_ms_median": 1000 * statistics.median(o for _, o in steps) if steps else None},
            "images_per_s": images / WINDOW_S,
            "requests_per_s": requests / WINDOW_S,
            "devices": blocks,
        }
