"""One replica: an `AsyncEngine` in its own process, driven by the API server over ZeroMQ.

The API server binds a PUSH socket per replica (its commands) and one PULL socket (every
replica's messages); a replica connects to both. Messages are pickled tuples:

    commands  ("submit", call, api_id, requests)  ("abort", api_id)  ("drain", call, grace_s)
              ("metrics", call)  ("status", call)  ("ping", call)  ("close", call)
    messages  ("ready", replica, info)  ("failed", replica, why)  ("reply", replica, call, value)
              ("event", replica, api_id, event)

A reply's value is what the call returned, or the GouacheError it raised. A submit is
answered before any of its request's events, which then follow in order until the request's
last image or its error. An abort may overtake its submit (the front gave up waiting for it):
the request is then aborted as soon as it is in. Every call is answered from this process's
asyncio loop while the engine's steps run on its own thread, so a ping is answered however long
a step takes: the front takes a replica that stops answering pings for hung.

A replica is a `become_child` process (the API server drains and closes it; it exits if the
server is gone) and exits when its engine loop dies, after the engine's errors for what was in
flight.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio

from gouache.children import become_child
from gouache.errors import GouacheError

if TYPE_CHECKING:
    from gouache.config import EngineConfig, ModelConfig, SchedulerConfig
    from gouache.engine.client import AsyncEngine
    from gouache.engine.handle import RequestHandle

log = logging.getLogger(__name__)


def encode(message: tuple) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> tuple:
    return pickle.loads(data)


def replica_main(index: int, commands: str, messages: str,
                 configs: tuple[ModelConfig, EngineConfig, SchedulerConfig]) -> None:
    """The process's entry point (spawned by `ReplicaSet`)."""
    become_child()
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"%(levelname)s:     replica {index}: %(message)s"))
    logging.getLogger("gouache").addHandler(handler)
    logging.getLogger("gouache").setLevel(logging.INFO)
    asyncio.run(_Replica(index, commands, messages).serve(configs))


class _Replica:
    def __init__(self, index: int, commands: str, messages: str):
        self.index = index
        self.context = zmq.asyncio.Context()
        self.commands = self.context.socket(zmq.PULL)
        self.commands.connect(commands)
        self.messages = self.context.socket(zmq.PUSH)
        self.messages.setsockopt(zmq.LINGER, 5000)  # what is queued still goes out after close()
        self.messages.connect(messages)
        self.engine: AsyncEngine | None = None
        self.handles: dict[str, RequestHandle] = {}
        self.submitting: dict[str, bool] = {}  # api id -> aborted already, while its submit is under way
        self.tasks: set[asyncio.Task] = set()

    async def serve(self, configs: tuple[ModelConfig, EngineConfig, SchedulerConfig]) -> None:
        from gouache.engine.build import build_engine

        model_config, engine_config, sched_config = configs
        engine_config = replace(engine_config, templates=engine_config.templates.under(f"replica-{self.index}"))
        try:
            self.engine = build_engine(model_config, engine_config, sched_config)
            await self.engine.start()
        except Exception as error:  # the API server reports it and exits
            log.exception("did not start")
            await self.send("failed", f"{type(error).__name__}: {error}")
            self.context.destroy(linger=5000)
            return
        await self.send("ready", self.engine.info)
        died = asyncio.ensure_future(self.engine.died.wait())
        receive = asyncio.ensure_future(self.commands.recv())
        while True:
            await asyncio.wait((receive, died), return_when=asyncio.FIRST_COMPLETED)
            if died.done():  # the engine already failed what was in flight; let those errors out
                log.critical("the engine loop died; this replica exits")
                await asyncio.sleep(0.5)
                break
            command = decode(receive.result())
            receive = asyncio.ensure_future(self.commands.recv())
            if command[0] == "close":
                await self.engine.aclose()
                await self.send("reply", command[1], None)
                break
            self.spawn(self.run(*command))
        receive.cancel()
        died.cancel()
        self.context.destroy(linger=5000)

    async def run(self, kind: str, *args: Any) -> None:
        if kind == "abort":
            handle = self.handles.get(args[0])
            if handle is not None:
                handle.abort()
            elif args[0] in self.submitting:
                self.submitting[args[0]] = True
            return
        call, *rest = args
        try:
            value = await getattr(self, f"_{kind}")(*rest)
        except GouacheError as error:
            await self.send("reply", call, error)
            return
        if kind != "submit":
            await self.send("reply", call, value)
            return
        self.handles[value.request_id] = value
        try:
            await self.send("reply", call, None)  # the submit's reply, then its events
            async for event in value:
                await self.send("event", value.request_id, event)
        finally:
            self.handles.pop(value.request_id, None)

    async def _submit(self, api_id: str, requests: list) -> RequestHandle:
        self.submitting[api_id] = False
        try:
            handle = await self.engine.submit(requests)
        finally:
            aborted = self.submitting.pop(api_id)
        if aborted:
            handle.abort()
        return handle

    async def _ping(self) -> None:
        return None

    async def _drain(self, grace_s: float) -> None:
        await self.engine.drain(grace_s)

    async def _metrics(self) -> bytes:
        return await self.engine.render_metrics()

    async def _list_loras(self) -> list[dict]:
        return await self.engine.list_loras()

    async def _register_lora(self, name: str) -> dict:
        return await self.engine.register_lora(name)

    async def _status(self) -> dict:
        return await self.engine.status()

    async def _list_controlnets(self) -> list[dict]:
        return await self.engine.list_controlnets()

    async def _register_controlnet(self, name: str) -> dict:
        return await self.engine.register_controlnet(name)

    async def send(self, kind: str, *args: Any) -> None:
        await self.messages.send(encode((kind, self.index, *args)))

    def spawn(self, coroutine) -> None:
        task = asyncio.ensure_future(coroutine)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

