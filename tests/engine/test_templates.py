"""Template reuse through the engine: an edit uploaded twice records, then replays its
template's activations; the store's traffic is in /metrics, the original's pixels outside the
mask come back, and a model or policy it cannot apply to refuses it before starting."""

import io

import numpy as np
import pytest
from PIL import Image

from gouache.config import EngineConfig, ModelConfig, SchedulerConfig, TemplateConfig
from gouache.engine.build import build_engine
from gouache.engine.client import AsyncEngine
from gouache.runner.describe import model_info
from gouache.sched.policies import make_policy
from tests.engine.test_async_engine import images, png, run


def samples(engine: AsyncEngine, name: str) -> dict[str, float]:
    return {s.labels.get("result") or s.labels.get("tier") or s.labels.get("mode"): s.value
            for m in engine.metrics.registry.collect() if m.name == name for s in m.samples
            if not s.name.endswith("_created")}


@pytest.mark.parametrize("model", ["tiny-flux", "tiny-flux-kontext"])  # Kontext: an edit with a reference
def test_the_second_edit_of_an_image_replays_its_template(pipes, tmp_path, model):
    pipe = pipes(model)
    config = EngineConfig(templates=TemplateConfig(directory=str(tmp_path)))
    engine = AsyncEngine(pipe, model_info(pipe, model), config, make_policy(SchedulerConfig(policy="orca")))
    assert engine.info.serves("template")
    original = np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    mask = np.full((64, 64, 4), 255, np.uint8)
    mask[16:40, 16:40, 3] = 0  # transparent = repaint

    async def scenario():
        await engine.start()
        outs = []
        for api_id in ("first", "second"):
            edit = images(api_id, image=png(original), mask=png(mask), template_cache=True)
            outs.append((await (await engine.submit(edit)).images())[0])
        await engine.aclose()
        return outs

    outs = run(scenario())
    keep = mask[..., 3] == 255
    for event in outs:
        out = np.asarray(Image.open(io.BytesIO(event.image)).convert("RGB"))
        assert np.array_equal(out[keep], original[keep]) and not np.array_equal(out[~keep], original[~keep])
    tokens = samples(engine, "gouache_template_tokens")
    assert tokens["replayed"] > 0 and tokens["computed"] > 0
    lookups = samples(engine, "gouache_template_store_lookups")
    assert lookups["host"] == 4 and lookups.get("miss", 0) == 0  # the second edit's 4 steps
    assert samples(engine, "gouache_template_store_bytes")["host"] > 0


def test_template_cache_is_refused_where_every_step_runs_sequence_parallel():
    config = EngineConfig(executor="multiproc", devices=2, templates=TemplateConfig(default=True))
    with pytest.raises(ValueError, match="--template-cache would be ignored: every step of --policy fixed-sp-2"):
        build_engine(ModelConfig("tiny-sd3"), config, SchedulerConfig(policy="fixed-sp-2"))


@pytest.mark.parametrize("model", ["tiny-flux", "tiny-flux-kontext"])
def test_a_registered_template_serves_edits_through_the_api(pipes, tmp_path, model):
    import httpx

    from gouache.api.server import create_app
    from gouache.config import ServerConfig

    pipe = pipes(model)
    config = EngineConfig(templates=TemplateConfig(directory=str(tmp_path)))
    engine = AsyncEngine(pipe, model_info(pipe, model), config, make_policy(SchedulerConfig(policy="orca")))
    original = np.random.default_rng(2).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    mask = np.full((64, 64, 4), 255, np.uint8)
    mask[0:24, 0:24, 3] = 0
    form = {"prompt": "a photo", "num_inference_steps": "3"}

    async def scenario():
        await engine.start()
        transport = httpx.ASGITransport(create_app(engine, ServerConfig()))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as http:
            registered = await http.post("/v1/templates", data={**form, "template_id": "model-photo"},
                                         files={"image": ("t.png", png(original), "image/png")})
            with_mask = await http.post("/v1/templates", data=form, files={
                "image": ("t.png", png(original), "image/png"), "mask": ("m.png", png(mask), "image/png")})
            ignored = [await http.post("/v1/templates", data={**form, field: value},
                                       files={"image": ("t.png", png(original), "image/png")})
                       for field, value in (("output_format", "jpeg"), ("block_cache", "0.1"))]
            both = await http.post("/v1/images/edits",
                                   data={**form, "template_id": "model-photo", "block_cache": "0.1"},
                                   files={"image": ("t.png", png(original), "image/png")})
            edit = await http.post("/v1/images/edits", data={**form, "template_id": "model-photo"}, files={
                "image": ("t.png", png(original), "image/png"), "mask": ("m.png", png(mask), "image/png")})
        await engine.aclose()
        return registered, with_mask, edit, ignored, both

    registered, with_mask, edit, ignored, both = run(scenario())
    assert registered.status_code == 200, registered.text
    assert registered.json() == {"id": "model-photo", "object": "template", "size": "64x64",
                                 "num_inference_steps": 3, "guidance_scale": engine.info.default_guidance}
    assert with_mask.status_code == 400 and with_mask.json()["error"]["param"] == "mask"
    assert [r.json()["error"]["param"] for r in ignored] == ["output_format", "block_cache"]
    assert both.status_code == 400 and both.json()["error"]["param"] == "block_cache"
    assert edit.status_code == 200, edit.text
    tokens = samples(engine, "gouache_template_tokens")
    assert tokens["replayed"] > 0
    # registration records with no token repainted: the edit computes exactly its own mask's tokens
    # (Kontext's reference, as many tokens again, replays whole)
    every = 16 * (2 if engine.info.instruction_edit else 1)
    assert tokens["computed"] / (tokens["computed"] + tokens["replayed"]) == pytest.approx((24 // 16 + 1) ** 2 / every)


@pytest.mark.slow
def test_templates_under_worker_processes_and_next_to_other_requests(pipes, tmp_path):
    """A multiproc worker holds its own store: a recorder and a replay there, batched with a
    block-cached generation and a plain one under patched (mixed sizes)."""
    config = EngineConfig(executor="multiproc", devices=1, templates=TemplateConfig(directory=str(tmp_path)))
    engine = build_engine(ModelConfig("tiny-sd3"), config, SchedulerConfig(policy="patched"))
    original = np.random.default_rng(3).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    mask = np.full((64, 64, 4), 255, np.uint8)
    mask[32:64, 0:32, 3] = 0

    async def scenario():
        await engine.start()
        try:
            record = images("record", image=png(original), mask=png(mask), template_cache=True, template_id="t")
            await (await engine.submit(record)).images()
            handles = [await engine.submit(images("replay", image=png(original), mask=png(mask), template_cache=True,
                                                  template_id="t")),
                       await engine.submit(images("cached", size=96, block_cache=0.5)),
                       await engine.submit(images("plain", size=96))]
            return [await h.images() for h in handles]
        finally:
            await engine.aclose()

    results = run(scenario())
    assert all(len(events) == 1 for events in results)
    assert samples(engine, "gouache_template_tokens")["replayed"] > 0
    assert (tmp_path / "rank-0").is_dir()  # the worker's own store directory


def test_a_template_cost_model_of_another_kind_or_under_sequence_parallel_steps_is_refused(tmp_path):
    from gouache.sched.costmodel import BatchCostModel, MaskCostModel, save
    from gouache.sched.predictors import LinearPredictor

    batch, mask = tmp_path / "batch.json", tmp_path / "mask.json"
    save(BatchCostModel([(64, 64)], patch_px=32), batch)
    line = LinearPredictor.from_json({"kind": "linear", "coef": [1e-9], "intercept": 0.0})
    save(MaskCostModel(64, 2, compute=line, load=line), mask)  # fitted: an unfitted one is refused first
    with pytest.raises(ValueError, match="--template-cost-model takes the mask-aware one"):
        build_engine(ModelConfig("tiny-sd3"), EngineConfig(templates=TemplateConfig(cost_model=str(batch))),
                     SchedulerConfig())
    config = EngineConfig(executor="multiproc", devices=2, templates=TemplateConfig(cost_model=str(mask)))
    with pytest.raises(ValueError, match="--template-cost-model would be ignored"):
        build_engine(ModelConfig("tiny-sd3"), config, SchedulerConfig(policy="fixed-sp-2"))


def edit_engine(pipes, directory, model: str = "tiny-flux") -> AsyncEngine:
    pipe = pipes(model)
    config = EngineConfig(templates=TemplateConfig(directory=str(directory)))
    return AsyncEngine(pipe, model_info(pipe, model), config, make_policy(SchedulerConfig(policy="orca")))


def pixels(event) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(event.image)).convert("RGB")).astype(int)


def test_a_template_id_sent_with_another_image_records_that_image(pipes, tmp_path):
    engine = edit_engine(pipes, tmp_path, "shapes-unet")
    first = np.full((64, 64, 3), 255, np.uint8)  # a white picture, then a noisy one under the same id
    second = np.random.default_rng(6).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    mask = np.full((64, 64, 4), 255, np.uint8)
    mask[16:48, 16:48, 3] = 0

    async def scenario():
        await engine.start()
        try:
            for api_id, image, kwargs in (("record", first, {"template_id": "photo"}),
                                          ("other", second, {"template_id": "photo"}),
                                          ("exact", second, {"template_cache": False})):
                edit = images(api_id, image=png(image), mask=png(mask),
                              template_cache=kwargs.get("template_cache", True),
                              template_id=kwargs.get("template_id"))
                yield (await (await engine.submit(edit)).images())[0]
        finally:
            await engine.aclose()

    async def collect():
        return [event async for event in scenario()]

    _, other, exact = run(collect())
    # it replayed the white picture's activations before: up to 81 levels off the exact edit
    assert np.abs(pixels(other) - pixels(exact)).max() <= 1
    assert samples(engine, "gouache_template_tokens").get("replayed", 0) == 0  # recorded, never replayed


def test_a_restarted_server_replays_the_templates_its_directory_holds(pipes, tmp_path):
    original = np.random.default_rng(7).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    mask = np.full((64, 64, 4), 255, np.uint8)
    mask[0:32, 0:32, 3] = 0

    def serve_one_edit(api_id: str) -> AsyncEngine:
        engine = edit_engine(pipes, tmp_path)

        async def scenario():
            await engine.start()
            try:
                edit = images(api_id, image=png(original), mask=png(mask), template_cache=True, template_id="t")
                await (await engine.submit(edit)).images()
            finally:
                await engine.aclose()

        run(scenario())
        return engine

    serve_one_edit("record")
    written = sorted(tmp_path.glob("*.safetensors"))
    assert len(written) == 4  # a file per step, written from host memory when the server closed
    again = serve_one_edit("replay")
    assert samples(again, "gouache_template_tokens")["replayed"] > 0
    assert samples(again, "gouache_template_store_lookups")["disk"] == 4
