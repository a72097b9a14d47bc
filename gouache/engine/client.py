"""The asyncio front of one engine: submit, stream events, abort. Used by the API server.

Threads: the engine loop (`core`), the prep and post stages; processes: image codecs.
Requests are tracked per image ("<api id>-<i>"); a `RequestHandle` gathers one API request's
n images. Every accepted image ends with an ImageEvent or its request's ErrorEvent.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, replace

import numpy as np

from gouache.config import EngineConfig
from gouache.controlnet.model import Base
from gouache.engine.adapters import AdapterCalls, start_control_service
from gouache.engine.codecs import CodecPool
from gouache.engine.core import EngineCore, PoolLost, StepReport
from gouache.engine.handle import RequestHandle
from gouache.engine.heap_trim import HeapTrimmer
from gouache.engine.imaging import DecodeError, decode_edit, decode_reference, encode_image
from gouache.engine.stages import Stage
from gouache.engine.status import StatusBook
from gouache.engine.video import encode_clip
from gouache.errors import (
    DeadlineUnattainableError,
    EngineStoppedError,
    GouacheError,
    InvalidRequestError,
    QueueFullError,
    RequestTimeoutError,
    ShuttingDownError,
    WorkerFailureError,
)
from gouache.executor.base import Executor
from gouache.executor.pool import DevicePool
from gouache.metrics import Metrics
from gouache.model_info import ModelInfo, unpriced_message
from gouache.outputs import EngineStats, ErrorEvent, ImageEvent, PartialImageEvent, PausedEvent, ProgressEvent
from gouache.request import ImageRequest, RequestStatus, preview_steps
from gouache.runner.background import Recipe
from gouache.runner.model_runner import ModelRunner
from gouache.sched.calibration import Calibrated
from gouache.sched.interface import Policy, StepTimePredictor
from gouache.sched.plan import Plan
from gouache.sched.scheduler import Scheduler
from gouache.sched.tiers import queue_limit, refusal
from gouache.techniques import unserved
from gouache.threads import step_threads
from gouache.uploads import Upload

log = logging.getLogger(__name__)


def caches_blocks(policy, num_devices: int) -> bool:
    """Whether some steps run on one device, where the block cache applies (sequence-parallel
    steps run uncached: ranks must not decide apart)."""
    return 1 in policy.degrees(num_devices)


@dataclass
class _Image:
    """One accepted image and where its events go."""

    request: ImageRequest
    handle: RequestHandle
    index: int  # which of the handle's n images
    status: RequestStatus = RequestStatus.PREPARING
    previews: int = 0  # partial images sent so far
    step: int = 0  # denoising steps done


class AsyncEngine(AdapterCalls):
    def __init__(self, pipe, info: ModelInfo, engine_config: EngineConfig, policy: Policy,
                 metrics: Metrics | None = None, predictor: StepTimePredictor | None = None,
                 executor: Executor | None = None, control_service=None, recipe: Recipe | None = None):
        """`policy` plans the steps (`make_policy`; `predictor` is its cost model, if it plans with
        one); `executor` runs them (default: `uniproc`, on `pipe` in this process); `pipe`
        itself prepares and decodes. A ControlNet service the config asks for and whose address
        it lacks is started here, and stopped with the engine. `recipe`: how a child process builds
        the compiled denoiser, to compile shapes first met while serving (`gouache.runner.background`)."""
        self.control_service = control_service
        # a cost model the engine corrects by its steps' measured times (`--calibrate-steps`)
        self.calibration = predictor if isinstance(predictor, Calibrated) else None
        if control_service is None:
            self.control_service, engine_config = start_control_service(lambda: Base.of(pipe), engine_config)
        self.config = engine_config
        self.metrics = metrics or Metrics()
        # prepares and decodes; under uniproc, also runs the steps (and holds the template store and
        # reads adapters as requests arrive; workers read theirs at a request's first step there)
        self.runner = ModelRunner(pipe, engine_config.patch_pixels, engine_config.block_cache, engine_config.templates,
                                  engine_config.lora, prefetch_loras=executor is None,
                                  controlnet=engine_config.controlnet,
                                  conditioning_bytes=engine_config.conditioning_bytes,
                                  compile=engine_config.compile if executor is None else None, recipe=recipe)
        count = self.metrics.handoffs.inc
        parked = engine_config.paused_host_bytes
        self.pool = (DevicePool(self.runner, executor, count, parked) if executor is not None
                     else DevicePool.in_process(self.runner, count, parked))
        try:
            self.scheduler = Scheduler(policy, self.pool.num_devices)
        except ValueError:
            self.pool.shutdown()
            raise
        parallel = None if caches_blocks(policy, self.pool.num_devices) else "this server's scheduling policy"
        info = replace(info, deadlines=policy.uses_deadlines, tier_slo_ms=policy.config.tier_slo_ms,
                       unserved=tuple(unserved(dict(info.unserved), parallel).items()),
                       max_batch=policy.config.max_batch_size,
                       parallel=any(degree > 1 for degree in policy.degrees(self.pool.num_devices)))
        priced = predictor.sizes(policy.mixes_resolutions) if policy.needs_predictor else None
        if priced is not None:  # the policy cannot plan a size its cost model never saw
            info = replace(info, sizes=tuple(sorted(priced)))
        self.info = info
        self.core = EngineCore(self.pool, self.scheduler, self.metrics, self._on_step, self._on_step_failure,
                               self._on_plan, self._on_death,
                               threads=step_threads(engine_config.torch_threads) if executor is None else None)
        # compiles before the server answers /health (workers: before their start), on the thread
        # that will step (`EngineCore.call`)
        try:
            self.core.call(lambda: self.runner.warm_up(info.default_size))
        except BaseException:
            self.core.stop()
            self.pool.shutdown()
            raise
        self.prep = Stage("gouache-prep", self._prepare, self._on_stage_failure)
        self.post = Stage("gouache-post", self._postprocess, self._on_stage_failure, batched=True)
        self.codecs = CodecPool(engine_config.image_workers)
        self.heap = HeapTrimmer()
        self.book = StatusBook()
        self._images: dict[str, _Image] = {}  # in-flight images by id; guarded by _lock
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._counts = {"finished": 0, "failed": 0, "videos": 0, "frames": 0}
        self._draining = False  # set by drain(): nothing new is admitted
        self._dead = False  # set when the engine loop died
        self.died: asyncio.Event | None = None  # set (on the API's loop) if the engine loop dies

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.died = asyncio.Event()
        for part in (self.core, self.prep, self.post):
            part.start()
        # start the codec processes now, not on the first request
        await asyncio.wrap_future(self.codecs.submit(encode_image, np.zeros((8, 8, 3), np.uint8), "png"))

    async def drain(self, grace_s: float) -> None:
        """Admit nothing more; give what is in flight `grace_s` seconds to finish; fail the rest."""
        self._draining = True
        deadline = self._loop.time() + grace_s
        while self._images and self.core.running and self._loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self._images:
            log.warning("cancelling %d images still in flight after %g s of grace", len(self._images), grace_s)
        self._fail_all(ShuttingDownError(f"the server shut down before this request finished ({grace_s:g} s grace)"))

    async def aclose(self) -> None:
        """Fail what is still in flight, stop the threads, wait for the codec processes to exit."""
        self._draining = True
        self._fail_all(EngineStoppedError("the server is shutting down"))
        self.core.stop()
        self.prep.stop()
        self.post.stop()
        self.pool.shutdown()
        self.runner.close()
        if self.control_service is not None:
            self.control_service.shutdown()
        await self._loop.run_in_executor(None, self.codecs.shutdown)

    # -- the API's calls -------------------------------------------------------------------

    async def submit(self, requests: list[ImageRequest]) -> RequestHandle:
        """Accept the n images of one API request, or raise a GouacheError."""
        if self._draining:
            raise ShuttingDownError("the server is shutting down; retry on another replica or after its restart")
        if self._loop is None or not self.core.running:
            raise EngineStoppedError("the engine is not running")
        for request in requests:
            self._check_size(request)
        self._check_capacity(requests)
        controls = await self.check_adapters(requests[0])
        decoded = await self._decode_upload(requests[0]) if requests[0].is_edit else None
        api_id = requests[0].api_id
        handle = RequestHandle(api_id, len(requests), self._loop, lambda: self._cancel(api_id))
        with self._lock:
            if self._dead:  # it died during the awaits above: `_on_death` would not see these
                raise EngineStoppedError("the engine is not running")
            self._check_capacity(requests)  # again: others may have got in during the decode
            for index, request in enumerate(requests):
                self._images[request.request_id] = _Image(request, handle, index)
        for request in requests:
            self.prep.put(request, decoded, controls)
        self._loop.call_later(self.config.request_timeout_s, self._expire, api_id)
        return handle

    def abort(self, api_id: str) -> bool:
        """Cancel an API request by id; False if it is not in flight."""
        return self._cancel(api_id)

    def stats(self) -> EngineStats:
        with self._lock:
            statuses = [image.status for image in self._images.values()]
        waiting = sum(s in (RequestStatus.PREPARING, RequestStatus.WAITING, RequestStatus.PAUSED) for s in statuses)
        running = sum(s == RequestStatus.RUNNING for s in statuses)
        status = "dead" if self._dead else "draining" if self._draining else "ok"
        return EngineStats(waiting, running, self._counts["finished"], self._counts["failed"], status)

    async def status(self) -> dict:
        """GET /v1/status: the queue, each request's size and step, the recent steps."""
        stats = self.stats()
        with self._lock:
            requests = [{"id": rid, "size": f"{e.request.width}x{e.request.height}", "status": e.status.value,
                         "step": e.step, "steps": e.request.num_inference_steps, "service_tier": e.request.tier.label,
                         "tenant": e.request.tenant, **({"frames": e.request.num_frames} if self.info.clips else {})}
                        for rid, e in self._images.items()]
        clips = {"finished_videos": self._counts["videos"], "finished_frames": self._counts["frames"]}
        return {"status": stats.status, "model": self.info.name, "waiting": stats.waiting, "running": stats.running,
                "finished": stats.finished, "failed": stats.failed, **(clips if self.info.clips else {}),
                "requests": requests, **self.book.snapshot()}

    async def render_metrics(self) -> bytes:
        return self.metrics.render_with(self.stats())

    # -- preparation -----------------------------------------------------------------------

    def _check_capacity(self, requests: list[ImageRequest]) -> None:
        """429 past the queue's limit, counting the images of the request's service tier and
        the higher ones (`tiers.queue_limit`: flex, capacity nobody else needs, is refused
        first; a lower tier's queue never keeps a higher tier out), or past its tenant's share
        of its tier's places while other tenants have requests of the tier (`tiers.tenant_limit`)."""
        first = requests[0]
        tier, limit = first.tier.label, queue_limit(first.tier.label, self.config.max_queue_len,
                                                      self.config.tier_queue_share)
        in_flight = ((i.request.tier, i.request.tenant, i.request.tenant_weight) for i in self._images.values())
        refused = refusal(first.tier, first.tenant, first.tenant_weight, len(requests), in_flight, limit)
        if refused is None:
            return
        if refused.tenant_share:
            message = (f"tenant {first.tenant!r} holds its share of the {tier} queue ({refused.held} of "
                       f"{refused.limit} images) while {refused.others} other tenants have requests in it")
        else:
            which = f"{tier} requests' limit" if limit < self.config.max_queue_len else "limit"
            message = f"the server is busy ({refused.held} images of tier {tier} or higher in flight, {which} {limit})"
        raise QueueFullError(f"{message}; retry shortly", retry_after_s=max(1, refused.held // 4))

    def _check_size(self, request: ImageRequest) -> None:
        if self.info.sizes is not None and request.shape not in self.info.sizes:
            raise InvalidRequestError(unpriced_message(self.info.sizes, request.shape), "size")

    async def _decode_upload(self, request: ImageRequest) -> Upload:
        """An edit's uploads, or a clip's first frame, decoded in a codec process."""
        decode = decode_reference if self.info.clips is not None else decode_edit
        result = await asyncio.wrap_future(self.codecs.submit(
            decode, request, self.config.max_upload_pixels, self.info.size_step))
        if isinstance(result, DecodeError):
            raise InvalidRequestError(result.message, param=result.param)
        return result

    def _prepare(self, request: ImageRequest, upload: Upload | None, controls: list[np.ndarray]) -> None:
        if request.request_id not in self._images:  # aborted before preparation
            return
        if upload is not None and request.register_template:  # the template's own activations
            upload = upload.for_template()
        elif upload is not None and upload.repaints_nothing:  # the answer is the original, no model run
            self._deliver_unchanged(request, upload.image)
            return
        state = self.runner.prepare(request, upload, controls)
        self.runner.conditioning.take_report().record(self.metrics)
        with self._lock:  # under the lock, so that an abort reaches the engine's inbox after the add
            entry = self._images.get(request.request_id)
            if entry is not None:
                entry.status = RequestStatus.WAITING
                self.core.add(state)
        if entry is None:
            self.pool.release(request.request_id)

    def _deliver_unchanged(self, request: ImageRequest, image: np.ndarray) -> None:
        """An edit whose mask repaints nothing: its image is the original, as a full run would return it."""
        entry = self._images.get(request.request_id)
        if entry is None:
            return
        entry.status = RequestStatus.POSTPROCESSING
        future = self.codecs.submit(encode_image, image, request.output_format, request.output_compression)
        future.add_done_callback(lambda f: self._deliver("final", request.request_id, f))

    # -- the engine loop's callbacks (engine thread) ---------------------------------------

    def _on_step(self, report: StepReport) -> None:
        now = time.monotonic()
        finished = {s.request_id for s in report.finished}
        for rid in report.output.request_ids:
            entry, state = self._images.get(rid), report.states[rid]
            if entry is None:  # aborted while it was being added
                if rid in finished:
                    self.pool.release(rid)
                continue
            if entry.status is RequestStatus.WAITING:
                self.metrics.queueing_time.observe(now - entry.request.arrival_time)
            entry.status = RequestStatus.RUNNING  # also a paused one that resumed
            entry.step = state.steps_done
            entry.handle.push(ProgressEvent(entry.index, state.steps_done, state.num_steps))
            if rid in finished:
                entry.status = RequestStatus.POSTPROCESSING
                self.post.put("final", rid, None)
            elif state.steps_done in preview_steps(state.num_steps, entry.request.partial_images):
                self.post.put("preview", rid, self.runner.states[rid].latents)
        self.metrics.running_batch.set(len(self.scheduler.running))
        if self.calibration is not None:
            batch = report.batch
            stepped = [report.states[rid].resolution for rid in batch.request_ids]
            self.calibration.observe(stepped, batch.patched, batch.degree, report.step_s)
            self.metrics.step_time_scale.set(self.calibration.scale)
        self.book.step(report.batch.devices, report.output.request_ids, report.step_s, report.output.forward_s)

    def _on_plan(self, plan: Plan) -> None:
        """Requests a plan dropped (deadline unattainable) fail; those it paused say so."""
        for rid in plan.drop:
            entry = self._images.get(rid)
            if entry is not None:
                slo = entry.request.slo_ms
                message = f"the request cannot finish within its slo_ms={slo:g} even if started now; it was dropped"
                self._fail(entry.handle.request_id, DeadlineUnattainableError(message))
        for rid in plan.pause:
            entry, state = self._images.get(rid), self.scheduler.waiting.get(rid)
            if entry is not None and state is not None:
                entry.status = RequestStatus.PAUSED
                entry.handle.push(PausedEvent(entry.index, state.steps_done, state.num_steps))
                self.metrics.pauses.labels(entry.request.tier.label).inc()

    def _on_step_failure(self, reasons: dict[str, str], invalid: dict[str, str]) -> None:
        """Requests whose step failed: a 400 naming the field where their own input failed them
        (an adapter file caught half-written), else the server's failure (500)."""
        for rid, why in reasons.items():
            entry = self._images.get(rid)
            if entry is None:
                continue
            error = (InvalidRequestError(why, invalid[rid]) if rid in invalid
                     else WorkerFailureError(f"denoising failed: {why}"))
            self._fail(entry.handle.request_id, error)

    def _on_death(self, error: BaseException) -> None:
        self._dead = True
        why = str(error) if isinstance(error, PoolLost) else f"{type(error).__name__}: {error}"  # else a bug's
        self._fail_all(EngineStoppedError(f"the engine stopped ({why}); the server exits"))
        self._loop.call_soon_threadsafe(self.died.set)

    # -- post-processing -------------------------------------------------------------------

    def _postprocess(self, jobs: list[tuple[str, str, object]]) -> None:
        """Decode the images of (kind, request id, latents) jobs, final or preview, together (one
        VAE call per latent shape), and hand each to the codecs."""
        # A preview's request may still be running: only the engine thread releases its state.
        # A final's request has left the scheduler: its state is this stage's to release.
        entries = [self._images.get(rid) for _, rid, _ in jobs]
        wanted = [(rid, latents) for (_, rid, latents), entry in zip(jobs, entries) if entry is not None]
        decoded = iter(self.runner.decode_many(wanted))
        for (kind, rid, _), entry in zip(jobs, entries):
            pixels = next(decoded) if entry is not None else None
            if kind == "final":
                self.pool.release(rid)
                self.heap.maybe_trim()
            if pixels is None:  # aborted meanwhile
                continue
            request = entry.request
            if pixels.ndim == 4 and kind == "final":
                future = self.codecs.submit(encode_clip, pixels, request.fps)
            else:  # an image, or a clip's preview: its first frame
                future = self.codecs.submit(encode_image, pixels if pixels.ndim == 3 else pixels[0],
                                            request.output_format, request.output_compression)
            future.add_done_callback(lambda f, kind=kind, rid=rid: self._deliver(kind, rid, f))

    def _deliver(self, kind: str, rid: str, future: Future) -> None:
        entry = self._images.get(rid)
        if entry is None:
            return
        if future.cancelled() or future.exception() is not None:
            self._fail(entry.handle.request_id, WorkerFailureError(f"image encoding failed: {future.exception()}"))
            return
        if kind == "preview":
            entry.handle.push(PartialImageEvent(entry.index, entry.previews, future.result()))
            entry.previews += 1
            return
        with self._lock:
            self._images.pop(rid, None)
            last = not any(other.handle is entry.handle for other in self._images.values())
        self._counts["finished"] += 1
        self.book.finished(request_done=last)
        frames = entry.request.num_frames
        if self.info.clips is None:
            self.metrics.images.inc()
        else:
            self._counts["videos"] += 1
            self._counts["frames"] += frames
            self.metrics.videos.inc()
            self.metrics.video_frames.inc(frames)
        result = future.result()
        image, thumbnail = result if isinstance(result, tuple) else (result, b"")  # a clip: (MP4, thumbnail)
        entry.handle.push(ImageEvent(entry.index, image, entry.request.seed, thumbnail))

    def _on_stage_failure(self, job: tuple, error: Exception) -> None:
        preparing = isinstance(job[0], ImageRequest)
        rid = job[0].request_id if preparing else job[1]
        if preparing or job[0] == "final":  # not in the scheduler: no step can be using its state
            self.pool.release(rid)
        entry = self._images.get(rid)
        if entry is not None:
            self._fail(entry.handle.request_id, WorkerFailureError(f"{type(error).__name__}: {error}"))

    # -- ending requests early -------------------------------------------------------------

    def _remove(self, api_id: str) -> list[_Image]:
        with self._lock:
            gone = [rid for rid, e in self._images.items() if e.handle.request_id == api_id]
            entries = [self._images.pop(rid) for rid in gone]
        for entry in entries:
            self.core.abort(entry.request.request_id)
        return entries

    def _cancel(self, api_id: str) -> bool:
        return bool(self._remove(api_id))

    def _fail(self, api_id: str, error: GouacheError) -> None:
        entries = self._remove(api_id)
        if entries:  # the API counts the error in the metrics when it answers
            self._counts["failed"] += len(entries)
            entries[0].handle.push(ErrorEvent(error.kind, error.message, error.status))

    def _fail_all(self, error: GouacheError) -> None:
        with self._lock:
            api_ids = {image.handle.request_id for image in self._images.values()}
        for api_id in api_ids:
            self._fail(api_id, error)

    def _expire(self, api_id: str) -> None:
        timeout = self.config.request_timeout_s
        self._fail(api_id, RequestTimeoutError(f"the request did not finish within {timeout:g} s"))
