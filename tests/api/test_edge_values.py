"""Every numeric request field at the edges of what JSON and a form can carry (the smallest and
largest doubles, NaN, the infinities, negative zero, integers past 64 bits), on a real server
whose policy plans by deadline (so `slo_ms` reaches the scheduler): each answer is a 400 that
names the field, or the request is served; never a 500, and the server serves after."""

from __future__ import annotations

import base64
import io
import json

import httpx
import pytest
from PIL import Image

from gouache.cli import main
from tests.api.helpers import running_server_process

pytestmark = pytest.mark.slow

EDGES = ("5e-324", "-5e-324", "1e308", "-1e308", "1.7976931348623157e308", "NaN", "Infinity", "-Infinity", "-0.0",
         "0", "-1", "2147483648", "18446744073709551616", "1e40")
# the field, and the other fields it needs to be read at all
FIELDS = {
    "n": {}, "seed": {}, "num_inference_steps": {}, "guidance_scale": {}, "slo_ms": {}, "block_cache": {},
    "partial_images": {"stream": True}, "output_compression": {"output_format": "jpeg"},
}
DESIGNED_REFUSALS = {503: "deadline_unattainable"}  # patched-slo drops a request whose deadline it cannot meet


def png(colour=(200, 40, 40)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (64, 64), colour).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    cost = tmp_path_factory.mktemp("cost") / "cost.json"
    assert main(["profile", "--model", "shapes-unet", "--sizes", "64,96", "--samples", "8", "--max-batch", "2",
                 "--repeats", "1", "--out", str(cost)]) == 0
    with running_server_process("--model", "shapes-unet", "--policy", "patched-slo", "--cost-model", str(cost),
                                "--max-size", "64", "--max-steps", "2", "--max-n", "2", "--lora-dir",
                                "gouache/weights/loras/shapes-unet", "--controlnet-dir",
                                "gouache/weights/controlnets/shapes-unet") as (address, process):
        yield address
        assert process.poll() is None


def check(response: httpx.Response, field: str, value: str) -> None:
    if response.status_code in DESIGNED_REFUSALS:
        assert response.json()["error"]["code"] == DESIGNED_REFUSALS[response.status_code], response.text
        return
    assert response.status_code in (200, 400), f"{field}={value}: {response.status_code} {response.text[:300]}"
    if response.status_code == 400:
        error = response.json()["error"]
        assert field.split(".")[0] in (error.get("param") or "") + error["message"], (field, value, error)


def generation(url: str, body: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/images/generations", content=body, timeout=120,
                      headers={"content-type": "application/json"})


def json_body(field: str, value: str, extra: dict) -> str:
    base = {"prompt": "a red circle at the top left on a white background", "size": "64x64",
            "num_inference_steps": 2, **extra}
    return json.dumps(base)[:-1] + f', "{field}": {value}}}'


@pytest.mark.parametrize("field", FIELDS)
def test_a_json_field_at_every_edge_is_refused_by_name_or_served(url, field):
    for value in EDGES:
        check(generation(url, json_body(field, value, FIELDS[field])), field, value)


def test_adapter_scales_at_every_edge_are_refused_by_name_or_served(url):
    control = base64.b64encode(png((255, 255, 255))).decode()
    for value in EDGES:
        lora = json_body("loras", f'[{{"name": "palette", "scale": {value}}}]', {})
        check(generation(url, lora), "loras", value)
        net = json_body("controlnets", f'[{{"name": "layout", "image": "{control}", "scale": {value}}}]', {})
        check(generation(url, net), "controlnets", value)


@pytest.mark.parametrize("field", ["strength", "n", "seed", "guidance_scale", "slo_ms", "block_cache"])
def test_a_form_field_at_every_edge_is_refused_by_name_or_served(url, field):
    for value in (*EDGES, "nan", "inf", "-inf", "-0", "1_0", " 1"):
        form = {"prompt": "a red circle at the top left on a white background", "num_inference_steps": "2",
                field: value}
        response = httpx.post(f"{url}/v1/images/edits", data=form, files={"image": ("i.png", png(), "image/png")},
                              timeout=120)
        check(response, field, value)


def test_the_server_serves_after_the_edges(url):
    response = generation(url, json_body("seed", "1", {}))
    assert response.status_code == 200, response.text
