"""The API's adapter calls on an engine: a request's LoRAs and ControlNets checked before it is
accepted, its conditioning images decoded, and the adapter directories listed and registered
(`GET/POST /v1/loras`, `/v1/controlnets`). An adapter that cannot serve a request is that
request's error (400), naming the field to fix."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from gouache.config import EngineConfig
from gouache.engine.imaging import DecodeError, decode_controls
from gouache.errors import InvalidRequestError
from gouache.request import ImageRequest


def start_control_service(base: Callable[[], object], config: EngineConfig) -> tuple[object | None, EngineConfig]:
    """The ControlNet service `config` asks for, started for the model `base()` describes, and
    the config its clients read (with the service's address); (None, config) where it asks for
    none, has one running, or the model takes no ControlNets (its requests are refused)."""
    controlnet = config.controlnet
    if not (controlnet.workers and controlnet.directory) or controlnet.service is not None:
        return None, config
    from gouache.controlnet.service import ControlService

    model = base()
    if model is None:
        return None, config
    service = ControlService(controlnet.workers, controlnet.directory, model, controlnet.model_bytes,
                             controlnet.torch_threads)
    return service, replace(config, controlnet=replace(controlnet, service=service.address))


class AdapterCalls:
    """Mixed into `AsyncEngine`: reads its `runner`, `pool`, `codecs` and `config`."""

    async def check_adapters(self, request: ImageRequest) -> list[np.ndarray]:
        """Raise InvalidRequestError unless the request's adapters can serve it; its ControlNets'
        conditioning images, decoded."""
        for name, _ in request.loras:
            await self._adapter_call(self.runner.lora_runtime.store.check, name)
        if not request.controlnets:
            return []
        names = [name for name, _, _ in request.controlnets]
        await self._adapter_call(self.runner.controls.check_request, names, request.controlnet_mode)
        images = await asyncio.wrap_future(self.codecs.submit(
            decode_controls, [data for _, data, _ in request.controlnets], request.width, request.height,
            self.config.max_upload_pixels))
        if isinstance(images, DecodeError):
            raise InvalidRequestError(images.message, param=images.param)
        return images

    async def list_loras(self) -> list[dict]:
        """GET /v1/loras: the adapter directory, and which adapters sit in host memory."""
        store = self.runner.lora_runtime.store
        return await self._adapter_call(lambda: [store.describe(name) for name in store.names()])

    async def register_lora(self, name: str) -> dict:
        """POST /v1/loras: check an adapter against the model and read it into every device's
        host memory, so its first request finds it there."""
        await self._adapter_call(self.runner.lora_runtime.store.check, name)
        loaded = (await self._adapter_call(self.pool.executor.collective_rpc, "load_lora", (name,)))[0]
        self.pool.touch()  # /metrics says what host memory holds now, not at the next step
        return loaded

    async def list_controlnets(self) -> list[dict]:
        """GET /v1/controlnets: the ControlNet directory, and which are loaded."""
        return await self._adapter_call(self.runner.controls.describe_all)

    async def register_controlnet(self, name: str) -> dict:
        """POST /v1/controlnets: check a ControlNet against the model and load it where it runs
        (every device's process, or the ControlNet service)."""
        await self._adapter_call(self.runner.controls.check, name)
        return (await self._adapter_call(self.pool.executor.collective_rpc, "load_controlnet", (name,)))[0]

    async def _adapter_call(self, function, *args):
        """`function(*args)` on a thread; an adapter that does not fit is the request's error (400)."""
        from gouache.adapter_names import ControlNetError, LoraError

        try:
            return await asyncio.get_running_loop().run_in_executor(None, function, *args)
        except LoraError as error:
            raise InvalidRequestError(str(error), "loras") from None
        except ControlNetError as error:
            raise InvalidRequestError(str(error), "controlnets") from None
