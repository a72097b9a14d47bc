"""The playground's files as the server hands them out (the browser tests drive the page
itself), the model cards' defaults that fill its form, and /v1/status's error counts."""

from __future__ import annotations

import dataclasses
import re

import pytest

from gouache.api.page import UI_DIR
from tests.api.test_auth import KEY, client_of

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("api_key, mark", [(None, "optional"), (KEY, "required")])
async def test_the_page_and_its_files_need_no_key_and_the_page_says_whether_the_api_does(engine, config, api_key, mark):
    async with client_of(engine, dataclasses.replace(config, api_key=api_key)) as client:
        page = await client.get("/")
        head = await client.head("/")
        script = await client.get("/ui/app.js")
        models = await client.get("/v1/models")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert head.status_code == 200 and head.content == b""
    assert page.headers["cache-control"] == script.headers["cache-control"] == "no-cache"
    assert f'<body data-api-key="{mark}">' in page.text
    assert script.status_code == 200 and "javascript" in script.headers["content-type"]
    assert models.status_code == (401 if api_key else 200)


@pytest.mark.parametrize("path", ["/ui/%2e%2e/v1/status", "/ui/%2e%2e/page.py", "/ui/%2e%2e/%2e%2e/config.py", "/ui/"])
async def test_the_open_files_reach_nothing_else(engine, config, path):
    async with client_of(engine, dataclasses.replace(config, api_key=KEY)) as client:
        response = await client.get(path)
    assert response.status_code == 404 and "gouache" not in response.text


def test_every_file_of_the_page_is_used_and_every_file_it_names_exists():
    html = (UI_DIR / "index.html").read_text()
    named = set(re.findall(r'(?:src|href)="/ui/([\w.-]+)"', html))
    for script in UI_DIR.glob("*.js"):
        named |= set(re.findall(r'from "\./([\w.-]+)"', script.read_text()))
    assert named == {path.name for path in UI_DIR.iterdir()} - {"index.html"}


async def test_model_cards_carry_the_defaults_a_request_form_needs(client):
    card = (await client.get("/v1/models")).json()["data"][0]
    assert card["gouache"] == {"family": "sd", "default_size": 256, "size_step": 8, "min_size": 64, "max_size": 2048,
                               "max_pixels": 2048 * 2048, "sizes": None, "default_steps": 4, "max_steps": 200,
                               "default_guidance": 7.5, "uses_cfg": True, "max_n": 10,
                               "max_batch": 8, "kinds": {"generation": True, "masked_edit": True,
                                                         "instruction_edit": False, "max_input_images": 1,
                                                         "img2img": True, "video": None}, "unserved": {}}
    assert (await client.get("/v1/models/fake-sd")).json()["gouache"] == card["gouache"]


async def test_status_counts_the_errors_answered_by_kind(client):
    assert (await client.get("/v1/status")).json()["errors"] == {}
    await client.post("/v1/images/generations", json={"prompt": "a fox", "size": "100x100"})
    await client.post("/v1/images/generations", json={"prompt": "a fox", "model": "nope"})
    await client.post("/v1/images/generations", json={"prompt": ""})
    status = (await client.get("/v1/status")).json()
    assert status["errors"] == {"invalid_request": 2, "model_not_found": 1} and status["model"] == "fake-sd"
