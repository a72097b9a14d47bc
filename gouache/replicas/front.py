"""`ReplicaSet`: R engine processes behind one API server, each request sent to one by a router.

It is an `Engine` to the API (gouache.api.engine). Each replica runs an `AsyncEngine` in its
own process (`gouache.replicas.process`, which also describes the messages). The set keeps
the router's view of every replica (`gouache.replicas.routing`) from the events passing through it.

A replica that exits is noticed within `_WATCH_S`, one that hangs (alive, not answering) by
its missed pings (`Deadlines`): its requests end with an explicit WorkerFailureError and nothing
more is routed to it; the server keeps serving on the others and exits (like a single engine's
death) only when none is left. Every call to a replica has a deadline (`replicas/calls.py`), so
a replica that dies or hangs fails only the calls and requests that needed it. Under ray a lost
replica (its node lost, say) is replaced: the new one is placed when the cluster has room for it
and joins the router once its model is loaded (`replicas/ray_replicas.py`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio

from gouache.children import processes
from gouache.engine.adapters import start_control_service
from gouache.engine.handle import RequestHandle
from gouache.errors import EngineStoppedError, GouacheError, QueueFullError, ShuttingDownError, WorkerFailureError
from gouache.metrics import Metrics, merged_exposition
from gouache.outputs import EngineStats, ErrorEvent, ImageEvent, ProgressEvent
from gouache.replicas.calls import Calls, Deadlines, ReplicaLostError, tell
from gouache.replicas.process import decode, replica_main
from gouache.replicas.routing import ReplicaView, SentRequest, computed_share, make_router, route_step_cost
from gouache.sched.router import RouteRequest

if TYPE_CHECKING:
    from gouache.config import EngineConfig, ModelConfig, ReplicaConfig, SchedulerConfig
    from gouache.model_info import ModelInfo
    from gouache.request import ImageRequest

log = logging.getLogger(__name__)

_WATCH_S = 0.25  # how often the replicas' processes are checked


class ReplicaSet:
    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig, sched_config: SchedulerConfig,
                 replica_config: ReplicaConfig, start_timeout_s: float = 600.0, deadlines: Deadlines = Deadlines()):
        if engine_config.torch_threads is None:  # R replicas share the cores instead of each taking all
            threads = max(1, (os.cpu_count() or 1) // replica_config.replicas)
            engine_config = replace(engine_config, torch_threads=threads)
        self.configs = (model_config, engine_config, sched_config)
        self.count = replica_config.replicas
        self.router = make_router(replica_config.router)
        self.max_batch = sched_config.max_batch_size  # with auto (None), the least a replica measured, once ready
        self.max_upload_pixels = engine_config.max_upload_pixels
        self.start_timeout_s = start_timeout_s
        self.deadlines = deadlines
        self.metrics = Metrics()  # the API's own families; the engines' come from the replicas
        self.info: ModelInfo | None = None  # the replicas' model, once started
        self.died: asyncio.Event | None = None
        self.replicas: list[ReplicaView] = []
        self._calls = Calls()
        self._counts = {"finished": 0, "failed": 0}
        self._draining = False
        self._owns_ray = False  # whether start() started Ray (and so shuts it down)
        self.control_service = None  # the ControlNet service the replicas share, if one was asked for
        self._receiver: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None
        self._pinger: asyncio.Task | None = None

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the replicas and wait until each has loaded its model; raise with the reason if one could not."""
        self.died = asyncio.Event()
        self._dir = tempfile.mkdtemp(prefix="gouache-replicas-")
        self._context = zmq.asyncio.Context()
        try:
            await self._start_replicas()
        except BaseException:  # whatever failed, and wherever: nothing started is left behind
            try:
                await self._stop_processes(close_s=0.0)
            finally:
                self._release()
            raise
        self._receiver = asyncio.ensure_future(self._receive())
        self._watcher = asyncio.ensure_future(self._watch())
        self._pinger = asyncio.ensure_future(self._ping())  # from now on: a replica loading its model is not pinged
        log.info("%d replicas ready; router %s", self.count, self.router.name)

    async def _start_replicas(self) -> None:
        """Connect to Ray (under ray), start the ControlNet service if one is asked for and the
        replicas' processes, and wait until each replica is ready."""
        self._host = None  # under ray: this node's address, where replicas anywhere can reach us
        if self.configs[1].executor == "ray":
            from gouache.executor.ray_cluster import connect

            self._owns_ray = connect(self.configs[1].ray_address)
            import ray

            self._host = ray.util.get_node_ip_address()
            from gouache.replicas.ray_replicas import check_room

            check_room(self.configs, self.count)
        model_config, engine_config, sched_config = self.configs  # one ControlNet service serves every replica
        self.control_service, engine_config = start_control_service(lambda: _base(model_config), engine_config)
        self.configs = (model_config, engine_config, sched_config)
        self._messages = self._context.socket(zmq.PULL)
        messages = self._messages_at = self._bind(self._messages, "messages")
        for index in range(self.count):
            commands = self._context.socket(zmq.PUSH)
            process = self._launch(index, self._bind(commands, f"commands-{index}"), messages)
            process.start()
            self.replicas.append(ReplicaView(index, process, commands))
        try:
            await asyncio.wait_for(self._await_ready(), self.start_timeout_s)
        except TimeoutError:
            late = "Ray has not placed them (is the cluster busy?) or " if self._host else ""
            raise TimeoutError(f"the replicas were not all ready within {self.start_timeout_s:g} s: {late}"
                               "their models load too slowly") from None

    def _bind(self, socket: zmq.asyncio.Socket, name: str) -> str:
        """Bind `socket` (IPC here, TCP on this node's address under ray); the address to connect to."""
        if self._host is None:
            socket.bind(f"ipc://{self._dir}/{name}")
            return f"ipc://{self._dir}/{name}"
        return f"tcp://{self._host}:{socket.bind_to_random_port(f'tcp://{self._host}')}"

    def _launch(self, index: int, commands: str, messages: str):
        """A replica's process, or its Ray actor under --executor ray (both not started yet)."""
        if self._host is not None:
            from gouache.replicas.ray_replicas import RayReplica

            return RayReplica(index, commands, messages, self.configs)
        return processes().Process(target=replica_main, name=f"gouache-replica-{index}",
                             args=(index, commands, messages, self.configs))

    async def _await_ready(self) -> None:
        ready: set[int] = set()
        while len(ready) < self.count:
            try:
                kind, index, *rest = decode(await asyncio.wait_for(self._messages.recv(), _WATCH_S))
            except TimeoutError:
                exited = [r for r in self.replicas if r.process.exitcode is not None]
                if exited:
                    raise RuntimeError(f"replica {exited[0].index} exited with status {exited[0].process.exitcode} "
                                       "while loading its model") from None
                continue
            if kind == "failed":
                raise ValueError(f"replica {index} did not start: {rest[0]}")
            if kind == "ready":
                ready.add(index)
                self.replicas[index].nodes = self.replicas[index].process.placed() if self._host else []
                self.info = rest[0]
                self.max_batch = min(self.max_batch or self.info.max_batch, self.info.max_batch)
        if self.router.name == "mask-aware":  # its edits' tokens and rows are the model's, known now
            self.router = make_router(self.router.name, route_step_cost(self.configs[1].templates, self.info))

    async def drain(self, grace_s: float) -> None:
        self._draining = True
        timeout_s = grace_s + self.deadlines.drain_margin_s
        await asyncio.gather(*(self._call(r, "drain", grace_s, timeout_s=timeout_s) for r in self._alive()),
                             return_exceptions=True)

    async def aclose(self) -> None:
        self._draining = True
        self._watcher.cancel()  # replicas exiting now is what was asked for
        self._pinger.cancel()
        try:
            await self._stop_processes(close_s=self.deadlines.close_s)
        finally:  # the socket directory goes whatever became of the replicas
            self._receiver.cancel()
            for replica in self.replicas:
                self._fail_replica(replica, EngineStoppedError("the server is shutting down"))
            self._release()

    def _release(self) -> None:
        if self.control_service is not None:
            self.control_service.shutdown()
        self._context.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)
        if self._owns_ray:
            import ray

            ray.shutdown()

    async def _stop_processes(self, close_s: float) -> None:
        """Close each live replica (if `close_s`) and give the ones that answered `close_s` to
        exit; kill every one still running then (a dead or hung one at once)."""
        closing = self._alive() if close_s > 0 else []
        answers = await asyncio.gather(*(self._call(r, "close", timeout_s=close_s) for r in closing),
                                       return_exceptions=True)
        closed = {r.index for r, answer in zip(closing, answers) if not isinstance(answer, BaseException)}
        loop = asyncio.get_running_loop()
        for replica in self.replicas:
            if replica.index in closed:
                await loop.run_in_executor(None, replica.process.join, close_s)
            if replica.process.exitcode is None:
                replica.process.kill()
                await loop.run_in_executor(None, replica.process.join, 5.0)

    # -- the API's calls -------------------------------------------------------------------

    async def submit(self, requests: list[ImageRequest]) -> RequestHandle:
        if self._draining:
            raise ShuttingDownError("the server is shutting down; retry on another replica or after its restart")
        alive = self._alive()
        if not alive:
            raise EngineStoppedError("no replica is running")
        first = requests[0]
        ratio = 1.0
        if first.is_edit and self.router.reads_masks:
            ratio = await asyncio.to_thread(computed_share, first, self.configs[1].templates, self.max_upload_pixels)
        tier = first.tier
        views = {i: RouteRequest(r.request_id, r.width * r.height, r.num_inference_steps, ratio, tier)
                 for i, r in enumerate(requests)}
        api_id = first.api_id
        whole = RouteRequest(api_id, sum(v.pixels for v in views.values()), first.num_inference_steps, ratio, tier)
        chosen = alive[self.router.route(whole, [r.load(self.max_batch) for r in alive])]
        # a full replica passes the request on to the others, least loaded first, and so does one
        # lost (or not answering) before it took the request: the request did not need that one
        others = sorted((r for r in alive if r is not chosen), key=lambda r: len(r.requests))
        refused: GouacheError = EngineStoppedError("no replica is running")
        for replica in (chosen, *others):
            if not replica.alive:  # lost while an earlier one was asked
                continue
            try:
                return await self._submit_to(replica, api_id, requests, views)
            except (QueueFullError, ReplicaLostError) as error:
                refused = error
        raise refused

    async def _submit_to(self, replica: ReplicaView, api_id: str, requests: list[ImageRequest],
                         views: dict[int, RouteRequest]) -> RequestHandle:
        loop = asyncio.get_running_loop()
        handle = RequestHandle(api_id, len(requests), loop, lambda: self._abort(replica, api_id))
        # before the call: events may follow its reply at once
        replica.requests[api_id] = SentRequest(handle, dict(views))
        try:
            await self._call(replica, "submit", api_id, requests, timeout_s=self.deadlines.submit_s)
        except BaseException:
            # the replica may hold the request yet (the call timed out, or was cancelled, after its
            # send): abort it there; an abort of what a replica never took does nothing
            self._abort(replica, api_id)
            raise
        return handle

    async def list_loras(self) -> list[dict]:
        return await self._listing("list_loras")

    async def register_lora(self, name: str) -> dict:
        return await self._register("register_lora", name)

    async def list_controlnets(self) -> list[dict]:
        return await self._listing("list_controlnets")

    async def register_controlnet(self, name: str) -> dict:
        return await self._register("register_controlnet", name)

    async def _listing(self, call: str) -> list[dict]:
        """The first live replica's listing of an adapter directory (every replica reads the same)."""
        alive = self._alive()
        if not alive:
            raise EngineStoppedError("no replica is running")
        return await self._call(alive[0], call, timeout_s=self.deadlines.query_s)

    async def _register(self, call: str, name: str) -> dict:
        """Every live replica loads the adapter; the first one's answer."""
        alive = self._alive()
        if not alive:
            raise EngineStoppedError("no replica is running")
        answers = await asyncio.gather(*(self._call(r, call, name, timeout_s=self.deadlines.register_s) for r in alive))
        return answers[0]

    def stats(self) -> EngineStats:
        waiting = running = 0
        for replica in self.replicas:
            load = replica.load(self.max_batch)
            waiting, running = waiting + len(load.waiting), running + len(load.running)
        status = "dead" if not self._alive() else "draining" if self._draining else "ok"
        return EngineStats(waiting, running, self._counts["finished"], self._counts["failed"], status)

    async def status(self) -> dict:
        """Each replica's status (a dead one says so), under the front's totals."""
        stats, alive = self.stats(), self._alive()
        answers = await asyncio.gather(*(self._call(r, "status", timeout_s=self.deadlines.query_s) for r in alive),
                                       return_exceptions=True)
        by_index = {r.index: a for r, a in zip(alive, answers) if isinstance(a, dict)}
        replicas = [{"replica": r.index, "alive": r.index in by_index, **({"joining": True} if r.joining else {}),
                     **({"nodes": r.nodes} if r.nodes else {}), **by_index.get(r.index, {})} for r in self.replicas]
        return {"status": stats.status, "model": self.info.name if self.info else None, "waiting": stats.waiting,
                "running": stats.running, "finished": stats.finished, "failed": stats.failed, "replicas": replicas}

    async def render_metrics(self) -> bytes:
        """The API's families and each replica's engine families, labelled replica="<index>"."""
        alive = self._alive()
        texts = await asyncio.gather(*(self._call(r, "metrics", timeout_s=self.deadlines.query_s) for r in alive),
                                     return_exceptions=True)
        return merged_exposition(self.metrics, {str(r.index): text for r, text in zip(alive, texts)
                                                if isinstance(text, bytes)})

    # -- talking to replicas ---------------------------------------------------------------

    def _alive(self) -> list[ReplicaView]:
        return [r for r in self.replicas if r.alive]

    async def _call(self, replica: ReplicaView, kind: str, *args: Any, timeout_s: float) -> Any:
        """Send a command and wait for its reply within `timeout_s`; raise the GouacheError it
        answered with, or ReplicaLostError."""
        return await self._calls.call(replica.index, replica.commands, kind, *args, timeout_s=timeout_s)

    def _abort(self, replica: ReplicaView, api_id: str) -> None:
        replica.requests.pop(api_id, None)
        if replica.alive:
            tell(replica.commands, ("abort", api_id))

    async def _receive(self) -> None:
        while True:
            kind, index, *rest = decode(await self._messages.recv())
            if kind == "reply":
                self._calls.answer(*rest)
            elif kind == "event":
                self._on_event(self.replicas[index], *rest)
            elif kind == "ready":  # a replacement (the first replicas are ready before this loop runs)
                self._joined(self.replicas[index], rest[0])
            elif kind == "failed":
                self._not_joined(self.replicas[index], f"did not start: {rest[0]}")

    def _on_event(self, replica: ReplicaView, api_id: str, event: Any) -> None:
        request = replica.requests.get(api_id)
        if request is None:  # aborted here already
            return
        if isinstance(event, ProgressEvent) and event.index in request.images:
            request.started.add(event.index)
            view = request.images[event.index]
            request.images[event.index] = replace(view, steps=event.total_steps - event.step)
        elif isinstance(event, ImageEvent):
            request.images.pop(event.index, None)
            self._counts["finished"] += 1
        elif isinstance(event, ErrorEvent):
            self._counts["failed"] += len(request.images)
            request.images.clear()
        if not request.images:
            replica.requests.pop(api_id, None)
        request.handle.push(event)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(_WATCH_S)
            for replica in self.replicas:
                if (replica.alive or replica.joining) and replica.process.exitcode is not None:
                    reason = (replica.process.exit_reason() if self._host else
                              f"exited (status {replica.process.exitcode})")
                    if replica.alive:
                        self._lose(replica, reason)
                    else:
                        self._not_joined(replica, reason)

    async def _ping(self) -> None:
        """Ping every live replica each `ping_s`; kill and lose one that misses `missed_pings` in
        a row. A replica answers from its asyncio loop, which its engine's steps do not hold."""
        deadlines = self.deadlines
        while True:
            await asyncio.sleep(deadlines.ping_s)
            alive = self._alive()
            answers = await asyncio.gather(*(self._call(r, "ping", timeout_s=deadlines.ping_s) for r in alive),
                                           return_exceptions=True)
            for replica, answer in zip(alive, answers):
                replica.missed_pings = replica.missed_pings + 1 if isinstance(answer, Exception) else 0
                if replica.alive and replica.missed_pings >= deadlines.missed_pings:
                    replica.process.kill()
                    self._lose(replica, f"stopped answering ({replica.missed_pings} pings in a row unanswered "
                                        f"within {deadlines.ping_s:g} s) and was killed")

    def _lose(self, replica: ReplicaView, reason: str) -> None:
        """`replica` is gone for `reason`: fail its requests and its calls, route nothing more to it."""
        replica.alive = False
        left = len(self._alive())
        log.error("replica %d %s; %d replicas left", replica.index, reason, left)
        self._fail_replica(replica, WorkerFailureError(f"replica {replica.index} {reason} "
                                                       "before this request finished; retry it"))
        self._calls.fail(replica.index, reason)
        if not left:
            self.died.set()
        elif self._host is not None:
            self._replace(replica)

    def _replace(self, lost: ReplicaView) -> None:
        """Under ray: give a lost replica's placement back and start one in its place. Ray places
        it when the cluster has room (at once, or when a node joins); it joins the router once its
        model is loaded (`_joined`)."""
        lost.process.kill()
        if self._draining:
            return
        index = len(self.replicas)
        commands = self._context.socket(zmq.PUSH)
        process = self._launch(index, self._bind(commands, f"commands-{index}"), self._messages_at)
        process.start()
        self.replicas.append(ReplicaView(index, process, commands, alive=False, joining=True))
        log.info("replica %d starts in place of replica %d; it serves once placed and loaded", index, lost.index)

    def _joined(self, replica: ReplicaView, info: ModelInfo) -> None:
        replica.nodes = replica.process.placed()
        replica.joining, replica.alive = False, True
        self.max_batch = min(self.max_batch or info.max_batch, info.max_batch)
        log.info("replica %d joined on %s; %d replicas serving", replica.index, replica.nodes[0][:8],
                 len(self._alive()))

    def _not_joined(self, replica: ReplicaView, reason: str) -> None:
        """A replacement that ended before it was ready is not replaced again: a model that does
        not load would fail every time."""
        replica.joining = False
        replica.process.kill()
        log.error("replica %d %s while starting; it is not replaced", replica.index, reason)

    def _fail_replica(self, replica: ReplicaView, error: GouacheError) -> None:
        for request in replica.requests.values():
            self._counts["failed"] += len(request.images)
            request.handle.push(ErrorEvent(error.kind, error.message, error.status))
        replica.requests.clear()


def _base(model_config: ModelConfig):
    """What the replicas' ControlNets must fit (torch is imported only for a ControlNet service)."""
    from gouache.controlnet.model import Base

    return Base.of_model(model_config.model, model_config.dtype, model_config.device)
