"""An engine without a model that keeps the API's contract (gouache.api.engine.Engine).

Each image gets `num_inference_steps` ProgressEvents, evenly spaced PartialImageEvents when
asked, then a solid-colour image in the requested format and size. Uploads are decoded with
Pillow like the real engine does, so a non-image upload is an InvalidRequestError naming the field.
"""

from __future__ import annotations

import asyncio
import io

from PIL import Image

from gouache.engine.handle import RequestHandle
from gouache.errors import InvalidRequestError
from gouache.metrics import Metrics
from gouache.model_info import ModelInfo
from gouache.outputs import EngineStats, ErrorEvent, ImageEvent, PartialImageEvent, ProgressEvent
from gouache.request import ImageRequest

FAKE_INFO = ModelInfo(
    name="fake-sd",
    family="sd",
    size_step=8,
    default_size=256,
    default_steps=4,
    default_guidance=7.5,
    uses_cfg=True,
    inpaint_channels=False,
    deadlines=True,
    max_batch=8,
)
_PIL_FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}


def solid_image(width: int, height: int, output_format: str, seed: int = 0) -> bytes:
    colour = (seed * 37 % 256, seed * 91 % 256, seed * 53 % 256)
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buffer, _PIL_FORMATS[output_format])
    return buffer.getvalue()


def _decode_size(data: bytes, param: str) -> tuple[int, int]:
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.verify()
            return image.size
    except Exception:
        raise InvalidRequestError(f"Invalid value for '{param}': not a PNG, JPEG or WebP image.", param) from None


def check_uploads(request: ImageRequest) -> None:
    if request.image is None:
        return
    image_size = _decode_size(request.image, "image")
    if request.mask is not None and _decode_size(request.mask, "mask") != image_size:
        raise InvalidRequestError("Invalid value for 'mask': its size differs from the image's.", "mask")


class FakeEngine:
    def __init__(self, info: ModelInfo = FAKE_INFO, step_delay_s: float = 0.0):
        self.info = info
        self.metrics = Metrics()
        self.step_delay_s = step_delay_s  # sleep per denoising step
        self.submitted: list[ImageRequest] = []  # every ImageRequest ever submitted
        self.aborted: list[str] = []  # API ids whose handle was aborted
        self.raise_on_submit: Exception | None = None  # raised by every submit while set
        self.fail_with: ErrorEvent | None = None  # pushed instead of the images while set
        self.hold = False  # while True, requests stop before their images until aborted
        self.running = 0  # requests submitted and not ended
        self.started = False
        self.state = "ok"  # what stats() reports: ok | draining | dead
        self.died: asyncio.Event | None = None
        self.drained_with: float | None = None  # grace_s of the last drain() call
        self._tasks: set[asyncio.Task] = set()

    async def submit(self, requests: list[ImageRequest]) -> RequestHandle:
        if self.raise_on_submit is not None:
            raise self.raise_on_submit
        for request in requests:
            check_uploads(request)
        self.submitted.extend(requests)
        api_id = requests[0].request_id.rsplit("-", 1)[0]
        loop = asyncio.get_running_loop()
        handle = RequestHandle(api_id, len(requests), loop, on_abort=lambda: self.aborted.append(api_id))
        task = loop.create_task(self._run(handle, requests))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return handle

    async def start(self) -> None:
        self.started = True

    async def drain(self, grace_s: float) -> None:
        self.state, self.drained_with = "draining", grace_s

    async def aclose(self) -> None:
        self.started = False

    def stats(self) -> EngineStats:
        return EngineStats(waiting=0, running=self.running, finished=0, failed=0, status=self.state)

    async def render_metrics(self) -> bytes:
        return self.metrics.render_with(self.stats())

    async def status(self) -> dict:
        """GET /v1/status's engine part, without requests or steps."""
        return {"status": self.state, "model": self.info.name, "running": self.running}

    async def _run(self, handle: RequestHandle, requests: list[ImageRequest]) -> None:
        self.running += 1
        try:
            await self._denoise(handle, requests)
            while self.hold and handle.request_id not in self.aborted:
                await asyncio.sleep(0.005)
            if handle.request_id not in self.aborted:
                self._finish(handle, requests)
        finally:
            self.running -= 1

    async def _denoise(self, handle: RequestHandle, requests: list[ImageRequest]) -> None:
        total = requests[0].num_inference_steps
        for step in range(1, total + 1):
            await asyncio.sleep(self.step_delay_s)
            for index, request in enumerate(requests):
                handle.push(ProgressEvent(index, step, total))
                partial = _partial_index(step, total, request.partial_images)
                if partial is not None:
                    preview = solid_image(request.width, request.height, request.output_format)
                    handle.push(PartialImageEvent(index, partial, preview))

    def _finish(self, handle: RequestHandle, requests: list[ImageRequest]) -> None:
        if self.fail_with is not None:
            handle.push(self.fail_with)
            return
        for index, r in enumerate(requests):
            handle.push(ImageEvent(index, solid_image(r.width, r.height, r.output_format, r.seed), r.seed))


def _partial_index(step: int, total: int, partial_images: int) -> int | None:
    """Which preview (0-based) falls on `step`, if any: previews are spread evenly over the steps."""
    for k in range(partial_images):
        if step == max(1, round((k + 1) * total / (partial_images + 1))):
            return k
    return None
