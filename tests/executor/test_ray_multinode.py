"""Multi-node Ray, simulated on this machine (`ray.cluster_utils.Cluster`): a head node for the API
front, offering no device resource, and device nodes offering the custom resource "gouache".
Replicas of two devices each (round-knapsack engines on Ray actors) land one per node, each
one's workers on its node; a node removed mid-load fails the requests of its replica naming the
node, the other replica's finish and the front keeps serving; a node added takes a replacement
replica, which joins the router and serves generations and edits. One cluster serves the
module. Skipped without the `gouache[ray]` extra."""

from __future__ import annotations

import asyncio
import os
import time

import httpx
import pytest

from gouache.config import EngineConfig, ModelConfig, ReplicaConfig, SchedulerConfig, ServerConfig
from gouache.errors import GouacheError
from gouache.sched.costmodel import save
from tests.executor.test_multiproc import COST, MODEL

ray = pytest.importorskip("ray", reason="multi-node Ray needs the gouache[ray] extra")

RESOURCE = "gouache"  # what device nodes offer and the front's node does not
# Ray takes a node for dead after this many missed health checks this far apart (defaults: 5 x 3 s)
FAST_HEALTH_CHECKS = {"health_check_period_ms": 500, "health_check_failure_threshold": 3}


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    from gouache.executor.ray_cluster import connect

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "_system_config": FAST_HEALTH_CHECKS})
    devices = [cluster.add_node(num_cpus=2, resources={RESOURCE: 2}) for _ in range(2)]
    cluster.wait_for_nodes()
    connect(cluster.address)
    yield cluster, devices
    ray.shutdown()
    cluster.shutdown()
    address_file = ray._private.utils.get_ray_address_file(None)  # so that a later ray.init() starts its own
    if os.path.exists(address_file) and open(address_file).read().strip() == cluster.address:
        os.remove(address_file)


def engine_config(address: str, devices: int, **ray_options) -> EngineConfig:
    return EngineConfig(executor="ray", devices=devices, torch_threads=1, ray_address=address,
                        ray_resource=RESOURCE, **ray_options)


def test_ray_options_are_checked_with_reasons():
    with pytest.raises(ValueError, match="ray_placement must be one of strict-pack, pack, spread, got 'tight'"):
        EngineConfig(executor="ray", ray_placement="tight")
    with pytest.raises(ValueError, match="a Ray placement is read only by the ray executor"):
        EngineConfig(executor="multiproc", ray_placement="spread")
    with pytest.raises(ValueError, match="a Ray resource picks nodes of an existing cluster"):
        EngineConfig(executor="ray", ray_resource=RESOURCE)
    with pytest.raises(ValueError, match="must name a custom resource"):
        EngineConfig(executor="ray", ray_address="auto", ray_resource="CPU")


@pytest.mark.slow
def test_devices_or_replicas_that_the_nodes_could_never_hold_are_refused_at_once(cluster):
    from gouache.executor.ray_executor import RayExecutor
    from gouache.executor.worker import WorkerSpec

    started = time.monotonic()
    with pytest.raises(ValueError, match=r"3 devices of CPU 1, gouache 1 each do not fit on one node "
                                         r"\(--ray-placement strict-pack\); the live nodes offer Ray node \w{8} "
                                         r"\(.*\): CPU \d, gouache \d; .*--ray-placement pack"):
        RayExecutor(WorkerSpec(MODEL), 3, cluster[0].address, resource=RESOURCE)
    from gouache.replicas.front import ReplicaSet

    replicas = ReplicaSet(ModelConfig(MODEL), engine_config(cluster[0].address, devices=2), SchedulerConfig(),
                          ReplicaConfig(3))
    with pytest.raises(ValueError, match=r"3 replicas of 2 devices of CPU 1, gouache 1 each do not fit with each "
                                         r"replica's on one node \(--ray-placement strict-pack\)"):
        asyncio.run(replicas.start())
    assert time.monotonic() - started < 10
    assert not [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]


def alive_actors() -> list[dict]:
    return [a for a in ray._private.state.actors(actor_state_name="ALIVE").values()]


@pytest.mark.slow
def test_replicas_on_their_own_nodes_survive_a_node_loss_and_a_new_node_takes_a_replacement(cluster, tmp_path):
    from gouache.api.server import create_app
    from gouache.replicas.front import ReplicaSet
    from tests.replicas.test_replicas import Front, serve
    from tests.replicas.test_replicas import request as api_request

    ray_cluster, device_nodes = cluster
    save(COST, tmp_path / "parallel.json")  # round-knapsack: a request alone takes both of its replica's devices
    config = (ModelConfig(MODEL), engine_config(ray_cluster.address, devices=2),
              SchedulerConfig(policy="round-knapsack", cost_model=str(tmp_path / "parallel.json")),
              ReplicaConfig(2, "round-robin"))
    front = Front(ReplicaSet(*config))
    replicas = front.set
    http = httpx.AsyncClient(transport=httpx.ASGITransport(create_app(replicas, ServerConfig())), base_url="http://t")

    def generate(n: int = 1):
        return front.run(http.post("/v1/images/generations", json={"prompt": "a red circle", "size": "64x64",
                                                                   "n": n, "num_inference_steps": 3}))

    try:
        # each replica's two devices on one node, the replicas on the two device nodes, none on the head
        nodes = [r.nodes for r in replicas.replicas]
        assert [len(set(n)) for n in nodes] == [1, 1] and {n[0] for n in nodes} == {d.node_id for d in device_nodes}
        actors = alive_actors()
        workers = [a for a in actors if a["ActorClassName"].endswith("_WorkerActor")]
        placed = sorted(a["Address"]["NodeID"] for a in actors if a["ActorClassName"].endswith("_ReplicaActor"))
        assert placed == sorted(n[0] for n in nodes)
        assert len(workers) == 4 and all(w["Address"]["NodeID"] == w["OwnerAddress"]["NodeID"] for w in workers)
        status = front.run(http.get("/v1/status")).json()
        assert [r["nodes"] for r in status["replicas"]] == nodes

        async def lose_a_node_mid_load():
            long = await replicas.submit(api_request("long", 64, steps=400))  # round-robin: replica 0
            short = await replicas.submit(api_request("short", 64, steps=30))  # replica 1
            while not replicas.replicas[0].requests["long"].started:
                await asyncio.sleep(0.05)
            lost = next(d for d in device_nodes if d.node_id == replicas.replicas[0].nodes[0])
            await asyncio.to_thread(ray_cluster.remove_node, lost, False)
            outcomes = await asyncio.wait_for(asyncio.gather(long.images(), short.images(), return_exceptions=True),
                                              60)
            return lost, outcomes

        lost, (failed, served) = front.run(lose_a_node_mid_load())
        assert isinstance(failed, GouacheError) and failed.kind == "worker_failure", failed
        # "lost its Ray node ..." once Ray gave the node up, "ended on Ray node ..." if the actor's death came first
        assert "replica 0 " in failed.message and f"Ray node {lost.node_id[:8]}" in failed.message, failed.message
        assert len(served) == 1
        assert front.run(http.get("/health")).status_code == 200
        assert generate().status_code == 200
        assert [r.alive for r in replicas.replicas] == [False, True, False] and replicas.replicas[2].joining

        joined = ray_cluster.add_node(num_cpus=2, resources={RESOURCE: 2})
        deadline = time.monotonic() + 120
        while not replicas.replicas[2].alive:
            assert time.monotonic() < deadline and replicas.replicas[2].joining, "the replacement did not join"
            time.sleep(0.2)
        assert replicas.replicas[2].nodes == [joined.node_id] * 2
        outcomes, where, _ = front.run(serve(replicas, [api_request("g", 64, n=2), api_request("e", 64, repaint=0.5)]))
        assert [len(images) for images in outcomes] == [2, 1], outcomes
        assert sorted(where.values()) == [1, 2]  # round-robin over the survivor and the replacement
        metrics = front.run(http.get("/metrics")).text
        assert 'gouache_images_total{replica="1"}' in metrics and 'gouache_images_total{replica="2"}' in metrics
        assert 'gouache_images_total{replica="0"}' not in metrics  # the lost replica is not asked
    finally:
        front.run(http.aclose())
        front.close()
    deadline = time.monotonic() + 10  # ray.kill returns before the actors are gone
    while [a for a in alive_actors() if a["ActorClassName"].endswith(("_WorkerActor", "_ReplicaActor"))]:
        assert time.monotonic() < deadline, "actors outlived the replicas' close"
        time.sleep(0.2)
    assert not [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
