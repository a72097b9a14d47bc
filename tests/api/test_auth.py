"""API keys, served model names and /health's status, on the fake engine."""

from __future__ import annotations

import dataclasses

import httpx
import pytest

from gouache.api.server import create_app
from gouache.cli import build_parser
from gouache.config import ServerConfig
from gouache.models.zoo import model_id
from tests.api.fake_engine import FakeEngine

pytestmark = pytest.mark.anyio
KEY = "sk-test-123"


def client_of(engine: FakeEngine, config: ServerConfig) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(create_app(engine, config), raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://testserver")


@pytest.mark.parametrize("headers, why", [
    ({}, "Missing API key"),
    ({"Authorization": "Bearer wrong"}, "Incorrect API key"),
    ({"Authorization": KEY}, "Incorrect API key"),  # the key without its scheme
])
@pytest.mark.parametrize("method, path", [
    ("GET", "/v1/models"), ("POST", "/v1/images/generations"), ("GET", "/metrics"),
    ("DELETE", "/v1/images/requests/img_x"), ("GET", "/no/such/route"),
])
async def test_every_route_but_health_needs_the_key(engine, config, headers, why, method, path):
    async with client_of(engine, dataclasses.replace(config, api_key=KEY)) as client:
        response = await client.request(method, path, headers=headers, json={"prompt": "a fox"})
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]
    assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error" and why in error["message"]
    assert engine.submitted == []


async def test_the_right_key_opens_every_route_and_health_needs_none(engine, config):
    async with client_of(engine, dataclasses.replace(config, api_key=KEY)) as client:
        auth = {"Authorization": f"Bearer {KEY}"}
        generated = await client.post("/v1/images/generations", headers=auth, json={"prompt": "a fox", "size": "64x64"})
        models = await client.get("/v1/models", headers=auth)
        health = await client.get("/health")
    assert generated.status_code == 200 and models.status_code == 200 and health.status_code == 200


async def test_served_model_names_replace_the_model_id(engine, config):
    async with client_of(engine, dataclasses.replace(config, served_model_names=("house-style", "v2"))) as client:
        listed = [card["id"] for card in (await client.get("/v1/models")).json()["data"]]
        alias = await client.post("/v1/images/generations", json={"prompt": "a fox", "model": "v2", "size": "64x64"})
        own_id = await client.post("/v1/images/generations", json={"prompt": "a fox", "model": "fake-sd"})
        retrieved = await client.get("/v1/models/v2")
    assert listed == ["house-style", "v2"]
    assert alias.status_code == 200 and retrieved.json()["id"] == "v2"
    assert own_id.status_code == 404 and "'house-style', 'v2'" in own_id.json()["error"]["message"]


@pytest.mark.parametrize("status", ["draining", "dead"])
async def test_health_is_503_unless_the_engine_serves(engine, config, status):
    """Before: /health answered 200 "ok" while the engine thread was dead."""
    engine.state = status
    async with client_of(engine, config) as client:
        response = await client.get("/health")
    assert response.status_code == 503 and response.json()["status"] == status


def test_a_directory_model_is_named_by_its_folder_never_its_path():
    assert model_id("/srv/models/my-sdxl/") == "my-sdxl"
    assert model_id("relative/dir") == "dir"
    assert model_id("tiny-sdxl") == "tiny-sdxl"


def test_the_api_key_comes_from_the_environment_unless_given(monkeypatch):
    monkeypatch.setenv("GOUACHE_API_KEY", "from-env")
    assert build_parser().parse_args(["serve"]).api_key == "from-env"
    assert build_parser().parse_args(["serve", "--api-key", "flag"]).api_key == "flag"
    monkeypatch.delenv("GOUACHE_API_KEY")
    assert build_parser().parse_args(["serve"]).api_key is None
