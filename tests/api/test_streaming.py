"""The SSE wire format of image streams: OpenAI's event names and shapes, byte for byte."""

from __future__ import annotations

import json

import httpx
import pytest

from gouache.api.streaming import StreamShape, encode_event
from gouache.outputs import ErrorEvent, ImageEvent, PausedEvent, ProgressEvent
from tests.api.corpus import GENERATIONS

SHAPE = StreamShape("image_generation", "256x256", "png")


def test_progress_event_on_the_wire():
    wire = encode_event(ProgressEvent(index=1, step=2, total_steps=4), SHAPE)
    assert wire == b'event: gouache.progress\ndata: {"type":"gouache.progress","step":2,"total_steps":4,"index":1}\n\n'
    paused = encode_event(PausedEvent(index=0, step=2, total_steps=4), SHAPE)
    assert paused == b'event: gouache.paused\ndata: {"type":"gouache.paused","step":2,"total_steps":4,"index":0}\n\n'


def test_completed_and_error_events_on_the_wire():
    name, data = (encode_event(ImageEvent(index=0, image=b"png", seed=7), SHAPE).decode().removesuffix("\n\n")
                  .split("\n"))
    assert name == "event: image_generation.completed" and data.startswith("data: {") and ": " not in data[6:]
    completed = json.loads(data.removeprefix("data: "))
    assert {k: completed[k] for k in ("type", "b64_json", "seed", "index", "size", "output_format", "background")} == {
        "type": "image_generation.completed", "b64_json": "cG5n", "seed": 7, "index": 0, "size": "256x256",
        "output_format": "png", "background": "opaque",
    }  # fmt: skip
    error = encode_event(ErrorEvent("worker_failure", "denoising failed", 500), SHAPE).decode()
    assert error.startswith("event: error\ndata: ") and error.endswith("}\n\n") and error.count("\n") == 3


@pytest.mark.anyio
async def test_stream_response_headers(client: httpx.AsyncClient):
    response = await client.post(GENERATIONS, json={"prompt": "fox", "stream": True})
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["cache-control"] == "no-cache" and response.headers["x-accel-buffering"] == "no"
    assert response.headers["x-request-id"].startswith("img_")
