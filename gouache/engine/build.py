"""An engine from the server's configs: the cost model read and checked, the flags that the
policy would ignore refused, the model loaded, and the workers (or actors) and the ControlNet
service started, before anything is served."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING

from gouache.config import COMPILE_BUCKETS, CompileConfig, EngineConfig, ModelConfig, SchedulerConfig
from gouache.controlnet.model import Base
from gouache.engine.adapters import start_control_service
from gouache.engine.client import AsyncEngine, caches_blocks
from gouache.executor.base import Executor
from gouache.runner.background import Recipe
from gouache.sched.calibration import Calibrated
from gouache.sched.policies import POLICIES, make_policy
from gouache.sched.scheduler import check_devices
from gouache.techniques import refused_flag

if TYPE_CHECKING:
    from gouache.executor.worker import WorkerSpec

log = logging.getLogger(__name__)


def refuse(why: str | None) -> None:
    """Refuse the start (ValueError) with `why`, if there is one."""
    if why is not None:
        raise ValueError(why)


def build_engine(model_config: ModelConfig, engine_config: EngineConfig, sched_config: SchedulerConfig) -> AsyncEngine:
    """The engine of a server: the model loaded, checked against the flags, measured (the batch
    probe) and compiled (the warm-up). In one process (`uniproc`) that is done in a thread of its
    own on the step thread's torch threads, so that the main thread keeps no OpenMP team
    (`gouache.threads`: a second team on the machine's CPUs slowed every step 2-3x)."""
    if engine_config.executor != "uniproc":
        return _build(model_config, engine_config, sched_config)
    from gouache.threads import in_thread, step_threads

    return in_thread(lambda: _build(model_config, engine_config, sched_config),
                     step_threads(engine_config.torch_threads), "gouache-start")


def _build(model_config: ModelConfig, engine_config: EngineConfig, sched_config: SchedulerConfig) -> AsyncEngine:
    import torch

    from gouache.block_cache.predictor import reuse_pass
    from gouache.models.zoo import load_pipeline, model_id
    from gouache.runner.batch_probe import probe_max_batch
    from gouache.runner.describe import UNCOMPILED, UNSERVED, model_info
    from gouache.runner.families import family_class
    from gouache.runner.model_runner import ModelRunner
    from gouache.runner.quantize import quantize
    from gouache.sched.costmodel import BatchCostModel, load_mask_model
    from gouache.sched.costmodel import load as load_cost_model
    from gouache.sched.parallel_costmodel import ParallelCostModel

    if engine_config.torch_threads:
        torch.set_num_threads(engine_config.torch_threads)
    predictor = load_cost_model(sched_config.cost_model) if sched_config.cost_model else None
    if predictor is not None and not isinstance(predictor, BatchCostModel | ParallelCostModel):
        raise ValueError(f"{sched_config.cost_model} is a {predictor.kind!r} cost model; --cost-model takes "
                         "the step-cost model of `gouache profile` (kind 'batch') or a T(resolution, k) one "
                         "(kind 'parallel')")
    if predictor is not None and sched_config.calibrate_steps:
        predictor = Calibrated(predictor)
    check_devices(POLICIES[sched_config.policy], engine_config.devices)  # before any worker starts
    if engine_config.compile.cuda_graphs and not model_config.device.startswith("cuda"):
        raise ValueError(f"--compile-cuda-graphs needs a CUDA device; --device is {model_config.device}")
    # the cap does not change what the checks below read; with --max-batch-size auto it is measured once the model loads
    policy = make_policy(replace(sched_config, max_batch_size=sched_config.max_batch_size or 1), predictor)
    parallel = None if caches_blocks(policy, engine_config.devices) else f"--policy {sched_config.policy}"
    templates = engine_config.templates
    flags = {"--block-cache": engine_config.block_cache.threshold > 0,
             "--block-cache-predictor": bool(engine_config.block_cache.predictor),
             "--template-cache": templates.default, "--template-cost-model": bool(templates.cost_model),
             "--lora-bound": engine_config.lora.bound > 0}
    refuse(refused_flag(flags, "", {}, parallel))  # the policy's refusals, before the model loads
    pipe = quantize(load_pipeline(model_config.model, model_config.dtype, model_config.device), model_config.quantize)
    family = family_class(pipe)
    refuse(refused_flag(flags, family.name, UNSERVED.get(family.name, {})))
    if engine_config.compile.enabled and family.name in UNCOMPILED:
        raise ValueError(f"--compile is not served for {family.name} models: {UNCOMPILED[family.name]}")
    if engine_config.compile.graphs is not None:
        refuse(family.unused_graphs(engine_config.compile))
    if engine_config.patch_pixels is not None and not family.patches:
        raise ValueError(f"--patch-size would be ignored: {family.name} models take mixed sizes by packing their "
                         "tokens into one sequence; patches are for UNet models")
    if engine_config.block_cache.predictor:  # a wrong file is refused now, not in each worker
        reuse_pass(engine_config.block_cache, pipe)
    if templates.cost_model:
        load_mask_model(templates.cost_model)  # a wrong file is refused now, not at the first edit
    info = model_info(pipe, model_id(model_config.model))
    for height, width, *frames in engine_config.compile.sizes:
        why = None
        if frames:
            why = "a clip's size, for a video model" if info.clips is None else info.clips.refusal(frames[0])
        if why:
            raise ValueError(f"--compile-sizes {width}x{height}x{frames[0]}: {why}")
    if sched_config.max_batch_size is None:
        probe = probe_max_batch(ModelRunner(pipe, engine_config.patch_pixels), (info.default_size, info.default_size),
                                info.default_guidance)
        log.info("%s, measured on %s at %d px", probe.describe(), model_config.device, info.default_size)
        sched_config = replace(sched_config, max_batch_size=probe.max_batch)
    engine_config = replace(engine_config, compile=cover(engine_config.compile, sched_config.max_batch_size,
                                                         2 if info.uses_cfg else 1))
    policy = make_policy(sched_config, predictor)
    if engine_config.executor == "uniproc":
        recipe = Recipe("gouache.executor.worker:compiled_denoiser", worker_spec(model_config, engine_config))
        return AsyncEngine(pipe, info, engine_config, policy, predictor=predictor, recipe=recipe)
    from gouache.parallel.ulysses import check_degree

    for degree in policy.degrees(engine_config.devices):
        check_degree(pipe, degree)  # refused now, not in the middle of a request
    service, engine_config = start_control_service(lambda: Base.of(pipe), engine_config)  # its workers connect to it
    try:
        executor = make_executor(model_config, engine_config)
    except BaseException:
        if service is not None:
            service.shutdown()
        raise
    return AsyncEngine(pipe, info, engine_config, policy, predictor=predictor, executor=executor,
                       control_service=service)


def make_executor(model_config: ModelConfig, engine_config: EngineConfig) -> Executor:
    """The worker processes (`multiproc`) or actors (`ray`) of `engine_config.devices` devices."""
    spec = worker_spec(model_config, engine_config)
    if engine_config.executor == "ray":
        from gouache.executor.ray_executor import RayExecutor

        return RayExecutor(spec, engine_config.devices, engine_config.ray_address, engine_config.ray_placement,
                           engine_config.ray_resource, reply_deadline_s=engine_config.worker_timeout_s)
    from gouache.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(spec, engine_config.devices, reply_deadline_s=engine_config.worker_timeout_s)


def worker_spec(model_config: ModelConfig, engine_config: EngineConfig) -> WorkerSpec:
    """What a process loads to run the server's model as the server does."""
    from gouache.executor.worker import WorkerSpec

    return WorkerSpec(model_config.model, model_config.dtype, model_config.device, engine_config.patch_pixels,
                      engine_config.torch_threads, engine_config.block_cache, engine_config.templates,
                      engine_config.lora, engine_config.controlnet, model_config.quantize, engine_config.compile)


def cover(config: CompileConfig, max_batch: int, rows: int) -> CompileConfig:
    """The default compile buckets, doubled on up to the rows of the server's largest batch (its
    requests' CFG rows included), so that a full batch runs compiled; buckets the operator gave
    are theirs."""
    if not config.enabled or config.buckets != COMPILE_BUCKETS:
        return config
    buckets = list(config.buckets)
    while buckets[-1] < max_batch * rows:
        buckets.append(2 * buckets[-1])
    return replace(config, buckets=tuple(buckets))
