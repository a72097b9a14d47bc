"""ControlNets through the server: requests name ControlNets of --controlnet-dir with a
conditioning image each, in JSON and multipart; the listing and registration routes answer;
every bad ControlNet input is a 400 that names `controlnets` (or the field in its way), and the
server keeps serving; the ControlNets' traffic is in /metrics."""

import base64
import io
import json

import httpx
import numpy as np
import pytest
from PIL import Image

from gouache.api.server import create_app
from gouache.config import ControlNetConfig, EngineConfig, SchedulerConfig, ServerConfig
from gouache.controlnet.model import random_controlnet
from gouache.engine.build import build_engine
from gouache.engine.client import AsyncEngine
from gouache.runner.describe import model_info
from gouache.sched.policies import make_policy
from tests.engine.test_async_engine import png, run
from tests.engine.test_templates import samples


@pytest.fixture
def control_dir(pipes, tmp_path):
    pipe = pipes("tiny-sd")
    for seed, name in enumerate(("edges", "depth")):
        random_controlnet(pipe, seed, std=0.2).save_pretrained(str(tmp_path / name))
    random_controlnet(pipes("tiny-sdxl")).save_pretrained(str(tmp_path / "other-model"))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{")
    (tmp_path / "empty").mkdir()  # no config.json: not a ControlNet
    return tmp_path


def pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)), dtype=np.int16)


def b64(image: np.ndarray) -> str:
    return base64.b64encode(png(image)).decode()


def test_requests_with_controlnets_through_the_api(pipes, control_dir):
    pipe = pipes("tiny-sd")
    engine = AsyncEngine(pipe, model_info(pipe, "tiny-sd"),
                         EngineConfig(controlnet=ControlNetConfig(str(control_dir))),
                         make_policy(SchedulerConfig(policy="orca")))
    rng = np.random.default_rng(0)
    edges, depth, wide = (rng.integers(0, 255, shape, dtype=np.uint8) for shape in ((64, 64, 3),) * 2 + ((64, 96, 3),))
    body = {"prompt": "a fox", "size": "64x64", "num_inference_steps": 3, "seed": 5}
    net = {"name": "edges", "image": b64(edges)}
    bad = {"unknown": [{**net, "name": "nope"}], "escape": [{**net, "name": "../edges"}],
           "broken": [{**net, "name": "broken"}], "not a controlnet": [{**net, "name": "empty"}],
           "model": [{**net, "name": "other-model"}], "size": [{**net, "image": b64(wide)}],
           "not base64": [{**net, "image": "%%%"}],
           "not an image": [{**net, "image": base64.b64encode(b"hi").decode()}],
           "scale": [{**net, "scale": -1}], "field": [{**net, "weight": 1}], "no image": [{"name": "edges"}],
           "too many": [net] * 5, "type": "edges", "async without service": ([net], "async")}

    async def scenario():
        await engine.start()
        transport = httpx.ASGITransport(create_app(engine, ServerConfig()))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as http:
            listed = await http.get("/v1/controlnets")
            registered = await http.post("/v1/controlnets", json={"name": "edges"})
            refused_registration = await http.post("/v1/controlnets", json={"name": "other-model"})
            plain = await http.post("/v1/images/generations", json=body)
            controlled = [await http.post("/v1/images/generations", json={**body, "controlnets": nets})
                          for nets in ([net], [net, {"name": "depth", "image": "data:image/png;base64," + b64(depth),
                                                     "scale": 0.5}])]
            refused = {}
            for why, nets in bad.items():
                nets, mode = nets if isinstance(nets, tuple) else (nets, None)
                extra = {"controlnet_mode": mode} if mode else {}
                refused[why] = await http.post("/v1/images/generations", json={**body, "controlnets": nets, **extra})
            mode_alone = await http.post("/v1/images/generations", json={**body, "controlnet_mode": "sync"})
            cached = await http.post("/v1/images/generations", json={**body, "controlnets": [net], "block_cache": 0.1})
            edit = await http.post("/v1/images/edits", files={"image": ("i.png", png(depth), "image/png")},
                                   data={"prompt": "a fox", "num_inference_steps": "3",
                                         "controlnets": json.dumps([net])})
            template = await http.post("/v1/images/edits", files={"image": ("i.png", png(depth), "image/png")},
                                       data={"prompt": "a fox", "controlnets": json.dumps([net]),
                                             "template_cache": "true"})
            after = await http.post("/v1/images/generations", json=body)
            metrics = await http.get("/metrics")
        await engine.aclose()
        return (listed, registered, refused_registration, plain, controlled, refused, mode_alone, cached, edit,
                template, after, metrics)

    (listed, registered, refused_registration, plain, controlled, refused, mode_alone, cached, edit, template, after,
     metrics) = run(scenario())
    assert [entry["id"] for entry in listed.json()["data"]] == ["broken", "depth", "edges", "other-model"]
    assert registered.status_code == 200 and registered.json()["loaded"], registered.text
    assert refused_registration.status_code == 400 and "does not fit" in refused_registration.json()["error"]["message"]
    images = [r.json()["data"][0]["b64_json"] for r in (plain, *controlled)]
    assert len(set(images)) == 3  # each ControlNet set changes the image
    for why, response in refused.items():
        assert response.status_code == 400, (why, response.text)
        assert response.json()["error"]["param"].startswith("controlnets"), (why, response.json())
    assert "unknown ControlNet 'nope'" in refused["unknown"].json()["error"]["message"]
    assert "it must be the image's size, 64x64" in refused["size"].json()["error"]["message"]
    assert "not a readable PNG" in refused["not an image"].json()["error"]["message"]
    assert "need the ControlNet service" in refused["async without service"].json()["error"]["message"]
    assert mode_alone.status_code == 400 and mode_alone.json()["error"]["param"] == "controlnet_mode"
    assert cached.status_code == 400 and cached.json()["error"]["param"] == "block_cache"
    assert edit.status_code == 200, edit.text
    assert template.status_code == 400 and template.json()["error"]["param"] == "template_cache"
    assert after.status_code == 200 and after.json()["data"][0]["b64_json"] == images[0]
    runs = samples(engine, "gouache_controlnet_runs")
    assert runs["local"] == 3 + 2 * 3 + 3  # a run per ControlNet per step: two one-net requests, one with two
    loads = samples(engine, "gouache_controlnet_loads")
    assert loads["miss"] == 2 and loads["hit"] == 12 - 1  # edges read at registration, depth at its first run
    assert b"gouache_controlnet_wait_seconds" in metrics.content


def test_controlnet_flags_without_a_directory_are_refused():
    from gouache.cli import build_parser
    from gouache.cli.serve import engine_configs

    for flag, value in (("--controlnet-workers", "2"), ("--controlnet-mb", "64"), ("--controlnet-mode", "async")):
        args = build_parser().parse_args(["serve", flag, value])
        with pytest.raises(ValueError, match="without --controlnet-dir"):
            engine_configs(args)


def test_transformer_models_refuse_controlnets(pipes, control_dir):
    pipe = pipes("tiny-sd3")
    engine = AsyncEngine(pipe, model_info(pipe, "tiny-sd3"),
                         EngineConfig(controlnet=ControlNetConfig(str(control_dir))),
                         make_policy(SchedulerConfig(policy="orca")))

    async def scenario():
        await engine.start()
        transport = httpx.ASGITransport(create_app(engine, ServerConfig()))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as http:
            refused = await http.post("/v1/images/generations", json={
                "prompt": "a fox", "size": "64x64", "num_inference_steps": 2,
                "controlnets": [{"name": "edges", "image": b64(np.zeros((64, 64, 3), np.uint8))}]})
        await engine.aclose()
        return refused

    refused = run(scenario())
    assert refused.status_code == 400 and "UNet models" in refused.json()["error"]["message"]


def test_make_controlnet_writes_a_directory_the_server_takes(tmp_path, capsys):
    from gouache.cli import main
    from gouache.controlnet.runtime import ControlRuntime
    from gouache.models.zoo import load_pipeline

    assert main(["make-controlnet", "--model", "tiny-sdxl", "--out", str(tmp_path / "pose"), "--seed", "3"]) == 0
    assert "a random ControlNet of tiny-sdxl" in capsys.readouterr().out
    runtime = ControlRuntime(ControlNetConfig(str(tmp_path)), load_pipeline("tiny-sdxl"))
    assert runtime.load("pose")["loaded"]
    assert main(["make-controlnet", "--model", "tiny-flux", "--out", str(tmp_path / "x")]) == 2
    assert "UNet models" in capsys.readouterr().err


@pytest.mark.slow
def test_the_service_serves_sync_and_async_requests_and_stops_with_the_engine(pipes, control_dir):
    pipe = pipes("tiny-sd")
    config = EngineConfig(controlnet=ControlNetConfig(str(control_dir), workers=1, torch_threads=1))
    engine = AsyncEngine(pipe, model_info(pipe, "tiny-sd"), config, make_policy(SchedulerConfig(policy="orca")))
    service = engine.control_service
    rng = np.random.default_rng(1)
    net = {"name": "edges", "image": b64(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8))}
    body = {"prompt": "a fox", "size": "64x64", "num_inference_steps": 3, "seed": 5, "controlnets": [net]}

    async def scenario():
        await engine.start()
        transport = httpx.ASGITransport(create_app(engine, ServerConfig()))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as http:
            registered = await http.post("/v1/controlnets", json={"name": "depth"})
            answers = [await http.post("/v1/images/generations", json={**body, **extra})
                       for extra in ({}, {"controlnet_mode": "async"}, {"controlnet_mode": "sync"})]
            engine.runner.controls.overlap = False  # as under --compile: the residuals waited for first
            answers.append(await http.post("/v1/images/generations", json=body))
        await engine.aclose()
        return registered, answers

    registered, answers = run(scenario())
    assert registered.status_code == 200 and registered.json()["loaded"], registered.text
    assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
    sync, late, again, first = (a.json()["data"][0]["b64_json"] for a in answers)
    assert sync == again == first != late  # async residuals come a step late: another image
    assert samples(engine, "gouache_controlnet_runs") == {"sync": 3 + 1 + 3 + 3, "async": 1}
    assert not any(p.is_alive() for p in service._procs)
    with pytest.raises(ValueError, match="need the ControlNet service"):
        ControlNetConfig(str(control_dir), mode="async")


@pytest.mark.slow
def test_controlnets_under_worker_processes(control_dir):
    """multiproc workers run the UNet; their residuals come from the service this engine started."""
    from gouache.config import ModelConfig
    from tests.engine.test_async_engine import images

    cond = png(np.random.default_rng(2).integers(0, 255, (64, 64, 3), dtype=np.uint8))
    outs = {}
    for workers in (0, 1):
        config = EngineConfig(executor="multiproc", devices=1,
                              controlnet=ControlNetConfig(str(control_dir), workers=workers, torch_threads=1))
        engine = build_engine(ModelConfig("tiny-sd"), config, SchedulerConfig(policy="orca"))

        async def scenario():
            await engine.start()
            try:
                registered = await engine.register_controlnet("edges")
                return registered, [await (await engine.submit(images(name, controlnets=nets))).images()
                                    for name, nets in (("plain", ()), ("edges", (("edges", cond, 1.0),)))]
            finally:
                await engine.aclose()

        registered, outs[workers] = run(scenario())
        assert registered["loaded"]
    local, remote = ([pixels(out[0].image) for out in outs[k]] for k in (0, 1))
    assert np.abs(local[0] - local[1]).max() > 10  # the ControlNet changes the image
    # the service's residuals equal the worker's own (to rounding: threads differ)
    for ours, theirs in zip(local, remote):
        assert np.abs(ours - theirs).max() <= 1
