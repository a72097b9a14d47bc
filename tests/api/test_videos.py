"""The videos API (`gouache.api.videos`) on a real `gouache serve --model tiny-wan`, driven by the
official openai client: create, poll, download (a playable MP4 of the asked frames and size, its
thumbnail), list, delete (a running one cancelled); bad input gets a 400 naming its field; and the
store's expiry and byte budget."""

from __future__ import annotations

import base64
import io
import json
import time

import av
import httpx
import openai
import pytest
from PIL import Image

from gouache.api.video_store import Video, VideoStore
from tests.api.helpers import running_server

SIZE_STEP = 16  # tiny-wan: 8 pixels a latent pixel, 2x2 a token
# the openai client warns that OpenAI's own service of this API (Sora) is to shut down; its
# `videos` resource is what this server serves
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")


@pytest.fixture(scope="module")
def server_url():
    with running_server("--model", "tiny-wan") as url:
        yield url


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def wait(videos, video_id: str, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while (video := videos.retrieve(video_id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, video
        time.sleep(0.2)
    return video


@pytest.mark.slow
def test_the_openai_client_creates_polls_downloads_lists_and_deletes_a_video(server_url):
    videos = client(server_url).videos
    made = videos.create(prompt="a red fox running", size="80x64",
                         extra_body={"num_frames": 9, "fps": 8, "num_inference_steps": 3, "seed": 5})
    assert (made.status, made.size, made.seconds, made.model) == ("queued", "80x64", "1", "tiny-wan")
    done = wait(videos, made.id)
    assert (done.status, done.progress, done.error) == ("completed", 100, None)
    assert done.expires_at > done.completed_at >= done.created_at
    mp4 = videos.download_content(made.id).content
    with av.open(io.BytesIO(mp4)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
        assert float(container.streams.video[0].average_rate) == 8
    assert len(frames) == 9 and frames[0].shape == (64, 80, 3)
    thumbnail = Image.open(io.BytesIO(videos.download_content(made.id, variant="thumbnail").content))
    assert (thumbnail.format, thumbnail.size) == ("WEBP", (80, 64))

    second = videos.create(prompt="a blue sky", seconds="1", size="64x64", extra_body={"num_inference_steps": 2})
    assert second.model_extra["num_frames"] == 17  # 1 s at Wan's 16 fps, + 1
    listed = videos.list(order="asc", limit=1)
    assert [v.id for v in listed.data] == [made.id] and listed.has_more
    assert [v.id for v in videos.list(order="asc", after=made.id).data] == [second.id]
    wait(videos, second.id)
    deleted = videos.delete(made.id)
    assert (deleted.id, deleted.deleted) == (made.id, True)
    with pytest.raises(openai.NotFoundError):
        videos.retrieve(made.id)


@pytest.mark.slow
def test_deleting_a_running_video_cancels_it_and_the_server_goes_on(server_url):
    videos = client(server_url).videos
    long = videos.create(prompt="a long clip", size="64x64", extra_body={"num_frames": 33, "num_inference_steps": 200})
    deadline = time.monotonic() + 60
    while videos.retrieve(long.id).status != "in_progress":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    videos.delete(long.id)
    deadline = time.monotonic() + 10  # its slot is freed within a step (of a fraction of a second)
    while httpx.get(f"{server_url}/health").json()["running"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    short = videos.create(prompt="a short clip", size="64x64", extra_body={"num_frames": 5, "num_inference_steps": 2})
    assert wait(videos, short.id).status == "completed"


@pytest.mark.slow
@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"num_frames": "0"}, "num_frames", "greater than or equal to 1"),
    ({"num_frames": "6"}, "num_frames", "1 + a multiple of 4 frames"),
    ({"num_frames": "1000"}, "num_frames", "1 to 161 frames"),
    ({"seconds": "0"}, "seconds", "greater than 0"),
    ({"seconds": "3000"}, "seconds", "1 to 161 frames"),
    ({"seconds": "4", "num_frames": "9"}, "num_frames", "send one of them"),
    ({"size": "72x64"}, "size", f"multiples of {SIZE_STEP}"),
    ({"fps": "0"}, "fps", "greater than or equal to 1"),
    ({"partial_images": "4"}, "partial_images", "less than or equal to 3"),
    ({"loras": '[{"name": "ink"}]'}, "loras", "unknown LoRA 'ink': this server has no --lora-dir"),
    ({"block_cache": "-1"}, "block_cache", "greater than or equal to 0"),
    ({"colour": "red"}, "colour", "Unknown parameter"),
    ({"controlnets": "[]"}, "controlnets", "Unknown parameter"),  # the table: clip + controlnet refused
    ({"template_id": "t"}, "template_id", "Unknown parameter"),  # clip + template
])
def test_bad_input_gets_a_400_naming_the_field(server_url, fields, param, message):
    form = {name: (None, value) for name, value in {"prompt": "a fox", **fields}.items()}  # multipart, as openai's
    response = httpx.post(f"{server_url}/v1/videos", files=form, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error


@pytest.mark.slow
def test_an_image_reference_a_video_route_on_an_image_model_and_images_on_a_video_model_are_refused(server_url):
    png = io.BytesIO()
    Image.new("RGB", (32, 32)).save(png, "PNG")
    response = httpx.post(f"{server_url}/v1/videos", files={"prompt": (None, "a fox"),
                                                            "input_reference": ("a.png", png.getvalue())})
    assert response.status_code == 400 and response.json()["error"]["param"] == "input_reference"
    response = httpx.post(f"{server_url}/v1/images/generations", json={"prompt": "a fox"})
    assert response.status_code == 400 and "/v1/videos" in response.json()["error"]["message"]
    for path in ("/v1/videos/video_missing", "/v1/videos/video_missing/content"):
        assert httpx.get(f"{server_url}{path}").status_code == 404


@pytest.mark.slow
def test_a_json_body_takes_openais_seconds_as_text_and_refuses_what_a_form_would(server_url):
    body = {"prompt": "a fox", "seconds": "1", "size": "64x64", "num_inference_steps": 1}
    made = httpx.post(f"{server_url}/v1/videos", json=body, timeout=60)
    assert made.status_code == 200, made.text
    assert (made.json()["num_frames"], made.json()["seconds"]) == (17, "1")
    for bad, param in (({**body, "seconds": "soon"}, "seconds"), ({**body, "num_frames": "9"}, "num_frames"),
                       ({**body, "input_reference": {"image_url": "x"}}, "input_reference")):
        response = httpx.post(f"{server_url}/v1/videos", json=bad, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    assert httpx.post(f"{server_url}/v1/videos", content=b"[1]", headers={"content-type": "application/json"},
                      timeout=60).status_code == 400


def events(url: str, video_id: str) -> list[tuple[str, dict]]:
    """The (event, data) of GET /v1/videos/{id}/events, until the server ends the stream."""
    out, name = [], None
    with httpx.stream("GET", f"{url}/v1/videos/{video_id}/events", timeout=120) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                out.append((name, json.loads(line.removeprefix("data: "))))
    return out


@pytest.mark.slow
def test_a_videos_event_stream_tells_its_progress_and_previews_then_ends_completed(server_url):
    made = client(server_url).videos.create(prompt="a fox", size="64x64", extra_body={
        "num_frames": 5, "num_inference_steps": 6, "partial_images": 2})
    live = events(server_url, made.id)
    names = [name for name, _ in live]
    assert names[-1] == "video.completed" and names.count("video.partial_image") == 2, names
    progress = [data["progress"] for name, data in live if name == "video.in_progress"]
    assert progress and progress == sorted(progress) and live[-1][1]["progress"] == 100
    for name, data in live:
        if name == "video.partial_image":
            assert Image.open(io.BytesIO(base64.b64decode(data["b64_json"]))).size == (64, 64)
    late = events(server_url, made.id)  # after it ended: what it missed, then the end
    assert [name for name, _ in late] == ["video.partial_image", "video.partial_image", "video.completed"]
    assert httpx.get(f"{server_url}/v1/videos/video_missing/events").status_code == 404


def metric(url: str, name: str) -> float:
    return next(float(line.split()[-1]) for line in httpx.get(f"{url}/metrics").text.splitlines()
                if line.startswith(f"{name} "))


@pytest.mark.slow
def test_the_model_card_status_and_metrics_count_clips_and_their_frames(server_url):
    [card] = httpx.get(f"{server_url}/v1/models").json()["data"]
    kinds = card["gouache"]["kinds"]
    assert kinds["video"] == {"frame_step": 4, "max_frames": 161, "fps": 16, "from_image": False}
    assert not (kinds["generation"] or kinds["masked_edit"] or kinds["instruction_edit"])
    before = httpx.get(f"{server_url}/v1/status").json()
    videos, frames = metric(server_url, "gouache_videos_total"), metric(server_url, "gouache_video_frames_total")
    made = client(server_url).videos.create(prompt="a fox", size="64x64", extra_body={"num_frames": 13,
                                                                                        "num_inference_steps": 2})
    assert wait(client(server_url).videos, made.id).status == "completed"
    after = httpx.get(f"{server_url}/v1/status").json()
    assert after["finished_videos"] - before["finished_videos"] == 1
    assert after["finished_frames"] - before["finished_frames"] == 13
    assert metric(server_url, "gouache_videos_total") - videos == 1
    assert metric(server_url, "gouache_video_frames_total") - frames == 13
    assert metric(server_url, "gouache_images_total") == 0


def png(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.linear_gradient("L").resize((width, height)).convert("RGB").save(out, "PNG")
    return out.getvalue()


@pytest.mark.slow
def test_an_image_to_video_model_makes_a_clip_from_the_openai_clients_input_reference():
    with running_server("--model", "tiny-wan-i2v") as url:
        [card] = httpx.get(f"{url}/v1/models").json()["data"]
        assert card["gouache"]["kinds"]["video"]["from_image"] is True
        videos = client(url).videos
        made = videos.create(prompt="a fox turns", size="80x64", input_reference=("first.png", png(120, 96)),
                             extra_body={"num_frames": 5, "num_inference_steps": 2})
        assert wait(videos, made.id).status == "completed"
        with av.open(io.BytesIO(videos.download_content(made.id).content)) as container:
            frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
        assert len(frames) == 5 and frames[0].shape == (64, 80, 3)
        body = {"prompt": "a fox", "size": "64x64", "num_frames": 1, "num_inference_steps": 1}
        data_url = "data:image/png;base64," + base64.b64encode(png(64, 64)).decode()
        made = httpx.post(f"{url}/v1/videos", json={**body, "input_reference": {"image_url": data_url}}, timeout=60)
        assert made.status_code == 200 and wait(videos, made.json()["id"]).status == "completed", made.text
        for reference, message in ((None, "Missing required parameter"), ({"image_url": "https://a/b.png"},
                                   "fetches no URLs"), ({"file_id": "file-x"}, "no file 'file-x'"),
                                   ({"image_url": "data:image/png;base64,bm90IGFuIGltYWdl"}, "not a readable")):
            bad = body if reference is None else {**body, "input_reference": reference}
            response = httpx.post(f"{url}/v1/videos", json=bad, timeout=60)
            error = response.json()["error"]
            assert response.status_code == 400 and error["param"] == "input_reference", response.text
            assert message in error["message"], error
        form = {"prompt": (None, "a fox"), "input_reference[file_id]": (None, "file-y")}  # the client's object
        response = httpx.post(f"{url}/v1/videos", files=form, timeout=60)
        assert response.status_code == 400 and "no file 'file-y'" in response.json()["error"]["message"]


def video(video_id: str, nbytes: int = 0, tenant: str = "") -> Video:
    return Video(video_id, "m", "p", "32x32", 5, 16, 0, tenant, created_at=0, mp4=b"x" * nbytes)


def test_finished_videos_expire_after_the_ttl_and_the_oldest_go_beyond_the_byte_budget():
    now = [1000.0]
    store = VideoStore(ttl_s=60, max_bytes=100, clock=lambda: now[0])
    running, old, new = video("running"), video("old", 60), video("new", 60)
    for v in (running, old, new):
        store.add(v)
    store.finish(old)
    assert store.get("old") is old
    store.finish(new)  # 120 bytes kept: the oldest finished one goes
    assert (store.get("old"), store.get("new")) == (None, new)
    now[0] += 61
    assert store.get("new") is None and store.get("running") is running  # a running one never expires
    with pytest.raises(Exception, match="No video 'old' to list after"):
        store.page("", "old", 10, "asc")
    store.add(video("theirs", tenant="team-b"))
    assert [v.id for v in store.page("", None, 10, "asc")[0]] == ["running"]  # a key lists its own videos
    assert [v.id for v in store.page("team-b", None, 10, "asc")[0]] == ["theirs"]
