"""The ray executor on a local Ray (2 CPUs): actors run the plans multiproc runs, with the
pixels of one device; the whole engine serves a request through them; a killed actor fails its
requests and the next request is served on the other. Skipped without the `gouache[ray]` extra."""

import asyncio
import os
import time

import pytest

from gouache.config import EngineConfig, ModelConfig, SchedulerConfig
from gouache.executor.worker import WorkerSpec
from gouache.request import ImageRequest
from gouache.sched.costmodel import save
from tests.executor.test_multiproc import COST, MODEL, check_a_dead_worker, check_a_hung_worker, check_scripted_rounds

ray = pytest.importorskip("ray", reason="the ray executor needs the gouache[ray] extra")


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture
def two_actors(local_ray):
    from gouache.executor.ray_executor import RayExecutor

    executor = RayExecutor(WorkerSpec(MODEL, torch_threads=1), 2)
    yield executor
    executor.shutdown()


def test_degrees_change_between_rounds_on_ray_actors_with_the_pixels_of_one_device(two_actors):
    check_scripted_rounds(two_actors)


def test_a_killed_actor_fails_its_requests_and_the_next_is_served(two_actors):
    check_a_dead_worker(two_actors)


def test_a_hung_actor_is_taken_for_dead_at_its_deadline_and_the_rest_are_served(local_ray):
    """Before: a ray call waited as long as its actor took, so a stuck actor held its step forever."""
    from gouache.executor.ray_executor import RayExecutor

    deadline_s = 5.0
    executor = RayExecutor(WorkerSpec(MODEL, torch_threads=1), 2, collective_timeout_s=3.0,
                           reply_deadline_s=deadline_s)
    try:
        pid = ray.get(executor._actors[1].__ray_call__.remote(lambda actor: os.getpid()))
        check_a_hung_worker(executor, deadline_s, pid)
    finally:
        executor.shutdown()


def test_the_engine_serves_a_request_through_ray_actors(local_ray, tmp_path):
    from gouache.engine.build import build_engine

    save(COST, tmp_path / "parallel.json")
    engine = build_engine(
        ModelConfig(MODEL), EngineConfig(executor="ray", devices=2, torch_threads=1),
        SchedulerConfig(policy="round-knapsack", cost_model=str(tmp_path / "parallel.json")))

    async def serve():
        await engine.start()
        try:
            handle = await engine.submit([ImageRequest("r-0", "a red circle", 64, 64, 3, 4.0, 0,
                                                       arrival_time=time.monotonic())])
            return await asyncio.wait_for(handle.images(), 120), await engine.render_metrics()
        finally:
            await engine.aclose()

    images, metrics = asyncio.run(serve())
    assert len(images) == 1 and images[0].image.startswith(b"\x89PNG")
    steps = [float(line.split()[-1]) for line in metrics.decode().splitlines()
             if line.startswith("gouache_image_steps_total{")]
    assert sum(steps) == 3


def test_replicas_as_ray_actors_serve_generations_and_edits(local_ray):
    from gouache.config import ReplicaConfig
    from gouache.replicas.front import ReplicaSet
    from tests.replicas.test_replicas import Front, serve
    from tests.replicas.test_replicas import request as api_request

    config = (ModelConfig(MODEL), EngineConfig(executor="ray", devices=1, torch_threads=1), SchedulerConfig(),
              ReplicaConfig(2, "round-robin"))
    front = Front(ReplicaSet(*config))
    try:
        load = [api_request("g", 64, n=2), api_request("e", 64, repaint=0.5)]
        outcomes, placed, _ = front.run(serve(front.set, load))
        metrics = front.run(front.set.render_metrics()).decode()
    finally:
        front.close()
    assert [len(images) for images in outcomes] == [2, 1]
    assert sorted(placed.values()) == [0, 1]
    assert 'gouache_images_total{replica="0"}' in metrics and 'gouache_images_total{replica="1"}' in metrics
