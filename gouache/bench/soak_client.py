"""The client side of `gouache bench soak`: each request kind as a user's client sends it, and
the open-loop and closed-loop drivers. What a request ended as is judged in `soak`."""

from __future__ import annotations

import asyncio
import base64
import functools
import io
import json
import os
import time
from collections.abc import Coroutine
from typing import Any

import httpx
from tqdm import tqdm

from gouache.bench.soak_adapters import CONTROLNETS, LORAS
from gouache.bench.soak_trace import Outcome, Seen, SoakItem, judge
from gouache.stats import percentile

PROMPT = "a red fox in the snow"
TEMPLATES = 3  # `template` edits name soak-0..2 (each at every size it is sent at)


@functools.lru_cache(maxsize=16)
def edit_png(width: int, height: int) -> bytes:
    """An RGBA noise image whose transparent centre (half of each side) is the region to repaint."""
    from PIL import Image

    image = Image.effect_noise((width, height), 60).convert("RGBA")
    image.paste((0, 0, 0, 0), (width // 4, height // 4, 3 * width // 4, 3 * height // 4))
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


@functools.lru_cache(maxsize=16)
def control_image(width: int, height: int) -> str:
    """A ControlNet's conditioning image of the request's size, base64 PNG."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.effect_noise((width, height), 80).convert("RGB").save(buffer, "PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def _fields(item: SoakItem, model: str) -> dict:
    fields = {"prompt": PROMPT, "model": model, "size": f"{item.width}x{item.height}",
              "num_inference_steps": item.steps, "seed": item.seed}
    if item.kind == "lora":
        fields["loras"] = [{"name": f"l{item.seed % LORAS}", "scale": 0.8}]
    elif item.kind == "controlnet":
        fields["controlnets"] = [{"name": f"c{item.seed % CONTROLNETS}",
                                  "image": control_image(item.width, item.height)}]
    return fields


def _error_code(body) -> str | None:
    error = body.get("error") if isinstance(body, dict) else None
    return error.get("code") if isinstance(error, dict) else None


def _sse_error_code(data: str) -> str:
    """The code of an SSE `error` event; one without a readable code is still an explicit error."""
    try:
        return _error_code(json.loads(data)) or "none"
    except ValueError:
        return "unreadable"


def _from_json(response: httpx.Response) -> Seen:
    try:
        body = response.json()
    except ValueError:
        return Seen(response.status_code, failure="bad_body")
    if response.status_code == 200:
        return Seen(200, images=len(body.get("data", [])))
    return Seen(response.status_code, code=_error_code(body))


async def _plain(client: httpx.AsyncClient, item: SoakItem, model: str) -> Seen:
    return _from_json(await client.post("/v1/images/generations", json=_fields(item, model)))


async def _edit(client: httpx.AsyncClient, item: SoakItem, model: str) -> Seen:
    """An edit; a `template` edit names one of a few templates (the first edit of each records it,
    later ones replay it)."""
    files = {"image": ("image.png", edit_png(item.width, item.height), "image/png")}
    data = {name: str(value) for name, value in _fields(item, model).items()}
    if item.kind == "template":
        data["template_id"] = f"soak-{item.seed % TEMPLATES}"
    return _from_json(await client.post("/v1/images/edits", data=data, files=files))


async def _disconnect(client: httpx.AsyncClient, item: SoakItem, model: str, after_s: float) -> Seen:
    try:  # cancelling the request closes its connection, as a client that goes away does
        return await asyncio.wait_for(_plain(client, item, model), after_s)
    except TimeoutError:
        return Seen(closed=True)


async def _stream(client: httpx.AsyncClient, item: SoakItem, model: str) -> Seen:
    """A stream; `stream_cancel` closes it and `delete` DELETEs it after `cut` of its steps."""
    stop_at = None if item.kind == "stream" else max(1, round(item.cut * item.steps))
    body = _fields(item, model) | {"stream": True, "partial_images": 2}
    async with client.stream("POST", "/v1/images/generations", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return _from_json(response)
        seen, event, progress = Seen(200), "", 0
        async for line in response.aiter_lines():
            if line.startswith("event: "):
                event = line.removeprefix("event: ")
            elif not line.startswith("data: "):
                continue
            elif event == "error":
                seen.code = _sse_error_code(line.removeprefix("data: "))
            elif event.endswith(".completed"):
                seen.images += 1
            elif event == "gouache.progress":
                progress += 1
                if progress == stop_at and item.kind == "stream_cancel":
                    seen.closed = True
                    return seen
                if progress == stop_at:
                    request_id = response.headers["x-request-id"]
                    seen.deleted = (await client.delete(f"/v1/images/requests/{request_id}")).status_code
        return seen


def _request(client: httpx.AsyncClient, item: SoakItem, model: str, disconnect_s: float) -> Coroutine[Any, Any, Seen]:
    if item.kind == "disconnect":
        return _disconnect(client, item, model, item.cut * disconnect_s)
    simple = {"plain": _plain, "lora": _plain, "controlnet": _plain, "edit": _edit, "template": _edit}
    return simple.get(item.kind, _stream)(client, item, model)


async def send(client: httpx.AsyncClient, item: SoakItem, model: str, deadline_s: float,
               disconnect_s: float) -> Outcome:
    start = time.perf_counter()
    try:
        async with asyncio.timeout(deadline_s):
            seen = await _request(client, item, model, disconnect_s)
    except TimeoutError:
        seen = Seen(failure="timeout")
    except httpx.TransportError as error:
        seen = Seen(failure=type(error).__name__)
    return judge(item.kind, seen, time.perf_counter() - start)


def _client(base_url: str) -> httpx.AsyncClient:
    # A fresh connection per request: no idle connection the server may close under a reuse.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    return httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(None, connect=10), limits=limits)


async def measure_capacity(base_url: str, items: list[SoakItem], model: str, concurrency: int,
                           deadline_s: float) -> tuple[float, float]:
    """(completed requests per second, median latency in s) of a closed loop over `items`."""
    todo, latencies = list(items), []
    async with _client(base_url) as client:
        async def worker() -> None:
            while todo:
                outcome = await send(client, todo.pop(0), model, deadline_s, 0)
                if outcome.result == "images":
                    latencies.append(outcome.latency_s)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    if not latencies:
        raise RuntimeError("no request of the capacity measurement returned images")
    return len(latencies) / elapsed, percentile(latencies, 50)


async def drive(base_url: str, trace: list[SoakItem], model: str, deadline_s: float,
                disconnect_s: float) -> list[Outcome]:
    async with _client(base_url) as client:
        bar = tqdm(total=len(trace), desc="requests", unit="req", disable=os.environ.get("CI") == "true")
        start = time.perf_counter()

        async def fire(item: SoakItem) -> Outcome:
            await asyncio.sleep(max(0.0, item.at - (time.perf_counter() - start)))
            outcome = await send(client, item, model, deadline_s, disconnect_s)
            bar.update()
            return outcome

        outcomes = await asyncio.gather(*(fire(item) for item in trace))
        bar.close()
    return list(outcomes)
