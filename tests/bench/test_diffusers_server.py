"""The baseline server of `gouache bench baselines`: static batching runs same-size requests that
arrive within the window as one pipeline call, other sizes in calls of their own; serial mode
runs one request per call."""

import threading

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from gouache.bench.diffusers_server import make_app


class Pipe:
    """Records each call's prompts and size; returns blank images."""

    def __init__(self):
        self.calls = []

    def __call__(self, prompt, height, width, num_inference_steps, guidance_scale, generator):
        self.calls.append((tuple(prompt), (width, height)))
        return type("Output", (), {"images": [Image.new("RGB", (width, height)) for _ in prompt]})()


class ClipPipe:
    """A video pipeline's call: records each call's prompts and clip shape; returns grey clips."""

    def __init__(self):
        self.calls = []

    def __call__(self, prompt, height, width, num_inference_steps, guidance_scale, generator, num_frames, output_type):
        self.calls.append((tuple(prompt), (width, height, num_frames)))
        return type("Output", (), {"frames": np.full((len(prompt), num_frames, height, width, 3), 0.5, np.float32)})()


def send_together(client, bodies, route="/v1/images/generations"):
    answers = [None] * len(bodies)

    def send(i):
        answers[i] = client.post(route, json=bodies[i])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return answers


@pytest.mark.parametrize(("mode", "calls"), [("static", [("a", "b", "c"), ("d",)]),
                                             ("serial", [("a",), ("b",), ("c",), ("d",)])])
def test_static_batching_groups_same_size_requests_within_the_window(mode, calls):
    pipe = Pipe()
    client = TestClient(make_app(pipe, mode, window_s=1.0, max_batch=8))
    bodies = [{"prompt": p, "size": "64x64" if p != "d" else "96x64", "seed": i} for i, p in enumerate("abcd")]
    answers = send_together(client, bodies)
    assert all(a.status_code == 200 and a.json()["data"][0]["b64_json"] for a in answers)
    got = sorted((tuple(sorted(prompts)), size) for prompts, size in pipe.calls)
    expected = sorted((prompts, (96, 64) if prompts == ("d",) else (64, 64)) for prompts in calls)
    assert got == expected


def test_clips_batch_by_size_and_frames_and_answer_once_encoded():
    pipe = ClipPipe()
    client = TestClient(make_app(pipe, "static", window_s=1.0, max_batch=8))
    bodies = [{"prompt": p, "size": "64x32", "num_frames": 9 if p != "c" else 17, "seed": i}
              for i, p in enumerate("abc")]
    answers = send_together(client, bodies, "/v1/videos")
    assert all(a.status_code == 200 and a.json()["status"] == "completed" and a.json()["bytes"] > 0 for a in answers)
    assert sorted((tuple(sorted(prompts)), shape) for prompts, shape in pipe.calls) == [
        (("a", "b"), (64, 32, 9)), (("c",), (64, 32, 17))]
