"""GET /v1/status: a running request's size and step, then the recent steps' latency and
overhead, images per second and each device block's last step."""

import asyncio
import contextlib

import httpx

from gouache.api.server import create_app
from gouache.config import EngineConfig, SchedulerConfig, ServerConfig
from gouache.engine.client import AsyncEngine
from gouache.engine.status import RECENT_STEPS, WINDOW_S
from gouache.runner.describe import model_info
from gouache.sched.policies import make_policy
from tests.engine.test_async_engine import run


@contextlib.asynccontextmanager
async def api_of(pipe):
    """An HTTP client of the API around a started engine on `pipe` (tiny-sd)."""
    engine = AsyncEngine(pipe, model_info(pipe, "tiny-sd"), EngineConfig(), make_policy(SchedulerConfig(policy="orca")))
    await engine.start()
    try:
        transport = httpx.ASGITransport(create_app(engine, ServerConfig()))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as http:
            yield http
    finally:
        await engine.aclose()


def test_status_shows_a_running_request_and_then_the_steps_it_took(pipes):
    async def scenario():
        async with api_of(pipes("tiny-sd")) as http:
            idle = (await http.get("/v1/status")).json()
            body = {"prompt": "a fox", "size": "64x96", "num_inference_steps": 120, "seed": 1}
            answer = asyncio.ensure_future(http.post("/v1/images/generations", json=body))
            running = None
            for _ in range(600):
                status = (await http.get("/v1/status")).json()
                if status["requests"] and status["requests"][0]["step"] > 2:
                    running = status
                    break
                await asyncio.sleep(0.02)
            assert (await answer).status_code == 200
            after = (await http.get("/v1/status")).json()
        return idle, running, after

    idle, running, after = run(scenario())
    assert idle["requests"] == [] and idle["steps"]["recent"] == 0 and idle["status"] == "ok"
    [request] = running["requests"]
    assert request["size"] == "64x96" and request["status"] == "running" and 2 < request["step"] < 120
    assert request["steps"] == 120 and running["running"] == 1 and running["model"] == "tiny-sd"
    assert after["requests"] == [] and after["finished"] == 1 and after["images_per_s"] > 0
    assert (after["steps"]["recent"] == RECENT_STEPS
            and 0 < after["steps"]["overhead_ms_median"] < after["steps"]["latency_ms_median"])
    assert after["devices"]["0"]["requests"] == 1 and after["devices"]["0"]["step_ms"] > 0


def test_images_and_requests_per_second_count_a_request_of_three_images_once(pipes):
    async def scenario():
        async with api_of(pipes("tiny-sd")) as http:
            body = {"prompt": "a fox", "size": "64x64", "num_inference_steps": 2, "n": 3}
            assert (await http.post("/v1/images/generations", json=body)).status_code == 200
            return (await http.get("/v1/status")).json()

    status = run(scenario())
    assert round(status["images_per_s"] * WINDOW_S) == 3 and round(status["requests_per_s"] * WINDOW_S) == 1
