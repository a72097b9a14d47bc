"""Replicas live: two engine processes behind one front, under each router, serve a mixed load
of edits and generations with nothing lost; a replica that dies fails only its own requests."""

from __future__ import annotations

import asyncio
import io
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import httpx
import numpy as np
import pytest
from PIL import Image

from gouache.config import EngineConfig, ModelConfig, ReplicaConfig, SchedulerConfig, TemplateConfig
from gouache.errors import GouacheError
from gouache.metrics import Metrics, merged_exposition
from gouache.model_info import ModelInfo
from gouache.replicas.front import ReplicaSet
from gouache.replicas.routing import ROUTER_STEP_COST, computed_share, make_router, route_step_cost
from gouache.request import ImageRequest
from gouache.sched.costmodel import load_mask_model
from gouache.sched.router import ROUTERS, MeasuredEditCost, RouteRequest
from tests.api.helpers import running_server
from tests.api.test_real_server import client, rgba_png

MODEL = "tiny-sd"
MASK_COSTS = "benchmarks/results/costmodel_mask_shapes-dit.json"  # `gouache profile --edits` files
UNET_MASK_COSTS = "benchmarks/results/costmodel_mask_shapes-unet.json"


class Front:
    """A started ReplicaSet on its own event loop thread, for synchronous tests."""

    def __init__(self, replicas: ReplicaSet):
        self.set = replicas
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.run(replicas.start(), timeout=300)

    def run(self, coroutine, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def close(self) -> None:
        self.run(self.set.aclose())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def front():
    config = (ModelConfig(MODEL), EngineConfig(torch_threads=1), SchedulerConfig(max_batch_size=4),
              ReplicaConfig(replicas=2))
    front = Front(ReplicaSet(*config))
    yield front
    front.close()


def png(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, "PNG")
    return buffer.getvalue()


def mask_png(size: int, repaint: float) -> bytes:
    """RGBA, the top `repaint` fraction of the rows transparent (= repaint)."""
    mask = np.full((size, size, 4), 255, np.uint8)
    mask[: round(size * repaint), :, 3] = 0
    return png(mask)


def request(api_id: str, size: int, steps: int = 3, n: int = 1, repaint: float | None = None,
            template: bool | None = None) -> list[ImageRequest]:
    edit = {}
    if repaint is not None:
        rng = np.random.default_rng(0)
        edit = {"image": png(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)), "mask": mask_png(size, repaint),
                "template_cache": template}
    return [ImageRequest(f"{api_id}-{i}", "a red circle", size, size, steps, 4.0, seed=i, arrival_time=time.monotonic(),
                         **edit) for i in range(n)]


async def serve(replicas: ReplicaSet, load: list[list[ImageRequest]]) -> tuple[list, dict[str, int], dict[str, float]]:
    """Submit every request at once; the outcomes (images or the error), where each went and
    the repaint ratio the front saw."""
    placed, ratios = {}, {}

    async def one(requests):
        handle = await replicas.submit(requests)
        for replica in replicas.replicas:
            if handle.request_id in replica.requests:
                placed[handle.request_id] = replica.index
                ratios[handle.request_id] = replica.requests[handle.request_id].images[0].mask_ratio
        return await handle.images()

    outcomes = await asyncio.gather(*(one(r) for r in load), return_exceptions=True)
    return outcomes, placed, ratios


@pytest.mark.slow
@pytest.mark.parametrize("router", sorted(ROUTERS))
def test_two_replicas_serve_a_mixed_load_under_each_router(front, router):
    front.set.router = make_router(router)
    load = [request(f"{router}-g{i}", size, n=1 + i % 2) for i, size in enumerate((64, 96, 64))]
    # two edits replay a template (the first of them records it), one is exact and computes every token
    load += [request(f"{router}-e{i}", 64, repaint=r, template=t) for i, (r, t) in
             enumerate(((0.25, True), (0.5, True), (0.5, False)))]
    outcomes, placed, ratios = front.run(serve(front.set, load))
    for requests, images in zip(load, outcomes):
        assert not isinstance(images, BaseException), images
        assert [Image.open(io.BytesIO(e.image)).size for e in images] == [(r.width, r.height) for r in requests]
    assert set(placed.values()) == {0, 1}  # both replicas took part
    if ROUTERS[router].reads_masks:
        assert [ratios[f"{router}-e{i}"] for i in range(3)] == [0.25, 0.5, 1.0]
    stats = front.set.stats()
    assert (stats.waiting, stats.running, stats.status) == (0, 0, "ok")


def test_the_mask_aware_router_prices_steps_with_the_template_cost_model_or_the_stand_in():
    info = ModelInfo("m", "flux", 16, 1024, 28, 3.5, uses_cfg=False, inpaint_channels=False, token_pixels=16)
    assert route_step_cost(TemplateConfig(), info) == ROUTER_STEP_COST.batch_step_time
    measured = route_step_cost(TemplateConfig(cost_model=MASK_COSTS), info)
    model = load_mask_model(MASK_COSTS)
    batch = [RouteRequest("a", 256 * 256, 20, 0.2), RouteRequest("b", 128 * 128, 20)]
    assert measured(batch) == model.predict([(256, 0.2), (64, 1.0)])


def test_only_an_edit_that_replays_a_template_counts_its_mask():
    edit = request("e", 64, repaint=0.25)[0]
    assert computed_share(edit, TemplateConfig(), 4096) == 1.0  # exact: every token
    assert computed_share(edit, TemplateConfig(default=True), 4096) == 0.25
    assert computed_share(replace(edit, template_cache=True), TemplateConfig(), 4096) == 0.25
    assert computed_share(replace(edit, template_cache=False), TemplateConfig(default=True), 4096) == 1.0
    assert computed_share(request("g", 64)[0], TemplateConfig(default=True), 4096) == 1.0


@pytest.mark.slow
def test_serve_mask_aware_with_a_template_cost_model_routes_on_it():
    config = (ModelConfig(MODEL), EngineConfig(torch_threads=1, templates=TemplateConfig(cost_model=UNET_MASK_COSTS)),
              SchedulerConfig(max_batch_size=4), ReplicaConfig(replicas=2, router="mask-aware"))
    front = Front(ReplicaSet(*config))
    try:
        cost = front.set.router.step_cost
        assert isinstance(cost, MeasuredEditCost)
        assert (cost.token_pixels, cost.rows) == (8, 2)  # tiny-sd: a token is a latent pixel; CFG: two rows
        outcomes, _, ratios = front.run(serve(front.set, [request("t", 64, repaint=0.25, template=True)]))
        assert not isinstance(outcomes[0], BaseException), outcomes[0]
        assert ratios == {"t": 0.25}
    finally:
        front.close()


def test_an_unknown_router_is_refused_with_the_names_it_could_be():
    with pytest.raises(ValueError,
                       match="router must be one of least-requests, least-tokens, mask-aware, round-robin, "
                             "got .round-robinn."):
        make_router("round-robinn")


@pytest.mark.slow
def test_status_lists_each_replica(front):
    front.run(serve(front.set, [request("status", 64)]))
    status = front.run(front.set.status())
    assert [r["replica"] for r in status["replicas"]] == [0, 1] and all(r["alive"] for r in status["replicas"])
    assert sum(r["finished"] for r in status["replicas"]) >= 1 and status["model"] == MODEL
    assert all("steps" in r and r["requests"] == [] for r in status["replicas"])


@pytest.mark.slow
def test_metrics_label_every_engine_family_per_replica(front):
    text = front.run(front.set.render_metrics()).decode()
    for replica in ("0", "1"):
        assert f'gouache_queue_length{{replica="{replica}"}}' in text
        assert f'gouache_image_steps_total{{degree="1",replica="{replica}"}}' in text
    assert "gouache_request_latency_seconds_count 0.0" in text  # the API's own family, once, unlabelled


def test_merged_exposition_keeps_api_families_and_labels_engine_ones():
    api, engine = Metrics(), Metrics()
    api.errors.labels(kind="timeout").inc()
    engine.images.inc(3)
    engine.errors.labels(kind="timeout").inc(5)  # an engine's own count of an API family is not shown
    text = merged_exposition(api, {"0": engine.render(), "1": Metrics().render()}).decode()
    assert 'gouache_images_total{replica="0"} 3.0' in text
    assert 'gouache_images_total{replica="1"} 0.0' in text
    assert 'gouache_errors_total{kind="timeout"} 1.0' in text
    assert 'replica="0"} 5.0' not in text
    assert text.count("# TYPE gouache_images_total counter") == 1


@pytest.mark.slow
def test_a_dead_replica_fails_only_its_requests_and_the_next_one_is_served():
    config = (ModelConfig(MODEL), EngineConfig(torch_threads=1), SchedulerConfig(), ReplicaConfig(2, "round-robin"))
    front = Front(ReplicaSet(*config))
    try:
        async def scenario():
            replicas = front.set
            long = await replicas.submit(request("long", 64, steps=400))
            victim = next(r for r in replicas.replicas if "long" in r.requests)
            while not replicas.replicas[victim.index].requests["long"].started:  # it is denoising
                await asyncio.sleep(0.05)
            victim.process.kill()
            with pytest.raises(GouacheError) as failed:
                await asyncio.wait_for(long.images(), 10)
            after = [await (await replicas.submit(request(f"after{i}", 64))).images() for i in range(2)]
            return failed.value, after, replicas.stats().status, [r.alive for r in replicas.replicas]

        error, after, status, alive = front.run(scenario())
        assert error.kind == "worker_failure" and "replica" in str(error)
        assert [len(images) for images in after] == [1, 1]
        assert status == "ok" and sorted(alive) == [False, True]
    finally:
        front.close()


@pytest.mark.slow
def test_gouache_serve_with_two_replicas_behind_the_mask_aware_router_serves_edits_and_generations():
    with running_server("--model", MODEL, "--replicas", "2", "--router", "mask-aware") as url:
        openai = client(url)
        image = rgba_png(np.random.default_rng(0).integers(0, 255, (64, 64, 4), dtype=np.uint8) | 1)  # opaque-ish

        def generate(i):
            return openai.images.generate(model=MODEL, prompt="a red circle", size="64x64", n=1 + i % 2).data

        def edit(i):
            mask = np.full((64, 64, 4), 255, np.uint8)
            mask[: 16 * (i + 1), :, 3] = 0
            return openai.images.edit(model=MODEL, image=image, mask=rgba_png(mask), prompt="a blue square",
                                      size="64x64").data

        with ThreadPoolExecutor(6) as pool:
            results = [f.result() for f in [*(pool.submit(generate, i) for i in range(3)),
                                           *(pool.submit(edit, i) for i in range(3))]]
        metrics = httpx.get(f"{url}/metrics").text
    assert [len(data) for data in results] == [1, 2, 1, 1, 1, 1]
    per_replica = [float(line.split()[-1]) for line in metrics.splitlines()
                   if line.startswith("gouache_images_total{")]
    assert len(per_replica) == 2 and sum(per_replica) == 7


@pytest.mark.slow
def test_one_controlnet_service_serves_two_replicas_each_with_its_own_template_store(tmp_path):
    """The front starts the service; each replica's engine connects to it (none starts its own).
    Each replica's template store has a subdirectory of --template-dir to itself."""
    from gouache.config import ControlNetConfig, TemplateConfig
    from gouache.controlnet.model import random_controlnet
    from gouache.models.zoo import load_pipeline

    random_controlnet(load_pipeline(MODEL), std=0.2).save_pretrained(str(tmp_path / "edges"))
    engine = EngineConfig(torch_threads=1, controlnet=ControlNetConfig(str(tmp_path), workers=1),
                          templates=TemplateConfig(directory=str(tmp_path / "templates")))
    config = (ModelConfig(MODEL), engine, SchedulerConfig(), ReplicaConfig(2, "round-robin"))
    front = Front(ReplicaSet(*config))
    try:
        service = front.set.control_service
        cond = np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)
        load = [[ImageRequest(f"c{k}-0", "a red circle", 64, 64, 3, 4.0, seed=1, arrival_time=time.monotonic(),
                              controlnets=(("edges", png(cond), 1.0),))] for k in range(2)]
        outcomes, placed, _ = front.run(serve(front.set, load))
        assert sorted(placed.values()) == [0, 1]  # one request on each replica
        assert all(not isinstance(o, BaseException) for o in outcomes), outcomes
        assert outcomes[0][0].image == outcomes[1][0].image  # same request, same image, through either replica
        assert [p.is_alive() for p in service._procs] == [True]
        assert sorted(p.name for p in (tmp_path / "templates").iterdir()) == ["replica-0", "replica-1"]
    finally:
        front.close()
    assert not service._procs[0].is_alive()
