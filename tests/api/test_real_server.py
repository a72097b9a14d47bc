"""`gouache serve` as a user runs it (a real process, the real engine, tiny-sdxl), driven by the
official openai client and by the malformed-request corpus; and the README's first request, on
the default model."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from gouache.config import ServerConfig
from tests.api.corpus import EDITS, malformed_requests
from tests.api.helpers import open_image, running_server
from tests.engine.test_text_loras import text_lora

pytestmark = pytest.mark.slow

SIZE_STEP = 16  # tiny-sdxl


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    from safetensors.torch import save_file

    from gouache.controlnet.model import random_controlnet
    from gouache.lora.files import random_lora
    from gouache.models.zoo import load_pipeline

    loras, controlnets = tmp_path_factory.mktemp("loras"), tmp_path_factory.mktemp("controlnets")
    save_file(random_lora(load_pipeline("tiny-sdxl"), rank=8), str(loras / "ink.safetensors"))
    save_file(text_lora(load_pipeline("tiny-sdxl"), seed=3), str(loras / "wording.safetensors"))  # text encoders only
    random_controlnet(load_pipeline("tiny-sdxl"), std=0.2).save_pretrained(str(controlnets / "edges"))
    with running_server("--model", "tiny-sdxl", "--lora-dir", str(loras), "--controlnet-dir", str(controlnets),
                        "--controlnet-workers", "1") as url:
        yield url


def test_the_readmes_first_request_gets_a_picture_from_the_default_model():
    body = {"prompt": "a red circle at the top left and a blue square at the bottom right on a white background"}
    with running_server() as url:
        assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["shapes-unet"]
        response = httpx.post(f"{url}/v1/images/generations", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert open_image(response.json()["data"][0]["b64_json"]).size == (128, 128)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def rgba_png(array: np.ndarray) -> io.BytesIO:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, "PNG")
    buffer.seek(0)
    buffer.name = "image.png"
    return buffer


def test_openai_client_generates_n_images_of_the_asked_size(server_url):
    result = client(server_url).images.generate(
        model="tiny-sdxl", prompt="a red fox", size="256x256", n=2, response_format="b64_json",
        extra_body={"num_inference_steps": 4, "seed": 3},
    )
    images = [open_image(item.b64_json) for item in result.data]
    assert [im.size for im in images] == [(256, 256)] * 2
    assert images[0].tobytes() != images[1].tobytes()  # seeds 3 and 4


def test_openai_client_asks_for_a_lora(server_url):
    fields = {"num_inference_steps": 3, "seed": 5}
    plain, ink = (client(server_url).images.generate(prompt="a red fox", size="64x64", extra_body={**fields, **extra})
                  for extra in ({}, {"loras": [{"name": "ink", "scale": 1.5}]}))
    assert plain.data[0].b64_json != ink.data[0].b64_json
    assert [entry["id"] for entry in httpx.get(f"{server_url}/v1/loras").json()["data"]] == ["ink", "wording"]
    wording = client(server_url).images.generate(prompt="a red fox", size="64x64",
                                                 extra_body={**fields, "loras": [{"name": "wording"}]})
    # the prompt's encoding changed
    assert wording.data[0].b64_json not in (plain.data[0].b64_json, ink.data[0].b64_json)
    registered = httpx.post(f"{server_url}/v1/loras", json={"name": "wording"}).json()
    assert registered["text_encoders"] == ["text_encoder", "text_encoder_2"]
    with pytest.raises(openai.BadRequestError, match="unknown LoRA 'nope'"):
        client(server_url).images.generate(prompt="a red fox", extra_body={"loras": [{"name": "nope"}]})


def test_openai_client_asks_for_controlnets_with_a_lora(server_url):
    edges = base64.b64encode(rgba_png(np.random.default_rng(2).integers(0, 255, (64, 64, 4), np.uint8)).read()).decode()
    fields = {"num_inference_steps": 3, "seed": 5, "loras": [{"name": "ink"}]}
    images = [client(server_url).images.generate(prompt="a red fox", size="64x64", extra_body={**fields, **extra})
              for extra in ({}, {"controlnets": [{"name": "edges", "image": edges}]},
                            {"controlnets": [{"name": "edges", "image": edges}], "controlnet_mode": "async"})]
    assert len({image.data[0].b64_json for image in images}) == 3  # the ControlNet, and its residuals a step late
    assert [entry["id"] for entry in httpx.get(f"{server_url}/v1/controlnets").json()["data"]] == ["edges"]
    with pytest.raises(openai.BadRequestError, match="must be the image's size, 64x64"):
        client(server_url).images.generate(prompt="a red fox", size="64x64", extra_body={
            "controlnets": [{"name": "edges",
                             "image": base64.b64encode(rgba_png(np.zeros((32, 32, 4), np.uint8)).read()).decode()}]})


def test_openai_client_edit_keeps_pixels_outside_the_mask(server_url):
    rng = np.random.default_rng(1)
    original = rng.integers(0, 255, (128, 128, 3), dtype=np.uint8)
    mask = np.full((128, 128, 4), 255, np.uint8)
    mask[32:96, 32:96, 3] = 0
    result = client(server_url).images.edit(
        image=rgba_png(original), mask=rgba_png(mask), prompt="a cat", size="128x128",
        extra_body={"num_inference_steps": 3},
    )
    out = np.asarray(open_image(result.data[0].b64_json).convert("RGB"))
    keep = mask[..., 3] == 255
    assert np.array_equal(out[keep], original[keep]) and not np.array_equal(out[~keep], original[~keep])


def test_openai_client_edit_without_a_mask_takes_a_strength(server_url):
    """img2img: the strength picks where in the schedule the upload starts (0.5: the last 2 of 4
    steps), so each strength, and none (repainted from noise), gives its own picture."""
    original = np.random.default_rng(3).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    pictures = {strength: client(server_url).images.edit(
        image=rgba_png(original), prompt="a cat", size="64x64",
        extra_body={"num_inference_steps": 4, "seed": 2, **({} if strength is None else {"strength": strength})},
    ).data[0].b64_json for strength in (None, 0.5, 1.0)}
    assert len(set(pictures.values())) == 3
    card = httpx.get(f"{server_url}/v1/models/tiny-sdxl").json()["gouache"]["kinds"]
    assert card["img2img"] and card["masked_edit"] and not card["instruction_edit"]
    with pytest.raises(openai.BadRequestError, match="send the mask or the strength, not both"):
        client(server_url).images.edit(image=rgba_png(original), mask=rgba_png(np.zeros((64, 64, 4), np.uint8)),
                                       prompt="a cat", extra_body={"strength": 0.5})


def test_curl_style_request_returns_a_png_of_that_size(server_url):
    body = b'{"prompt":"a red fox","size":"512x512","num_inference_steps":2}'
    curl_headers = {"content-type": "application/x-www-form-urlencoded"}  # what `curl -d` sends
    response = httpx.post(f"{server_url}/v1/images/generations", content=body, headers=curl_headers, timeout=120)
    body = response.json()
    assert response.status_code == 200 and set(body) >= {"created", "data"}
    assert open_image(body["data"][0]["b64_json"]).size == (512, 512)


def test_malformed_requests_get_4xx_and_the_server_keeps_serving(server_url):
    bomb = io.BytesIO()
    Image.new("L", (5000, 5000)).save(bomb, "PNG")  # 25 MP, above the 16 MP upload limit
    cases = malformed_requests(ServerConfig(), SIZE_STEP)
    assert len(cases) >= 30
    with httpx.Client(base_url=server_url, timeout=60) as http:
        for case in cases:
            response = http.request(case.method, case.path, **case.request_kwargs())
            assert response.status_code == case.status, (case.name, response.text)
            error = response.json()["error"]
            assert error["message"] and (case.param is None or error["param"] == case.param), case.name
        files = [("image", ("big.png", bomb.getvalue(), "image/png"))]
        response = http.post(EDITS, data={"prompt": "x", "size": "64x64"}, files=files)
        assert response.status_code == 400 and response.json()["error"]["param"] == "image"
        unsized = http.post(EDITS, data={"prompt": "x"}, files=files)  # its own size is too large too
        assert unsized.status_code == 400 and unsized.json()["error"]["param"] == "size"
        ok = http.post("/v1/images/generations",
                       json={"prompt": "still alive", "size": "64x64", "num_inference_steps": 2})
        assert ok.status_code == 200 and len(ok.json()["data"]) == 1
        assert http.get("/health").json()["status"] == "ok"


def test_an_instruction_edit_model_through_the_openai_client():
    """tiny-flux-kontext: an edit without a mask follows the prompt (the upload a reference),
    one with a mask keeps the pixels outside it; its card says so, and a strength is refused."""
    original = np.random.default_rng(4).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    mask = np.full((64, 64, 4), 255, np.uint8)
    mask[16:48, 16:48, 3] = 0
    with running_server("--model", "tiny-flux-kontext") as url:
        kinds = httpx.get(f"{url}/v1/models/tiny-flux-kontext").json()["gouache"]["kinds"]
        steps = {"num_inference_steps": 2, "seed": 1}
        instructed = client(url).images.edit(image=rgba_png(original), prompt="make it blue", extra_body=steps)
        generated = client(url).images.generate(prompt="make it blue", size="64x64", extra_body=steps)
        masked = client(url).images.edit(image=rgba_png(original), mask=rgba_png(mask), prompt="make it blue",
                                         extra_body=steps)
        with pytest.raises(openai.BadRequestError, match="and strength do not compose"):
            client(url).images.edit(image=rgba_png(original), prompt="make it blue", extra_body={"strength": 0.5})
    assert kinds["instruction_edit"] and not kinds["img2img"] and kinds["masked_edit"]
    assert open_image(instructed.data[0].b64_json).size == (64, 64)
    assert instructed.data[0].b64_json != generated.data[0].b64_json  # the upload counts
    out = np.asarray(open_image(masked.data[0].b64_json).convert("RGB"))
    keep = mask[..., 3] == 255
    assert np.array_equal(out[keep], original[keep])



@pytest.mark.parametrize(("model", "family", "no_cfg"),
                         [("tiny-qwen-image", "qwenimage", 1.0), ("tiny-zimage", "zimage", 0.0)])
def test_a_newer_family_through_the_openai_client(model, family, no_cfg):
    """Qwen-Image and Z-Image: generations of two sizes, a masked edit keeping the pixels outside
    its mask, an img2img; a negative prompt where guidance runs no CFG is a 400 naming the bound;
    the card names what the model does not serve, and asking for it is a 400."""
    original = np.random.default_rng(5).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    mask = np.full((64, 64, 4), 255, np.uint8)
    mask[16:48, 16:48, 3] = 0
    steps = {"num_inference_steps": 2, "seed": 1}
    with running_server("--model", model, "--max-batch-size", "4") as url:
        card = httpx.get(f"{url}/v1/models/{model}").json()["gouache"]
        wide = client(url).images.generate(prompt="a red fox", size="96x64", extra_body=steps)
        square = client(url).images.generate(prompt="a red fox", size="64x64", n=2,
                                             extra_body={**steps, "negative_prompt": "blurry"})
        masked = client(url).images.edit(image=rgba_png(original), mask=rgba_png(mask), prompt="a cat",
                                         extra_body=steps)
        img2img = client(url).images.edit(image=rgba_png(original), prompt="a cat",
                                          extra_body={**steps, "strength": 0.5})
        with pytest.raises(openai.BadRequestError, match=f"'{model}' .a {family} model. does not serve block_cache"):
            client(url).images.generate(prompt="a red fox", size="64x64", extra_body={"block_cache": 0.1})
        with pytest.raises(openai.BadRequestError,
                           match=f"turns classifier-free guidance off; send one above {no_cfg:g}"):
            client(url).images.generate(prompt="a red fox", size="64x64",
                                        extra_body={"negative_prompt": "blurry", "guidance_scale": no_cfg})
    assert card["family"] == family and set(card["unserved"]) == {"block_cache", "template"}
    assert card["kinds"]["img2img"] and not card["kinds"]["instruction_edit"]
    assert open_image(wide.data[0].b64_json).size == (96, 64)
    assert len({d.b64_json for d in square.data}) == 2
    out = np.asarray(open_image(masked.data[0].b64_json).convert("RGB"))
    keep = mask[..., 3] == 255
    assert np.array_equal(out[keep], original[keep]) and not np.array_equal(out[~keep], original[~keep])
    assert open_image(img2img.data[0].b64_json).size == (64, 64)


def edits_of_several_images(url: str, model: str, seed: int, masked_uploads: int) -> dict:
    """On the server of `model` at `url`: an edit of one image, of two (the second of another
    size), and a masked edit of the first `masked_uploads`; checks that the second image counts
    and that the masked edit keeps the pixels outside its mask. Returns the model's card kinds."""
    rng = np.random.default_rng(seed)
    first, second = rng.integers(0, 255, (64, 64, 3), dtype=np.uint8), rng.integers(0, 255, (80, 64, 3), dtype=np.uint8)
    uploads = [rgba_png(first), rgba_png(second)]
    mask = np.full((64, 64, 4), 255, np.uint8)
    mask[16:48, 16:48, 3] = 0
    steps = {"num_inference_steps": 2, "seed": 1}
    kinds = httpx.get(f"{url}/v1/models/{model}").json()["gouache"]["kinds"]
    one = client(url).images.edit(image=uploads[0], prompt="make it blue", extra_body=steps)
    two = client(url).images.edit(image=uploads, prompt="make it blue", extra_body=steps)
    masked = client(url).images.edit(image=uploads[:masked_uploads], mask=rgba_png(mask), prompt="make it blue",
                                     extra_body=steps)
    assert one.data[0].b64_json != two.data[0].b64_json  # the second image counts
    out = np.asarray(open_image(masked.data[0].b64_json).convert("RGB"))
    keep = mask[..., 3] == 255
    assert np.array_equal(out[keep], first[keep]) and not np.array_equal(out[~keep], first[~keep])
    return kinds


def test_a_flux2_model_edits_several_images_through_the_openai_client():
    """tiny-flux2-klein: edits of one and of two images, a masked one of two; five images, a
    reference below the size step or one that is no image are a 400 naming `image`."""
    image, steps = rgba_png(np.zeros((64, 64, 3), np.uint8)), {"num_inference_steps": 2}
    with running_server("--model", "tiny-flux2-klein", "--max-batch-size", "4") as url:
        kinds = edits_of_several_images(url, "tiny-flux2-klein", 6, masked_uploads=2)
        with pytest.raises(openai.BadRequestError, match="5 files were sent; an edit on 'tiny-flux2-klein' takes at "
                                                         "most 4 images"):
            client(url).images.edit(image=[image] * 5, prompt="x", extra_body=steps)
        with pytest.raises(openai.BadRequestError, match="image 2 is 8x8; each side must be at least 16 pixels"):
            client(url).images.edit(image=[image, rgba_png(np.zeros((8, 8, 3), np.uint8))], prompt="x",
                                    extra_body=steps)
        with pytest.raises(openai.BadRequestError, match="image 2: image is not a readable PNG"):
            client(url).images.edit(image=[image, b"hello"], prompt="x", extra_body=steps)
    assert kinds["instruction_edit"] and kinds["max_input_images"] == 4 and not kinds["img2img"]


def test_a_qwen_image_edit_plus_model_through_the_openai_client():
    """tiny-qwen-image-edit-plus: edits of one and of two images (the VL encoder reads them, and
    they enter as reference tokens), a masked one; a generation, four images or one step are a
    400 that says what to fix."""
    image, steps = rgba_png(np.zeros((64, 64, 3), np.uint8)), {"num_inference_steps": 2}
    with running_server("--model", "tiny-qwen-image-edit-plus", "--max-batch-size", "4") as url:
        kinds = edits_of_several_images(url, "tiny-qwen-image-edit-plus", 7, masked_uploads=1)
        with pytest.raises(openai.BadRequestError, match="edits images and makes none from text alone"):
            client(url).images.generate(prompt="a red fox", size="64x64", extra_body=steps)
        with pytest.raises(openai.BadRequestError, match="4 files were sent; an edit on 'tiny-qwen-image-edit-plus' "
                                                         "takes at most 3 images"):
            client(url).images.edit(image=[image] * 4, prompt="x", extra_body=steps)
        with pytest.raises(openai.BadRequestError, match="takes at least 2 steps"):
            client(url).images.edit(image=image, prompt="x", extra_body={"num_inference_steps": 1})
    assert kinds == {"generation": False, "masked_edit": True, "instruction_edit": True, "max_input_images": 3,
                     "img2img": False, "video": None}


def test_tenants_keys_reload_on_sighup(tmp_path):
    """`--api-keys FILE`: each key is its tenant; `kill -HUP` takes the file's new keys without a restart."""
    import json
    import signal
    import time

    from tests.api.helpers import running_server_process

    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": [{"key": "sk-alpha", "name": "alpha", "tiers": ["default"]}]}))
    body = {"prompt": "a fox", "size": "64x64", "num_inference_steps": 2}
    with running_server_process("--model", "tiny-sd", "--api-keys", str(keys)) as (url, proc):
        def post(key: str, **extra) -> httpx.Response:
            return httpx.post(f"{url}/v1/images/generations", json={**body, **extra},
                              headers={"Authorization": f"Bearer {key}"}, timeout=60)

        before = [post("sk-alpha").status_code, post("sk-alpha", service_tier="priority").status_code,
                  post("sk-beta").status_code]
        keys.write_text(json.dumps({"keys": [{"key": "sk-beta", "name": "beta"}]}))
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while post("sk-beta").status_code != 200:
            assert time.monotonic() < deadline, "the keys were not reloaded"
            time.sleep(0.2)
        after = [post("sk-alpha").status_code, post("sk-beta", service_tier="priority").status_code]
    assert before == [200, 403, 401] and after == [401, 200]
