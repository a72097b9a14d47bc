"""Replicas as Ray actors (`serve --replicas R --executor ray`): the same replica loop as a local
process, placed by Ray anywhere in the cluster; its devices' workers are actors too.

The API server then binds its ZeroMQ sockets on TCP at its node's address instead of IPC, and
watches each replica through `RayReplica`, which answers like the `multiprocessing.Process`
`ReplicaSet` watches (exitcode, join, kill). A replica actor reserves no CPU: the devices it
drives are its worker actors, which do.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from gouache.executor.ray_executor import require_ray
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


class RayReplica:
    """One replica actor, serving from `start()` until closed."""

    def __init__(self, index: int, commands: str, messages: str,
                 configs: tuple[ModelConfig, EngineConfig, SchedulerConfig]):
        self.ray = require_ray()
        self.name = f"gouache-replica-{index}"
        self.args = (index, commands, messages, configs)
        self.actor = None
        self.done = None  # the `serve` call: it ends when the replica does

    def start(self) -> None:
        self.actor = self.ray.remote(num_cpus=0)(_ReplicaActor).remote()
        self.done = self.actor.serve.remote(*self.args)

    @property
    def exitcode(self) -> int | None:
        ready, _ = self.ray.wait([self.done], timeout=0)
        if not ready:
            return None
        try:
            return self.ray.get(self.done)
        except self.ray.exceptions.RayError:
            return 1

    def join(self, timeout: float | None = None) -> None:
        ready, _ = self.ray.wait([self.done], timeout=timeout)
        if ready:  # the replica is done: free its actor
            self.kill()

    def kill(self) -> None:
        self.ray.kill(self.actor)
