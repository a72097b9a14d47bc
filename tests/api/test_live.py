"""A real uvicorn serving the fake engine: the official openai client, streams and disconnects."""

from __future__ import annotations

import io
import time

import httpx
import openai
import pytest

from gouache.errors import QueueFullError
from tests.api.corpus import GENERATIONS, png
from tests.api.fake_engine import FakeEngine
from tests.api.helpers import open_image, parse_sse


def _client(live_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live_url}/v1", api_key="unused", max_retries=0, timeout=10)


def _wait_for(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_openai_generate(live_url: str, engine: FakeEngine):
    result = _client(live_url).images.generate(
        model="fake-sd", prompt="a red fox", size="256x256", n=2, response_format="b64_json"
    )
    assert [open_image(image.b64_json).size for image in result.data] == [(256, 256)] * 2
    assert result.size == "256x256" and len(engine.submitted) == 2


def test_openai_generate_url(live_url: str):
    result = _client(live_url).images.generate(prompt="a red fox", response_format="url", output_format="webp")
    downloaded = httpx.get(result.data[0].url)
    assert downloaded.headers["content-type"] == "image/webp" and open_image(downloaded.content).size == (256, 256)


def test_openai_edit(live_url: str, engine: FakeEngine):
    image, mask = io.BytesIO(png(96, 64)), io.BytesIO(png(96, 64))
    image.name, mask.name = "in.png", "mask.png"
    result = _client(live_url).images.edit(image=image, mask=mask, prompt="paint it blue", size="96x64")
    assert open_image(result.data[0].b64_json).size == (96, 64)
    assert engine.submitted[0].image == png(96, 64) and engine.submitted[0].mask == png(96, 64)


def test_openai_edit_with_image_list(live_url: str, engine: FakeEngine):
    first, second = io.BytesIO(png()), io.BytesIO(png(32, 32))
    first.name, second.name = "a.png", "b.png"
    with pytest.raises(openai.BadRequestError) as refused:
        _client(live_url).images.edit(image=[first, second], prompt="blue")
    assert refused.value.body["param"] == "image" and not engine.submitted
    first.seek(0)
    _client(live_url).images.edit(image=[first], prompt="blue")
    assert engine.submitted[0].image == png()


def test_openai_stream(live_url: str):
    stream = _client(live_url).images.generate(prompt="fox", stream=True, partial_images=1)
    types = [event.type for event in stream]
    assert types[-1] == "image_generation.completed" and "image_generation.partial_image" in types
    assert "gouache.progress" in types


def test_openai_errors(live_url: str, engine: FakeEngine):
    client = _client(live_url)
    with pytest.raises(openai.BadRequestError) as bad:
        client.images.generate(prompt="fox", n=11)
    assert bad.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError):
        client.images.generate(prompt="fox", model="dall-e-3")
    engine.raise_on_submit = QueueFullError("busy", retry_after_s=2)
    with pytest.raises(openai.RateLimitError) as limited:
        client.images.generate(prompt="fox")
    assert limited.value.response.headers["retry-after"] == "2"


def test_delete_aborts_a_stream(live_url: str, engine: FakeEngine):
    engine.hold = True
    with httpx.Client(base_url=live_url, timeout=10) as client:
        with client.stream("POST", GENERATIONS, json={"prompt": "fox", "stream": True}) as response:
            api_id = response.headers["x-request-id"]
            assert client.delete(f"/v1/images/requests/{api_id}").status_code == 200
            text = response.read().decode()
    name, data = parse_sse(text)[-1]
    assert name == "error" and data["error"]["code"] == "cancelled"
    assert engine.aborted == [api_id]
    # once, not also as abandoned
    assert engine.metrics.registry.get_sample_value("gouache_errors_total", {"kind": "cancelled"}) == 1


def test_stream_client_disconnect_aborts(live_url: str, engine: FakeEngine):
    engine.hold = True
    with httpx.Client(base_url=live_url, timeout=10) as client:
        with client.stream("POST", GENERATIONS, json={"prompt": "fox", "stream": True}) as response:
            api_id = response.headers["x-request-id"]
            next(response.iter_lines())  # the first progress event: the request is running
    _wait_for(lambda: engine.aborted == [api_id])
    # counted like a DELETE or a plain request's disconnect (before: not counted at all)
    _wait_for(lambda: engine.metrics.registry.get_sample_value("gouache_errors_total", {"kind": "cancelled"}) == 1)


def test_client_disconnect_aborts_a_plain_request(live_url: str, engine: FakeEngine):
    engine.hold = True
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{live_url}{GENERATIONS}", json={"prompt": "fox"}, timeout=0.3)
    api_id = engine.submitted[0].request_id.rsplit("-", 1)[0]
    _wait_for(lambda: engine.aborted == [api_id] and engine.running == 0)
    assert httpx.get(f"{live_url}/health").json()["running"] == 0
