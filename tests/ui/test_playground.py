"""The playground at GET / in a real browser: it loads without console errors, a generation
shows progress and previews and then images of the requested size, an edit with a painted mask
keeps every unpainted pixel of the upload, bad input shows the API's own message, the status
tab follows a running request (and shows the service tier it was sent in), and with --api-key
the page asks for the key. Each state's
screenshot goes to benchmarks/results/ui/."""

from __future__ import annotations

import base64
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from PIL import Image

from gouache.data.shapes import layout_map, parse_caption, render, sample_scene, unplaced_caption
from tests.api.helpers import open_image
from tests.ui.conftest import API_KEY

pytestmark = pytest.mark.slow
CAPTION = "a red circle at the top left and a blue square at the bottom right on a white background"


def wait(browser, condition, timeout: float = 60):
    from selenium.webdriver.support.wait import WebDriverWait

    return WebDriverWait(browser, timeout, poll_frequency=0.05).until(lambda _: condition())


def console_errors(browser) -> list[str]:
    return [entry["message"] for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]


def css(browser, selector: str):
    from selenium.webdriver.common.by import By

    return browser.find_element(By.CSS_SELECTOR, selector)


def open_page(browser, url: str, tab: str = "generate") -> None:
    browser.get("about:blank")  # a fresh page even where only the #tab differs
    browser.get_log("browser")  # forget what earlier pages logged
    browser.get(f"{url}/#{tab}")


def connected(browser) -> bool:
    return css(browser, "#server-line").text == "serving shapes-unet"


def fill(form, **values) -> None:
    from selenium.webdriver.common.by import By

    for name, value in values.items():
        field = form.find_element(By.NAME, name)
        field.clear()
        field.send_keys(str(value))


def figures(browser) -> list[dict]:
    return browser.execute_script("""
        return [...document.querySelectorAll('.tab:not([hidden]) .request:first-child figure.image')].map((f) => {
          const img = f.querySelector('img');
          return {state: f.dataset.state, previews: Number(f.dataset.previews || 0), seed: f.dataset.seed,
                  step: f.querySelector('progress').value, total: f.querySelector('progress').max,
                  width: img.naturalWidth, height: img.naturalHeight, src: img.getAttribute('src')};
        });""")


def pixels(data_url: str) -> np.ndarray:
    return np.asarray(open_image(data_url.split(",", 1)[1]).convert("RGB"))


def test_the_page_loads_without_console_errors_and_fills_the_models_defaults(browser, server, screenshot):
    open_page(browser, server)
    wait(browser, lambda: connected(browser))
    form = css(browser, "#generate-form")
    assert form.find_element("name", "width").get_attribute("value") == "128"
    assert form.find_element("name", "num_inference_steps").get_attribute("placeholder") == "20"
    assert css(browser, "#key-form").is_displayed() is False
    screenshot("playground")
    assert console_errors(browser) == []


def test_a_generation_shows_progress_and_previews_then_images_of_the_requested_size(browser, server, screenshot):
    open_page(browser, server)
    wait(browser, lambda: connected(browser))
    form = css(browser, "#generate-form")
    fill(form, prompt=CAPTION, width=192, height=128, num_inference_steps=40, seed=7, n=2, partial_images=2)
    form.find_element("css selector", "button[type=submit]").click()

    def previewing():
        shown = figures(browser)
        return any(f["previews"] and f["state"] == "running" and 0 < f["step"] < f["total"] for f in shown)

    wait(browser, previewing)
    screenshot("generating")
    wait(browser, lambda: [f["state"] for f in figures(browser)] == ["done", "done"])
    screenshot("generated")
    done = figures(browser)
    assert [(f["width"], f["height"], f["seed"]) for f in done] == [(192, 128, "7"), (192, 128, "8")]
    assert all(f["previews"] >= 1 for f in done)  # a preview encoded after its image is dropped
    # the image shown is the API's answer for that seed, not a preview
    body = {"prompt": CAPTION, "size": "192x128", "num_inference_steps": 40, "seed": 7}
    answer = httpx.post(f"{server}/v1/images/generations", json=body, timeout=120).json()
    expected = np.asarray(open_image(answer["data"][0]["b64_json"]).convert("RGB"), dtype=float)
    assert np.abs(pixels(done[0]["src"]) - expected).mean() < 1.0
    assert console_errors(browser) == []


def _upload(server: str, path) -> np.ndarray:
    """A picture from the server, saved as an opaque RGBA PNG (as browsers and screenshots save
    them: with no mask its alpha would repaint nothing)."""
    body = {"prompt": CAPTION, "size": "128x128", "seed": 3}
    answer = httpx.post(f"{server}/v1/images/generations", json=body, timeout=120).json()
    open_image(answer["data"][0]["b64_json"]).convert("RGBA").save(path)
    return np.asarray(Image.open(path).convert("RGB"))


def test_an_edit_with_a_painted_mask_keeps_every_unpainted_pixel_of_the_upload(browser, server, screenshot, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains

    upload = _upload(server, tmp_path / "upload.png")
    Image.new("RGB", (200, 136), "white").save(tmp_path / "off-step.png")
    open_page(browser, server, "edit")
    wait(browser, lambda: connected(browser))
    form = css(browser, "#edit-form")

    def size() -> list[str]:
        return [form.find_element("name", side).get_attribute("value") for side in ("width", "height")]

    form.find_element("name", "image").send_keys(str(tmp_path / "off-step.png"))
    wait(browser, lambda: size() == ["192", "128"])  # down to shapes-unet's size step, 32
    form.find_element("name", "image").send_keys(str(tmp_path / "upload.png"))
    wait(browser, lambda: size() == ["128", "128"])
    mask = css(browser, "#edit-form canvas.mask")
    # shown 3x (384 px for 128): a brush stroke right then down, then the eraser down through it
    ActionChains(browser).move_to_element_with_offset(mask, -96, -30).click_and_hold().move_by_offset(150, 0) \
        .move_by_offset(0, 60).release().perform()
    form.find_element("css selector", "[data-tool=eraser]").click()
    ActionChains(browser).move_to_element_with_offset(mask, 0, -60).click_and_hold().move_by_offset(0, 120) \
        .release().perform()
    screenshot("edit-mask")
    alpha = np.array(browser.execute_script("""
        const c = document.querySelector('#edit-form canvas.mask');
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        return Array.from(d.filter((_, i) => i % 4 === 3));"""), dtype=np.uint8).reshape(128, 128)
    assert alpha[54, 45] == 255 and alpha[64, 82] == 255  # painted
    assert alpha[54, 64] == 0  # painted, then erased

    form.find_element("css selector", ".adapter[data-name=palette] .use").click()  # sent as JSON text
    fill(form, prompt="a green triangle in the center on a gray background", seed=5, partial_images=1)
    form.find_element("css selector", "button[type=submit]").click()
    wait(browser, lambda: [f["state"] for f in figures(browser)] == ["done"])
    screenshot("edited")
    [edited] = figures(browser)
    result = pixels(edited["src"])
    assert result.shape == upload.shape
    kept = alpha == 0
    assert np.array_equal(result[kept], upload[kept])  # every unpainted pixel, exactly
    repainted = alpha == 255
    # a grey background asked over a white upload: every repainted pixel differs from the upload's here
    assert (result[repainted] != upload[repainted]).any(axis=-1).mean() > 0.9

    form.find_element("css selector", ".clear-mask").click()  # nothing painted: the whole image is repainted
    form.find_element("css selector", "button[type=submit]").click()
    wait(browser, lambda: len(browser.find_elements("css selector", "#tab-edit .request")) == 2
         and [f["state"] for f in figures(browser)] == ["done"])
    whole = pixels(figures(browser)[0]["src"])
    assert (whole != upload).any(axis=-1).mean() > 0.1 and not np.array_equal(whole, result)

    fill(form, strength=0.3)  # nothing painted and a strength: img2img, the upload redrawn from 30 % noise
    form.find_element("css selector", "button[type=submit]").click()
    wait(browser, lambda: len(browser.find_elements("css selector", "#tab-edit .request")) == 3
         and [f["state"] for f in figures(browser)] == ["done"])
    screenshot("img2img")
    redrawn = pixels(figures(browser)[0]["src"])
    distance = {name: np.abs(image.astype(int) - upload).mean()
                for name, image in (("img2img", redrawn), ("whole", whole))}
    assert distance["img2img"] < 0.5 * distance["whole"], distance  # the picture shows through
    assert console_errors(browser) == []


def unpainted_edit(browser, url: str, model: str, uploads: list, prompt: str, name: str, screenshot, steps: int = 2):
    """Edit `uploads` (paths: the image, then further images) on the page of the server at `url`
    with nothing painted, in `steps` steps; the image shown, the API's answer to the same request,
    and the form."""
    open_page(browser, url, "edit")
    wait(browser, lambda: css(browser, "#server-line").text == f"serving {model}")
    form = css(browser, "#edit-form")
    form.find_element("name", "image").send_keys(str(uploads[0]))
    for path in uploads[1:]:
        form.find_element("name", "references").send_keys(str(path))
    wait(browser, lambda: form.find_element("name", "width").get_attribute("value") == "64")
    fill(form, prompt=prompt, seed=3, num_inference_steps=steps, partial_images=0)
    form.find_element("css selector", "button[type=submit]").click()
    wait(browser, lambda: [f["state"] for f in figures(browser)] == ["done"])
    screenshot(name)
    data = {"prompt": prompt, "seed": "3", "num_inference_steps": str(steps), "size": "64x64"}
    files = [("image" if i == 0 else "image[]", (path.name, path.read_bytes(), "image/png"))
             for i, path in enumerate(uploads)]
    answer = httpx.post(f"{url}/v1/images/edits", data=data, files=files, timeout=120).json()
    return pixels(figures(browser)[0]["src"]), open_image(answer["data"][0]["b64_json"]).convert("RGB"), form


def test_on_an_instruction_edit_model_an_unpainted_edit_goes_without_a_mask(browser, screenshot, tmp_path):
    """tiny-flux-kontext: with nothing painted the page sends no mask (the prompt edits the
    picture, the upload a reference): the image it shows is the API's answer to the same
    request without a mask."""
    from tests.api.helpers import running_server

    Image.fromarray(np.random.default_rng(5).integers(0, 255, (64, 64, 3), dtype=np.uint8)).convert("RGBA") \
        .save(tmp_path / "upload.png")
    with running_server("--model", "tiny-flux-kontext") as url:
        shown, answer, form = unpainted_edit(browser, url, "tiny-flux-kontext", [tmp_path / "upload.png"],
                                             "make it blue", "instruction-edit", screenshot)
        assert form.find_element("name", "strength").get_attribute("disabled") == "true"
        assert not form.find_element("css selector", ".references").is_displayed()  # Kontext edits one image
    assert np.array_equal(shown, np.asarray(answer))
    assert console_errors(browser) == []


def test_a_model_that_only_edits_opens_on_the_edit_tab_and_edits_by_instruction(browser, screenshot, tmp_path):
    """shapes-edit makes no images from text: the page opens on the Edit tab; an instruction edit
    of a shapes scene, nothing painted, shows the API's answer to the same request."""
    from gouache.data.edits import parse_instruction
    from tests.api.helpers import running_server

    edit = parse_instruction("make the red circle blue", parse_caption("a red circle in the center and a green "
                                                                       "square at the top left on a white background"))
    Image.fromarray(render(edit.source, 64, 64, 0)).save(tmp_path / "scene.png")
    with running_server("--model", "shapes-edit") as url:
        open_page(browser, url, "")
        wait(browser, lambda: css(browser, "#server-line").text == "serving shapes-edit")
        assert css(browser, "#tab-edit").is_displayed() and not css(browser, "#tab-generate").is_displayed()
        shown, answer, _ = unpainted_edit(browser, url, "shapes-edit", [tmp_path / "scene.png"], edit.instruction,
                                          "instruction-edit-shapes", screenshot, steps=20)
    assert np.array_equal(shown, np.asarray(answer))
    assert console_errors(browser) == []


def test_a_model_that_edits_several_images_gets_each_chosen_image(browser, screenshot, tmp_path):
    """tiny-flux2-klein: the page offers further images (hidden for one-image models) and sends
    them as `image[]`: the image it shows is the API's answer to the same two uploads, not the
    first's alone."""
    from tests.api.helpers import running_server

    rng = np.random.default_rng(6)
    for name, shape in (("first", (64, 64, 3)), ("second", (80, 64, 3))):
        Image.fromarray(rng.integers(0, 255, shape, dtype=np.uint8)).save(tmp_path / f"{name}.png")
    uploads = [tmp_path / "first.png", tmp_path / "second.png"]
    with running_server("--model", "tiny-flux2-klein", "--max-batch-size", "4") as url:
        _, alone, _ = unpainted_edit(browser, url, "tiny-flux2-klein", uploads[:1], "put the second in the first",
                                     "several-images", screenshot)
        shown, answer, _ = unpainted_edit(browser, url, "tiny-flux2-klein", uploads, "put the second in the first",
                                          "several-images", screenshot)  # the screenshot kept: both images
    assert np.array_equal(shown, np.asarray(answer))
    assert not np.array_equal(np.asarray(answer), np.asarray(alone))
    assert console_errors(browser) == []


def test_a_lora_and_a_controlnet_chosen_on_the_page_shape_the_image(browser, server, screenshot, tmp_path):
    scene = sample_scene(random.Random(4))
    Image.fromarray(layout_map(scene, 128, 128)).save(tmp_path / "layout.png")
    open_page(browser, server)
    wait(browser, lambda: connected(browser))
    css(browser, "#generate-form .adapter[data-name=palette] .use").click()
    css(browser, "#generate-form .adapter[data-name=layout] .use").click()
    css(browser, "#generate-form .adapter[data-name=layout] .image").send_keys(str(tmp_path / "layout.png"))
    form = css(browser, "#generate-form")
    fill(form, prompt=unplaced_caption(scene), seed=11, partial_images=0)
    form.find_element("css selector", "button[type=submit]").click()
    wait(browser, lambda: [f["state"] for f in figures(browser)] == ["done"])
    screenshot("adapters")
    shown = pixels(figures(browser)[0]["src"]).astype(float)

    def answer(**adapters) -> np.ndarray:
        body = {"prompt": unplaced_caption(scene), "size": "128x128", "seed": 11, **adapters}
        data = httpx.post(f"{server}/v1/images/generations", json=body, timeout=120).json()["data"][0]["b64_json"]
        return np.asarray(open_image(data).convert("RGB"), dtype=float)

    layout = base64.b64encode((tmp_path / "layout.png").read_bytes()).decode()
    with_both = answer(loras=[{"name": "palette", "scale": 1}], controlnets=[{"name": "layout", "image": layout}])
    assert np.abs(shown - with_both).mean() < 1.0  # what the page sent: both adapters, scale 1
    # and they change the picture (4.1 of 255 on the UNet of 23,200 steps; they were trained on its 5,200-step self)
    assert np.abs(shown - answer()).mean() > 3.0
    assert console_errors(browser) == []


def test_bad_input_shows_the_apis_own_error_message(browser, server, screenshot):
    open_page(browser, server)
    wait(browser, lambda: connected(browser))
    form = css(browser, "#generate-form")
    fill(form, prompt=CAPTION, width=100, height=128)
    form.find_element("css selector", "button[type=submit]").click()
    line = css(browser, "#tab-generate > .error")
    wait(browser, line.is_displayed)
    body = {"prompt": CAPTION, "model": "shapes-unet", "size": "100x128", "n": 1, "stream": True, "partial_images": 2}
    error = httpx.post(f"{server}/v1/images/generations", json=body).json()["error"]
    assert line.text == error["message"] and error["param"] == "size"
    screenshot("error")

    open_page(browser, server, "edit")  # an edit without an image: the API says what is missing
    wait(browser, lambda: connected(browser))
    form = css(browser, "#edit-form")
    fill(form, prompt=CAPTION)
    form.find_element("css selector", "button[type=submit]").click()
    line = css(browser, "#tab-edit > .error")
    wait(browser, line.is_displayed)
    assert "image" in line.text and form.find_element("css selector", "button[type=submit]").is_enabled()


def status_view(browser) -> dict:
    """The status tab as text, read at once (it is redrawn every second)."""
    return browser.execute_script("""
        const tab = document.querySelector('#tab-status');
        const texts = (selector) => [...tab.querySelectorAll(selector)].map((node) => node.textContent.trim());
        const rows = (name) => [...tab.querySelectorAll(`table.${name} tbody tr`)]
            .map((tr) => [...tr.cells].map((td) => td.textContent.trim()));
        return {tiles: Object.fromEntries(texts('.tiles dt').map((term, i) => [term, texts('.tiles dd')[i]])),
                requests: rows('requests'), errors: Object.fromEntries(rows('errors').filter((r) => r.length === 2)),
                titles: texts('.engine h3')};""")


def test_the_status_tab_follows_a_running_request_and_counts_the_cancel(browser, server, screenshot):
    cancelled = httpx.get(f"{server}/v1/status").json()["errors"].get("cancelled", 0)
    open_page(browser, server)
    wait(browser, lambda: connected(browser))
    form = css(browser, "#generate-form")
    fill(form, prompt=CAPTION, width=160, height=96, num_inference_steps=200, seed=1, n=1, partial_images=0)
    from selenium.webdriver.support.select import Select

    Select(form.find_element("name", "service_tier")).select_by_value("priority")
    form.find_element("css selector", "button[type=submit]").click()
    wait(browser, lambda: figures(browser)[0]["state"] == "running")
    css(browser, "[data-tab=status]").click()

    def running() -> list[str] | None:
        rows = [row for row in status_view(browser)["requests"] if len(row) == 6 and row[4] == "running"]
        return rows[0] if len(rows) == 1 and int(rows[0][5].split(" / ")[0]) > 3 else None

    wait(browser, running)
    view = status_view(browser)
    _, size, tier, tenant, status, steps = running()
    assert (size, tier, tenant, status, steps.split(" / ")[1]) == ("160x96", "priority", "–", "running", "200")
    latency = next(value for term, value in view["tiles"].items() if term.startswith("step latency"))
    assert view["tiles"]["running"] == "1" and latency.endswith(" ms")
    screenshot("status")

    css(browser, "[data-tab=generate]").click()
    css(browser, "#generate-form .cancel").click()
    wait(browser, lambda: css(browser, "#tab-generate .request").get_attribute("data-state") == "cancelled")
    css(browser, "[data-tab=status]").click()
    wait(browser, lambda: status_view(browser)["errors"].get("cancelled") == str(cancelled + 1) and not running())


def test_the_status_tab_shows_each_replica(browser, replicas_server, screenshot):
    body = {"prompt": CAPTION, "size": "128x96", "num_inference_steps": 200}
    with ThreadPoolExecutor(2) as pool:
        answers = [pool.submit(httpx.post, f"{replicas_server}/v1/images/generations", json={**body, "seed": seed},
                               timeout=120) for seed in (1, 2)]
        open_page(browser, replicas_server, "status")

        def running() -> list[list[str]]:
            return [row for row in status_view(browser)["requests"] if len(row) == 6 and row[4] == "running"]

        wait(browser, lambda: len(running()) == 2)
        assert status_view(browser)["titles"] == ["replica 0", "replica 1"]
        assert [row[1] for row in running()] == ["128x96", "128x96"]
        screenshot("status-replicas")
        assert [answer.result().status_code for answer in answers] == [200, 200]


def test_with_an_api_key_the_page_asks_for_it_and_sends_it(browser, key_server, screenshot):
    open_page(browser, key_server, "status")
    key_form = css(browser, "#key-form")
    wait(browser, key_form.is_displayed)
    assert console_errors(browser) == []  # nothing, not even the status tab, asked the API without the key
    screenshot("api-key")
    fill(key_form, key="not-the-key")
    key_form.find_element("css selector", "button[type=submit]").click()
    wait(browser, lambda: key_form.find_element("css selector", ".error").text.startswith("Incorrect API key"))
    fill(key_form, key=API_KEY)
    key_form.find_element("css selector", "button[type=submit]").click()
    wait(browser, lambda: connected(browser))
    assert not key_form.is_displayed()
    wait(browser, lambda: status_view(browser)["tiles"].get("status") == "ok")  # the status tab polls now
    css(browser, "[data-tab=generate]").click()
    form = css(browser, "#generate-form")
    fill(form, prompt=CAPTION, num_inference_steps=4, partial_images=0)
    form.find_element("css selector", "button[type=submit]").click()
    wait(browser, lambda: [f["state"] for f in figures(browser)] == ["done"])
    assert (figures(browser)[0]["width"], figures(browser)[0]["height"]) == (128, 128)


def test_a_video_model_opens_on_the_video_tab_and_plays_the_clip_it_made(browser, screenshot):
    """tiny-wan: only the Video tab (and Status) is offered; a clip follows its progress and
    previews, then plays as an MP4 of the asked size and frames, the API's own for that seed."""
    from tests.api.helpers import running_server

    with running_server("--model", "tiny-wan") as url:
        open_page(browser, url, "")
        wait(browser, lambda: css(browser, "#server-line").text == "serving tiny-wan")
        assert css(browser, "#tab-video").is_displayed()
        assert not any(css(browser, f"[data-tab={tab}]").is_displayed() for tab in ("generate", "edit"))
        form = css(browser, "#video-form")
        assert not form.find_element("name", "input_reference").is_displayed()  # text to video: no first frame
        fill(form, prompt="a red fox running", width=96, height=64, num_frames=9, num_inference_steps=30, seed=4,
             partial_images=2, fps=8)
        form.find_element("css selector", "button[type=submit]").click()
        wait(browser, lambda: browser.execute_script(
            "const f = document.querySelector('#tab-video figure'); return f && f.dataset.previews > 0 "
            "&& f.dataset.state === 'running'"))
        screenshot("video-making")
        wait(browser, lambda: browser.execute_script(
            "const v = document.querySelector('#tab-video video'); return v && v.readyState >= 1"), timeout=120)
        screenshot("video-made")
        shown = browser.execute_script(
            "const v = document.querySelector('#tab-video video'); "
            "return {width: v.videoWidth, height: v.videoHeight, duration: v.duration, "
            "seed: v.closest('figure').dataset.seed}")
        assert (shown["width"], shown["height"], shown["seed"]) == (96, 64, "4")
        assert abs(shown["duration"] - 9 / 8) < 0.2  # 9 frames at 8 fps
    assert console_errors(browser) == []


def test_an_image_to_video_model_makes_the_clip_from_the_chosen_first_frame(browser, screenshot, tmp_path):
    """tiny-wan-i2v: the Video tab offers a first frame and sends it (the server refuses a clip of
    this model without one); the clip plays at the asked size."""
    from tests.api.helpers import running_server

    rng = np.random.default_rng(8)
    Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).resize((64, 64)).save(tmp_path / "first.png")
    with running_server("--model", "tiny-wan-i2v") as url:
        open_page(browser, url, "")
        wait(browser, lambda: css(browser, "#server-line").text == "serving tiny-wan-i2v")
        form = css(browser, "#video-form")
        fill(form, prompt="a fox turns", width=64, height=64, num_frames=5, num_inference_steps=2, seed=3)
        form.find_element("name", "input_reference").send_keys(str(tmp_path / "first.png"))
        form.find_element("css selector", "button[type=submit]").click()
        wait(browser, lambda: browser.execute_script(
            "const v = document.querySelector('#tab-video video'); return v && v.readyState >= 1"), timeout=120)
        screenshot("video-from-image")
        assert browser.execute_script("return document.querySelector('#tab-video video').videoWidth") == 64
    assert console_errors(browser) == []
