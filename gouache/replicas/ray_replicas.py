"""Replicas as Ray actors (`serve --replicas R --executor ray`): the same replica loop as a local
process, placed by Ray anywhere in the cluster; its devices' workers are actors too.

The API server then binds its ZeroMQ sockets on TCP at its node's address instead of IPC, and
watches each replica through `RayReplica`, which answers like the `multiprocessing.Process`
`ReplicaSet` watches (exitcode, join, kill) and also says where it runs and why it ended.

Each replica gets a placement group of one bundle per device (`executor/ray_cluster.py`; on one
node unless `--ray-placement` says otherwise); its own actor runs in bundle 0 reserving no CPU
(the devices it drives are its worker actors, which do), and its executor puts worker i in
bundle i. Killing a replica gives its group back. A replica whose node is lost ends like a
crashed one; the front then starts another in its place, which Ray places as soon as the
cluster has room for it again (a node joins).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from gouache.executor import ray_cluster
from gouache.replicas.process import _Replica

if TYPE_CHECKING:
    from gouache.config import EngineConfig, ModelConfig, SchedulerConfig


class _ReplicaActor:
    def serve(self, index: int, commands: str, messages: str,
              configs: tuple[ModelConfig, EngineConfig, SchedulerConfig]) -> int:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"%(levelname)s:     replica {index}: %(message)s"))
        logging.getLogger("gouache").addHandler(handler)
        logging.getLogger("gouache").setLevel(logging.INFO)
        asyncio.run(_Replica(index, commands, messages).serve(configs))
        return 0


def check_room(configs: tuple[ModelConfig, EngineConfig, SchedulerConfig], replicas: int) -> None:
    """At the server's start: refuse `replicas` replicas that the live nodes could never hold at
    once (a replacement, later, waits for a node instead)."""
    _, engine_config, _ = configs
    ray_cluster.check_fits(_bundles(configs), engine_config.ray_placement, replicas)


def _bundles(configs: tuple[ModelConfig, EngineConfig, SchedulerConfig]) -> list[dict[str, float]]:
    model_config, engine_config, _ = configs
    return ray_cluster.device_bundles(engine_config.devices, model_config.device.startswith("cuda"),
                                      engine_config.ray_resource)


class RayReplica:
    """One replica actor in its own placement group, serving from `start()` until closed."""

    def __init__(self, index: int, commands: str, messages: str,
                 configs: tuple[ModelConfig, EngineConfig, SchedulerConfig]):
        self.ray = ray_cluster.require_ray()
        self.name = f"gouache-replica-{index}"
        self.args = (index, commands, messages, configs)
        self.bundles = _bundles(configs)
        self.placement = configs[1].ray_placement
        self.nodes: list[str] = []  # each device's node id, the replica's own first (known once `placed`)
        self.group = None  # its placement group, until killed
        self.actor = None
        self.done = None  # the `serve` call: it ends when the replica does
        self._error: str | None = None  # how its `serve` call failed (Ray's first line)

    def start(self) -> None:
        self.group = ray_cluster.reserve(self.bundles, self.placement, self.name)
        actor = self.ray.remote(num_cpus=0)(_ReplicaActor)
        self.actor = actor.options(**ray_cluster.in_bundle(self.group, 0)).remote()
        self.done = self.actor.serve.remote(*self.args)

    def placed(self) -> list[str]:
        """Each device's node id, once Ray granted the group (the replica said it is ready)."""
        if not self.nodes and self.group is not None:
            self.nodes = ray_cluster.bundle_nodes(self.group)
        return self.nodes

    @property
    def exitcode(self) -> int | None:
        ready, _ = self.ray.wait([self.done], timeout=0)
        if not ready:
            return None
        try:
            return self.ray.get(self.done)
        except self.ray.exceptions.RayError as error:
            self._error = self._error or f"{type(error).__name__}: {str(error).strip().splitlines()[0]}"
            return 1

    def exit_reason(self) -> str:
        """Why it ended, once `exitcode` says it did, naming its node: the node was lost, or how
        its actor ended. A node's processes die with it, and Ray reports the actor dead within
        seconds, before its health checks give the node up (15 s by default): then it reads
        "ended on Ray node ...: ActorDiedError: ..."."""
        ended = f"status {self.exitcode}" + (f", {self._error}" if self._error else "")
        if not self.nodes:  # it never said it was ready
            return f"exited ({ended})"
        if ray_cluster.node_lost(self.nodes[0]):
            return f"lost its {ray_cluster.node_name(self.nodes[0])}"
        return f"ended on {ray_cluster.node_name(self.nodes[0])} ({ended})"

    def join(self, timeout: float | None = None) -> None:
        ready, _ = self.ray.wait([self.done], timeout=timeout)
        if ready:  # the replica is done: free its actor
            self.kill()

    def kill(self) -> None:
        """Kill its actor and give its placement back (its workers go with the actor that owns them)."""
        if self.actor is not None:
            self.ray.kill(self.actor)
        if self.group is not None:
            ray_cluster.release(self.group)
            self.group = None
