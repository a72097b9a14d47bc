"""LoRAs through the server: requests name adapters of --lora-dir in JSON and multipart, the
listing and registration routes answer, every bad adapter input is a 400 that names `loras`,
and the server keeps serving; the adapters' traffic is in /metrics."""

import json

import httpx
import numpy as np
import pytest
from safetensors.torch import save_file

from gouache.api.server import create_app
from gouache.config import EngineConfig, LoraConfig, ModelConfig, SchedulerConfig, ServerConfig
from gouache.engine.build import build_engine
from gouache.engine.client import AsyncEngine
from gouache.lora.files import random_lora
from gouache.runner.describe import model_info
from gouache.sched.policies import make_policy
from tests.engine.test_async_engine import png, run
from tests.engine.test_templates import samples


@pytest.fixture
def lora_dir(pipes, tmp_path):
    pipe = pipes("tiny-sd")
    save_file(random_lora(pipe, seed=1), str(tmp_path / "ink.safetensors"))
    save_file(random_lora(pipe, seed=2), str(tmp_path / "paper.safetensors"))
    save_file(random_lora(pipes("tiny-sd3")), str(tmp_path / "other-model.safetensors"))  # another model's layers
    (tmp_path / "broken.safetensors").write_bytes(b"not a safetensors file")
    weights = random_lora(pipe, seed=3)
    first = next(k for k in weights if k.endswith("lora_A.weight"))
    weights[first] = weights[first][:, :-1].contiguous()  # a down matrix one input short
    save_file(weights, str(tmp_path / "short.safetensors"))
    return tmp_path


def test_requests_with_adapters_through_the_api(pipes, lora_dir):
    pipe = pipes("tiny-sd")
    engine = AsyncEngine(pipe, model_info(pipe, "tiny-sd"), EngineConfig(lora=LoraConfig(str(lora_dir))),
                         make_policy(SchedulerConfig(policy="orca")))
    body = {"prompt": "a fox", "size": "64x64", "num_inference_steps": 3, "seed": 5}
    bad = {"unknown": [{"name": "nope"}], "escape": [{"name": "../ink"}], "suffix": [{"name": "ink.safetensors"}],
           "broken": [{"name": "broken"}], "shapes": [{"name": "short"}], "model": [{"name": "other-model"}],
           "twice": [{"name": "ink"}, {"name": "ink", "scale": 0.5}], "scale": [{"name": "ink", "scale": 1e9}],
           "field": [{"name": "ink", "weight": 1}], "type": "ink"}

    async def scenario():
        await engine.start()
        transport = httpx.ASGITransport(create_app(engine, ServerConfig()))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as http:
            listed = await http.get("/v1/loras")
            registered = await http.post("/v1/loras", json={"name": "ink"})
            refused_registration = await http.post("/v1/loras", json={"name": "short"})
            plain = await http.post("/v1/images/generations", json=body)
            mixed = [await http.post("/v1/images/generations", json={**body, "loras": loras})
                     for loras in ([{"name": "ink"}], [{"name": "ink", "scale": 0.5}, {"name": "paper"}])]
            refused = {why: await http.post("/v1/images/generations", json={**body, "loras": loras})
                       for why, loras in bad.items()}
            image = np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)
            edit = await http.post("/v1/images/edits", files={"image": ("i.png", png(image), "image/png")},
                                   data={"prompt": "a fox", "num_inference_steps": "3",
                                         "loras": json.dumps([{"name": "paper", "scale": 0.8}])})
            not_json = await http.post("/v1/images/edits", files={"image": ("i.png", png(image), "image/png")},
                                       data={"prompt": "a fox", "loras": "paper"})
            after = await http.post("/v1/images/generations", json=body)
            metrics = await http.get("/metrics")
        await engine.aclose()
        return listed, registered, refused_registration, plain, mixed, refused, edit, not_json, after, metrics

    listed, registered, refused_registration, plain, mixed, refused, edit, not_json, after, metrics = run(scenario())
    names = [entry["id"] for entry in listed.json()["data"]]
    assert names == ["broken", "ink", "other-model", "paper", "short"]
    assert registered.status_code == 200 and registered.json()["loaded"] and registered.json()["layers"] == 32
    assert refused_registration.status_code == 400 and "do not fit" in refused_registration.json()["error"]["message"]
    images = [r.json()["data"][0]["b64_json"] for r in (plain, *mixed)]
    assert len(set(images)) == 3  # each adapter set changes the image
    for why, response in refused.items():
        assert response.status_code == 400, (why, response.text)
        assert response.json()["error"]["param"].startswith("loras"), why
    assert "unknown LoRA 'nope'" in refused["unknown"].json()["error"]["message"]
    assert ("gouache applies LoRAs to the unet and text_encoder of this model"
            in refused["model"].json()["error"]["message"]
            or "no module" in refused["model"].json()["error"]["message"])
    assert edit.status_code == 200, edit.text
    assert not_json.status_code == 400 and not_json.json()["error"]["param"] == "loras"
    assert after.status_code == 200 and after.json()["data"][0]["b64_json"] == images[0]  # unmerged again
    modes = {s.labels["mode"]: s.value for m in engine.metrics.registry.collect() if m.name == "gouache_lora_steps"
             for s in m.samples if s.name.endswith("_total")}
    assert modes["merged"] >= 6
    loads = samples(engine, "gouache_lora_loads")
    assert loads["miss"] == 2 and loads["hit"] >= 2  # ink read at registration, paper at its first request
    assert b"gouache_lora_host_bytes" in metrics.content


def test_lora_flags_without_a_directory_are_refused():
    from gouache.cli import build_parser
    from gouache.cli.serve import engine_configs

    for flag in ("--lora-bound", "--lora-mb"):
        args = build_parser().parse_args(["serve", flag, "3"])
        with pytest.raises(ValueError, match="without --lora-dir"):
            engine_configs(args)


def test_a_loading_bound_is_refused_where_every_step_runs_sequence_parallel(lora_dir):
    config = EngineConfig(executor="multiproc", devices=2, lora=LoraConfig(str(lora_dir), bound=3))
    with pytest.raises(ValueError, match="--lora-bound would be ignored: every step of --policy fixed-sp-2"):
        build_engine(ModelConfig("tiny-sd3"), config, SchedulerConfig(policy="fixed-sp-2"))


@pytest.mark.slow
def test_adapters_under_a_worker_process(lora_dir):
    """A multiproc worker reads the adapters itself; registration warms it."""
    config = EngineConfig(executor="multiproc", devices=1, lora=LoraConfig(str(lora_dir)))
    engine = build_engine(ModelConfig("tiny-sd"), config, SchedulerConfig(policy="orca"))
    from tests.engine.test_async_engine import images

    async def scenario():
        await engine.start()
        try:
            registered = await engine.register_lora("paper")
            outs = [await (await engine.submit(images(name, loras=loras))).images()
                    for name, loras in (("plain", ()), ("paper", (("paper", 1.0),)), ("again", ()))]
        finally:
            await engine.aclose()
        return registered, outs

    registered, outs = run(scenario())
    assert registered["loaded"]
    plain, paper, again = (out[0].image for out in outs)
    assert plain != paper and plain == again


def test_an_adapter_registered_while_nothing_runs_shows_in_the_metrics(pipes, lora_dir):
    import asyncio
    import time

    pipe = pipes("tiny-sd")
    engine = AsyncEngine(pipe, model_info(pipe, "tiny-sd"), EngineConfig(lora=LoraConfig(str(lora_dir))),
                         make_policy(SchedulerConfig(policy="orca")))

    async def scenario():
        await engine.start()
        before = samples(engine, "gouache_lora_host_bytes").get(None, 0)
        await engine.register_lora("paper")
        deadline = time.monotonic() + 10
        while samples(engine, "gouache_lora_host_bytes").get(None, 0) == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # no step runs: the engine's idle settle reports it
        after = samples(engine, "gouache_lora_host_bytes").get(None, 0)
        await engine.aclose()
        return before, after

    before, after = run(scenario())
    assert before == 0 and after == engine.runner.lora_runtime.store.nbytes > 0
