"""The images API against the fake engine, in process (httpx.ASGITransport)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

import httpx
import pytest

from gouache.api import images
from gouache.api.server import create_app
from gouache.errors import QueueFullError
from gouache.outputs import ErrorEvent
from tests.api.corpus import EDITS, GENERATIONS, png
from tests.api.fake_engine import FakeEngine
from tests.api.helpers import open_image, parse_sse

pytestmark = pytest.mark.anyio


async def test_generation_b64_uses_model_defaults(client: httpx.AsyncClient, engine: FakeEngine):
    response = await client.post(GENERATIONS, json={"prompt": "a red fox"})
    assert response.status_code == 200, response.text
    body = response.json()
    api_id = response.headers["x-request-id"]
    assert body["output_format"] == "png" and body["size"] == "256x256" and isinstance(body["created"], int)
    assert open_image(body["data"][0]["b64_json"]).size == (256, 256)
    [request] = engine.submitted
    assert request.request_id == f"{api_id}-0"
    assert (request.width, request.height, request.num_inference_steps, request.guidance_scale) == (256, 256, 4, 7.5)
    assert request.partial_images == 0 and request.image is None


async def test_n2_gets_consecutive_seeds_and_ids(client: httpx.AsyncClient, engine: FakeEngine):
    response = await client.post(GENERATIONS, json={"prompt": "fox", "n": 2, "seed": 42, "model": "fake-sd"})
    assert response.status_code == 200, response.text
    assert [d["seed"] for d in response.json()["data"]] == [42, 43]
    api_id = response.headers["x-request-id"]
    assert [r.request_id for r in engine.submitted] == [f"{api_id}-0", f"{api_id}-1"]
    assert [r.seed for r in engine.submitted] == [42, 43]


async def test_extensions_and_non_square_size(client: httpx.AsyncClient, engine: FakeEngine):
    fields = {"size": "512x256", "negative_prompt": "blur", "num_inference_steps": 3, "guidance_scale": 2,
              "slo_ms": 500, "block_cache": 0.1}
    response = await client.post(GENERATIONS, json={"prompt": "fox", "output_format": "webp", **fields})
    assert response.status_code == 200, response.text
    image = open_image(response.json()["data"][0]["b64_json"])
    assert image.size == (512, 256) and image.format == "WEBP"
    [request] = engine.submitted
    assert (request.width, request.height, request.negative_prompt) == (512, 256, "blur")
    assert (request.num_inference_steps, request.guidance_scale, request.slo_ms) == (3, 2.0, 500.0)
    assert request.block_cache == 0.1


async def test_fields_gouache_cannot_honour_are_logged_once_each(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
):
    images._log_ignored_once.cache_clear()  # once per process: forget what earlier tests logged
    extras = {"quality": "high", "style": "vivid", "moderation": "low", "user": "u1", "safety_identifier": "s1"}
    with caplog.at_level(logging.WARNING, logger="gouache.api.images"):
        for _ in range(2):
            response = await client.post(GENERATIONS, json={"prompt": "fox", "size": "auto", "n": None, **extras})
            assert response.status_code == 200, response.text
        edit = {"prompt": "blue", "quality": "low", "input_fidelity": "high"}
        response = await client.post(EDITS, data=edit, files=[("image", ("in.png", png(), "image/png"))])
        assert response.status_code == 200, response.text
    logged = [record.getMessage() for record in caplog.records if "accepted and ignored" in record.getMessage()]
    assert sorted(message.split()[1] for message in logged) == sorted([*extras, "input_fidelity"])


async def test_values_gouache_honours_are_accepted(client: httpx.AsyncClient, engine: FakeEngine):
    body = {"prompt": "fox", "background": "opaque", "output_format": "jpeg", "output_compression": 40}
    response = await client.post(GENERATIONS, json=body)
    assert response.status_code == 200, response.text
    assert engine.submitted[0].output_compression == 40
    streamed = await client.post(GENERATIONS, json={"prompt": "fox", "stream": True, "response_format": "b64_json"})
    assert parse_sse(streamed.text)[-1][0] == "image_generation.completed"


async def test_url_response_is_downloadable(client: httpx.AsyncClient):
    body = {"prompt": "fox", "response_format": "url", "output_format": "jpeg", "n": 2}
    response = await client.post(GENERATIONS, json=body)
    assert response.status_code == 200, response.text
    urls = [d["url"] for d in response.json()["data"]]
    assert len(set(urls)) == 2 and all(url.startswith("http://testserver/v1/files/") for url in urls)
    for path in (urls[0], urls[0] + "/content"):
        image = await client.get(path)
        assert image.status_code == 200 and image.headers["content-type"] == "image/jpeg"
        assert open_image(image.content).format == "JPEG"


async def test_stream_events_in_order(client: httpx.AsyncClient):
    body = {"prompt": "fox", "stream": True, "partial_images": 2, "num_inference_steps": 4}
    response = await client.post(GENERATIONS, json=body)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["x-request-id"].startswith("img_")
    events = parse_sse(response.text)
    names = [name for name, _ in events]
    assert names[-1] == "image_generation.completed" and names.count("image_generation.completed") == 1
    assert [d["step"] for n, d in events if n == "gouache.progress"] == [1, 2, 3, 4]
    partials = [d for n, d in events if n == "image_generation.partial_image"]
    assert [p["partial_image_index"] for p in partials] == [0, 1]
    assert names.index("image_generation.partial_image") < names.index("image_generation.completed")
    done = events[-1][1]
    assert done["type"] == "image_generation.completed" and done["index"] == 0 and done["size"] == "256x256"
    assert open_image(done["b64_json"]).size == (256, 256)


async def test_stream_of_n2_completes_each_image(client: httpx.AsyncClient):
    response = await client.post(GENERATIONS, json={"prompt": "fox", "stream": True, "n": 2})
    completed = [d["index"] for n, d in parse_sse(response.text) if n == "image_generation.completed"]
    assert sorted(completed) == [0, 1]


async def test_engine_error_event_in_stream_and_response(client: httpx.AsyncClient, engine: FakeEngine):
    engine.fail_with = ErrorEvent("worker_failure", "denoising failed", 500)
    streamed = await client.post(GENERATIONS, json={"prompt": "fox", "stream": True})
    name, data = parse_sse(streamed.text)[-1]
    assert name == "error" and data["error"]["code"] == "worker_failure"
    plain = await client.post(GENERATIONS, json={"prompt": "fox"})
    assert plain.status_code == 500 and plain.json()["error"]["code"] == "worker_failure"
    assert "x-request-id" in plain.headers


async def test_queue_full_is_429_with_retry_after(client: httpx.AsyncClient, engine: FakeEngine):
    engine.raise_on_submit = QueueFullError("the server is busy", retry_after_s=3)
    response = await client.post(GENERATIONS, json={"prompt": "fox"})
    assert response.status_code == 429 and response.headers["retry-after"] == "3"
    assert response.json()["error"] == {
        "message": "the server is busy", "type": "rate_limit_error", "param": None, "code": "queue_full"
    }


async def test_unexpected_exception_is_generic_500(client: httpx.AsyncClient, engine: FakeEngine):
    engine.raise_on_submit = RuntimeError("secret internals")
    response = await client.post(GENERATIONS, json={"prompt": "fox"})
    assert response.status_code == 500 and "secret" not in response.text
    assert response.json()["error"]["type"] == "server_error"


async def test_delete_aborts_a_waiting_request(client: httpx.AsyncClient, engine: FakeEngine):
    engine.hold = True
    pending = asyncio.create_task(client.post(GENERATIONS, json={"prompt": "fox"}))
    while not engine.submitted:
        await asyncio.sleep(0.005)
    api_id = engine.submitted[0].request_id.rsplit("-", 1)[0]
    cancelled = await client.delete(f"/v1/images/requests/{api_id}")
    assert cancelled.status_code == 200 and cancelled.json()["id"] == api_id
    response = await asyncio.wait_for(pending, 5)
    assert response.status_code == 499 and response.json()["error"]["code"] == "cancelled"
    assert engine.aborted == [api_id]
    assert (await client.delete(f"/v1/images/requests/{api_id}")).status_code == 404


async def test_edit_multipart(client: httpx.AsyncClient, engine: FakeEngine):
    image, mask = png(64, 64), png(64, 64)
    files = [("image[]", ("in.png", image, "image/png")), ("mask", ("mask.png", mask, "image/png"))]
    data = {"prompt": "paint it blue", "n": "2", "size": "128x64", "seed": "7", "guidance_scale": "3.5"}
    response = await client.post(EDITS, data=data, files=files)
    assert response.status_code == 200, response.text
    assert [open_image(d["b64_json"]).size for d in response.json()["data"]] == [(128, 64)] * 2
    first = engine.submitted[0]
    assert first.image == image and first.mask == mask and first.is_edit
    assert (first.seed, first.guidance_scale, len(engine.submitted)) == (7, 3.5, 2)


async def test_an_edit_without_a_mask_takes_a_strength_img2img(client: httpx.AsyncClient, engine: FakeEngine):
    files = [("image", ("in.png", png(64, 64), "image/png"))]
    response = await client.post(EDITS, data={"prompt": "paint it blue", "strength": "0.5"}, files=files)
    assert response.status_code == 200, response.text
    [request] = engine.submitted
    assert request.strength == 0.5 and request.mask is None and request.is_edit


@pytest.mark.parametrize(("fields", "info", "message"), [
    ({"strength": "0.2", "num_inference_steps": "3"}, {}, "0.2 of 3 steps runs none of them (sd models run "
                                                          "int(steps x strength)); send a strength of at least 0.334"),
    ({"strength": "0.5"}, {"inpaint_channels": True}, "'fake-sd' is a 9-channel inpainting model"),
])
async def test_a_strength_that_cannot_run_is_refused_with_what_to_send(client: httpx.AsyncClient, engine: FakeEngine,
                                                                       fields, info, message):
    engine.info = replace(engine.info, **info)
    files = [("image", ("in.png", png(64, 64), "image/png"))]
    response = await client.post(EDITS, data={"prompt": "blue", **fields}, files=files)
    assert response.status_code == 400 and response.json()["error"]["param"] == "strength"
    assert message in response.json()["error"]["message"] and not engine.submitted


@pytest.mark.parametrize(("fields", "info", "param", "message"), [
    ({}, {}, None, None),  # taken: the upload is the reference
    ({"strength": "0.5"}, {}, "strength", "an edit on 'fake-sd' (its upload enters as reference tokens) and strength "
                                          "do not compose"),
    ({"block_cache": "0.2"}, {}, None, None),  # reused per image or per token, the reference's with them
    ({"template_cache": "true"}, {}, None, None),  # a masked edit replays its reference too
    ({}, {"parallel": True}, "image", "and --devices do not compose (Ulysses shards are not tested"),
])
async def test_an_instruction_edit_is_an_edit_without_a_mask_on_an_instruction_edit_model(
        client: httpx.AsyncClient, engine: FakeEngine, fields, info, param, message):
    engine.info = replace(engine.info, instruction_edit=True, **info)
    files = [("image", ("in.png", png(64, 64), "image/png"))]
    response = await client.post(EDITS, data={"prompt": "make it blue", **fields}, files=files)
    if param is None:
        assert response.status_code == 200, response.text
        assert engine.submitted[0].mask is None and engine.submitted[0].is_edit
        return
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    assert message in response.json()["error"]["message"] and not engine.submitted


@pytest.mark.parametrize("size", [None, "auto"])
async def test_edit_without_size_keeps_the_upload_size(client: httpx.AsyncClient, engine: FakeEngine, size: str | None):
    data = {"prompt": "blue"} if size is None else {"prompt": "blue", "size": size}
    response = await client.post(EDITS, data=data, files=[("image", ("in.png", png(96, 64), "image/png"))])
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["size"] == "96x64" and open_image(body["data"][0]["b64_json"]).size == (96, 64)
    assert (engine.submitted[0].width, engine.submitted[0].height, engine.submitted[0].mask) == (96, 64, None)
    streamed = await client.post(EDITS, data={**data, "stream": "true"},
                                 files=[("image", ("in.png", png(96, 64), "image/png"))])
    assert parse_sse(streamed.text)[-1][1]["size"] == "96x64"


async def test_edit_upload_of_a_size_the_model_cannot_take(client: httpx.AsyncClient, engine: FakeEngine):
    files = [("image", ("in.png", png(100, 64), "image/png"))]
    response = await client.post(EDITS, data={"prompt": "blue"}, files=files)
    assert response.status_code == 400 and not engine.submitted
    error = response.json()["error"]
    assert error["param"] == "size" and "100x64" in error["message"] and "multiples of 8" in error["message"]
    resized = await client.post(EDITS, data={"prompt": "blue", "size": "128x64"}, files=files)
    assert resized.status_code == 200 and resized.json()["size"] == "128x64"
    assert (engine.submitted[0].width, engine.submitted[0].height) == (128, 64)


async def test_edit_stream_uses_edit_event_names(client: httpx.AsyncClient):
    files = [("image", ("in.png", png(), "image/png"))]
    response = await client.post(EDITS, data={"prompt": "blue", "stream": "true", "partial_images": "1"}, files=files)
    names = {name for name, _ in parse_sse(response.text)}
    assert {"image_edit.partial_image", "image_edit.completed", "gouache.progress"} <= names


async def test_models_health_metrics(client: httpx.AsyncClient):
    models = (await client.get("/v1/models")).json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["fake-sd"]
    assert (await client.get("/v1/models/fake-sd")).json()["object"] == "model"
    health = (await client.get("/health")).json()
    assert health == {"status": "ok", "model": "fake-sd", "waiting": 0, "running": 0}
    await client.post(GENERATIONS, json={"prompt": "fox"})
    await client.post(GENERATIONS, json={"prompt": "fox", "n": 0})
    metrics = await client.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    assert "gouache_request_latency_seconds_count 1.0" in metrics.text
    assert 'gouache_errors_total{kind="invalid_request"} 1.0' in metrics.text
    assert "gouache_queue_length 0.0" in metrics.text


async def test_chunked_body_over_limit_is_413(client: httpx.AsyncClient, config):
    async def chunks():
        for _ in range(config.max_body_bytes // 65536 + 2):
            yield b" " * 65536

    response = await client.post(GENERATIONS, content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["code"] == "payload_too_large"


@pytest.mark.anyio
async def test_a_client_that_leaves_mid_body_gets_no_error_logged(engine, config, caplog):
    """A cancel while the body is still being sent (the soak's cancels) is no server error."""
    app = create_app(engine, config)
    sent: list[dict] = []
    messages = iter([{"type": "http.request", "body": b'{"prompt": "a fo', "more_body": True},
                     {"type": "http.disconnect"}])

    async def receive() -> dict:
        return next(messages)

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/images/generations", "raw_path": b"/v1/images/generations", "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"), (b"host", b"testserver")],
             "client": ("127.0.0.1", 1), "server": ("testserver", 80)}
    with caplog.at_level(logging.INFO):
        await app(scope, receive, send)
    assert sent[0]["status"] == 499
    assert "left before sending" in caplog.text and "unhandled error" not in caplog.text
    assert not engine.submitted
