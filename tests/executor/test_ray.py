"""The ray executor on a local Ray (2 CPUs): actors run the plans multiproc runs, with the
pixels of one device; a killed actor fails its requests and the next request is served on the
other; a hung one is taken for dead. The whole engine on Ray actors, and replicas as Ray actors,
are served on a simulated multi-node cluster in test_ray_multinode.py. Skipped without the
`gouache[ray]` extra."""

import os

import pytest

from gouache.executor.worker import WorkerSpec
from tests.executor.test_multiproc import MODEL, check_a_dead_worker, check_a_hung_worker, check_scripted_rounds

pytestmark = pytest.mark.slow

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


def test_actors_run_changing_degrees_with_the_pixels_of_one_device_and_survive_a_killed_one(two_actors):
    """One executor for both checks: starting its two actors is most of the time."""
    check_scripted_rounds(two_actors)
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
