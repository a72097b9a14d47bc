"""`ray`: each device's worker as a Ray actor, on this machine or on an existing cluster.

Needs the optional `gouache[ray]` extra. `connect(address)` joins the cluster at `address`
("auto" finds the local one) or, with None, starts a Ray instance in this process. Each actor
reserves its device (one GPU under CUDA, where Ray makes it the actor's `cuda:0`; one CPU
otherwise) in its bundle of the replica's placement group (`ray_cluster`: on one node unless
`placement` says otherwise): the group the replica's own actor runs in when the front placed
it, else one reserved here. Each runs the same `Worker` as `multiproc`: it joins one
torch.distributed world (gloo / NCCL) whose rendezvous is a free port on rank 0's node, and
makes every aligned block's group up front. A call is an actor method call per rank; an actor
that dies fails its calls with `WorkerDied` as soon as Ray reports it (naming its node when the
node was lost), and its rank stays dead. An actor that owes a reply and sends none for
`reply_deadline_s` is taken for hung: it is killed and treated the same way.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from gouache.config import WORKER_TIMEOUT_S
from gouache.executor import ray_cluster
from gouache.executor.base import Executor, Gather, ReplyWatch, WorkerDied, free_port, open_gather
from gouache.executor.ray_cluster import connect, require_ray
from gouache.executor.worker import WorkerSpec, join_world

log = logging.getLogger(__name__)


class _WorkerActor:
    """What each actor runs (wrapped by `ray.remote` when the executor starts)."""

    def __init__(self, rank: int):
        self.rank = rank
        self.worker = None

    def rendezvous(self) -> str:
        """Rank 0's: a torch.distributed init method on this node."""
        import ray

        host = ray.util.get_node_ip_address()
        return f"tcp://{host}:{free_port(host)}"

    def join(self, world: int, init_method: str, spec: WorkerSpec, collective_timeout_s: float) -> str:
        """Join the world; the id of the node this actor runs on."""
        device = "cuda:0" if spec.cuda else "cpu"  # Ray shows a GPU actor its own GPU only
        self.worker = join_world(self.rank, world, init_method, spec, device, collective_timeout_s)
        return ray_cluster.this_node()

    def call(self, method: str, args: tuple) -> tuple[bool, Any]:
        try:
            return True, getattr(self.worker, method)(*args)
        except Exception as error:
            return False, f"{type(error).__name__}: {error}"


class RayExecutor(Executor):
    kind = "ray"

    def __init__(self, spec: WorkerSpec, num_devices: int, address: str | None = None,
                 placement: str = "strict-pack", resource: str | None = None,
                 start_timeout_s: float = 600.0, collective_timeout_s: float = 60.0,
                 reply_deadline_s: float = WORKER_TIMEOUT_S):
        self._watch = ReplyWatch(num_devices, reply_deadline_s, collective_timeout_s, self._hung)
        ray = require_ray()
        self._owns_ray = connect(address)
        self.num_devices = num_devices
        self.nodes: list[str] = []  # the node id each rank's actor runs on
        self._actors = []
        self._dead: dict[int, str] = {}
        self._lock = threading.Lock()
        self._group, self._owns_group = ray_cluster.current_group(), False
        try:
            if self._group is None:  # not in a replica the front placed: this engine's devices get a group
                bundles = ray_cluster.device_bundles(num_devices, spec.cuda, resource)
                ray_cluster.check_fits(bundles, placement)
                self._group, self._owns_group = ray_cluster.reserve(bundles, placement, "gouache-devices"), True
                ray_cluster.wait_placed(self._group, start_timeout_s, f"{num_devices} devices")
            elif len(self._group.bundle_specs) < num_devices:
                raise ValueError(f"this actor's placement group has {len(self._group.bundle_specs)} bundles, "
                                 f"fewer than its {num_devices} devices")
            actor = ray.remote(**ray_cluster.worker_resources(spec.cuda, resource))(_WorkerActor)
            self._actors = [actor.options(**ray_cluster.in_bundle(self._group, rank)).remote(rank)
                            for rank in range(num_devices)]
            init_method = ray.get(self._actors[0].rendezvous.remote(), timeout=start_timeout_s)
            joins = [a.join.remote(num_devices, init_method, spec, collective_timeout_s) for a in self._actors]
            self.nodes = ray.get(joins, timeout=start_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self._watch.start()

    def submit(self, method: str, args: tuple = (), ranks: Sequence[int] | None = None) -> Future[list[Any]]:
        gather = open_gather(ranks, self.num_devices, self._lock, self._dead)
        if gather.future.done():  # a rank is dead
            return gather.future
        for rank in gather.ranks:
            self._watch.sent(rank)
            reply = self._actors[rank].call.remote(method, args).future()
            reply.add_done_callback(lambda f, rank=rank: self._replied(gather, rank, f))
        return gather.future

    def dead(self) -> set[int]:
        with self._lock:
            return set(self._dead)

    def shutdown(self) -> None:
        self._watch.stop()
        ray = require_ray()
        for rank, actor in enumerate(self._actors):
            with self._lock:
                self._dead.setdefault(rank, "shut down")
            ray.kill(actor)
        if self._owns_group:
            self._owns_group = False
            ray_cluster.release(self._group)
        if self._owns_ray:
            ray.shutdown()

    def kill(self, rank: int) -> None:
        """Kill one worker's actor, as a crash would (for tests and fault drills)."""
        require_ray().kill(self._actors[rank])

    def _hung(self, rank: int, why: str) -> None:
        """An actor past its reply deadline: killed, its calls fail with `why` (Ray reports them
        failed, and `_replied` names the rank's first reason)."""
        with self._lock:
            if rank in self._dead:
                return
            self._dead[rank] = why
        log.error("the worker of device %d died: %s", rank, why)
        require_ray().kill(self._actors[rank])

    def _replied(self, gather: Gather, rank: int, reply: Future) -> None:
        self._watch.replied(rank)
        error = reply.exception()
        if error is None:
            gather.reply(rank, *reply.result())
            return
        from ray.exceptions import RayActorError

        if isinstance(error, RayActorError):
            why = f"its actor died ({type(error).__name__})"
            if self.nodes:  # Ray may report the actor dead before it gives its node up
                node = ray_cluster.node_name(self.nodes[rank])
                why = (f"its {node} was lost" if ray_cluster.node_lost(self.nodes[rank]) else
                       f"its actor on {node} died ({type(error).__name__})")
            with self._lock:
                first = rank not in self._dead
                self._dead.setdefault(rank, why)
            if first:
                log.error("the worker of device %d died: %s", rank, why)
            error = WorkerDied(rank, self._dead[rank])
        gather.reply(rank, False, error)
