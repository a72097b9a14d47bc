"""One device's worker: a model runner, the denoising states whose latents it holds, and the
process groups of the aligned device blocks it belongs to.

A batch of degree k runs on the k workers of its block at once, each with the same full
states; Ulysses sequence parallelism (`gouache.parallel.ulysses`) shards the image tokens inside
the forward and every rank ends the step with identical latents and sampler state. So each
worker of a block holds a whole copy of its requests' states, and a request can run at another
degree next round on any block that receives its state (the hand-off).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from gouache.config import BlockCacheConfig, CompileConfig, ControlNetConfig, LoraConfig, TemplateConfig
from gouache.outputs import CacheBytes, StepOutput
from gouache.request import preview_steps
from gouache.runner.background import Recipe
from gouache.runner.compiled import CompiledDenoiser
from gouache.runner.model_runner import ModelRunner
from gouache.runner.quantize import quantize
from gouache.runner.sampler import DenoiseState
from gouache.sched.plan import Batch


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker process loads: the same model as the driver's, on its own device."""

    model: str
    dtype: str = "float32"
    device: str = "cpu"  # "cpu": every worker on the CPU (gloo); "cuda": each worker on its own GPU (NCCL)
    patch_pixels: int = 128
    torch_threads: int | None = None
    block_cache: BlockCacheConfig = field(default_factory=BlockCacheConfig)
    templates: TemplateConfig = field(default_factory=TemplateConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    controlnet: ControlNetConfig = field(default_factory=ControlNetConfig)
    quantize: str | None = None  # the denoiser's linear layers (`gouache.runner.quantize`)
    # compiled forwards, warmed up before the worker serves
    compile: CompileConfig = field(default_factory=CompileConfig)

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")


@dataclass
class RunOutput:
    """What one step of a batch did on its block (every rank returns the same)."""

    step: StepOutput
    # the latents of the stepped members the driver decodes after this step (finished, or at a
    # preview step): the others' stay on the block that computes them
    latents: dict[str, torch.Tensor] = field(default_factory=dict)
    steps: dict[str, int] = field(default_factory=dict)  # each stepped member's denoising steps done


def group_blocks(num_devices: int) -> list[tuple[int, ...]]:
    """Every aligned power-of-two block of two or more devices, smallest first: the process
    groups a pool of `num_devices` can need (2N - 1 blocks with the singletons)."""
    blocks, k = [], 2
    while k <= num_devices:
        blocks += [tuple(range(a, a + k)) for a in range(0, num_devices - k + 1, k)]
        k *= 2
    return blocks


def join_world(rank: int, world: int, init_method: str, spec: WorkerSpec, device: str,
               collective_timeout_s: float) -> Worker:
    """Join the executor's torch.distributed world (gloo on the CPU, NCCL on GPUs), make the
    process group of every aligned block (the same order on every rank) and load the model:
    what each worker of `multiproc` and `ray` does first."""
    from gouache.models.zoo import load_pipeline
    from gouache.runner.describe import model_info

    if spec.torch_threads:
        torch.set_num_threads(spec.torch_threads)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=collective_timeout_s)
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", init_method=init_method,
                            rank=rank, world_size=world, timeout=timeout)
    groups = {}
    for block in group_blocks(world):
        # A group does not inherit the world's timeout (torch's default is 30 min): without it a
        # worker waiting in a step's collective on a hung peer would wait that long, and be
        # taken for hung with it at the executor's reply deadline.
        group = dist.new_group(list(block), timeout=timeout)
        if rank in block:
            groups[block] = group
    templates = spec.templates.under(f"rank-{rank}")  # each device its own store: a shared one would mix their files
    recipe = Recipe("gouache.executor.worker:compiled_denoiser", replace(spec, device=device))
    runner = ModelRunner(quantize(load_pipeline(spec.model, spec.dtype, device), spec.quantize), spec.patch_pixels,
                         spec.block_cache, templates, spec.lora, controlnet=spec.controlnet, compile=spec.compile,
                         recipe=recipe)
    runner.warm_up(model_info(runner.pipe, spec.model).default_size,
                   ranks=[(len(block), block.index(rank)) for block in groups])
    return Worker(rank, runner, groups)


def compiled_denoiser(spec: WorkerSpec) -> CompiledDenoiser:
    """The compiled denoiser of a runner of `spec`, built again in the child process that compiles
    a server's new shapes into its cache (`gouache.runner.background`): the same model, dtype,
    device, quantization, patch size and adapter hooks; nothing that reads or writes the
    server's files (templates) or connects to its services (ControlNet)."""
    from gouache.models.zoo import load_pipeline

    if spec.torch_threads:
        torch.set_num_threads(spec.torch_threads)
    pipe = quantize(load_pipeline(spec.model, spec.dtype, spec.device), spec.quantize)
    return ModelRunner(pipe, spec.patch_pixels, lora=spec.lora, compile=spec.compile).family.compiled


class Worker:
    """Runs the batches of one device. `groups` maps each block of two or more devices this
    worker is in to its process group (all made at start, in one order on every rank)."""

    def __init__(self, rank: int, runner: ModelRunner, groups: dict[tuple[int, ...], object] | None = None):
        self.rank = rank
        self.runner = runner
        self.groups = groups or {}

    def ping(self) -> int:
        return self.rank

    def execute(self, batch: Batch, incoming: dict[str, DenoiseState]) -> RunOutput:
        """Take `incoming` states (new to this block or moved to it), then run one step of
        `batch` on its devices."""
        self.runner.states.update(incoming)
        group = self.groups.get(batch.devices) if batch.degree > 1 else None
        if batch.degree > 1 and group is None:
            raise ValueError(f"worker {self.rank} has no process group for devices {batch.devices}")
        step = self.runner.execute(batch, group)
        states = {rid: self.runner.states[rid] for rid in step.request_ids}
        wanted = {rid: s.latents for rid, s in states.items()
                  if s.done or s.step in preview_steps(len(s.timesteps), s.request.partial_images)}
        return RunOutput(step, wanted, {rid: s.step for rid, s in states.items()})

    def load_lora(self, name: str) -> dict:
        """Read an adapter into this device's host memory (POST /v1/loras); what it holds of it."""
        self.runner.lora_runtime.store.load(name).result()
        return self.runner.lora_runtime.store.describe(name)

    def load_controlnet(self, name: str) -> dict:
        """Load a ControlNet where this device runs them (POST /v1/controlnets)."""
        return self.runner.controls.load(name)

    def export(self, request_ids: list[str]) -> dict[str, DenoiseState]:
        """Hand these requests' states over (they leave this worker)."""
        self.runner.controls.collect()  # async ControlNet residuals in flight go with their states
        for rid in request_ids:  # its cached activations stay behind: the next worker starts afresh
            self.runner.release_caches(rid)
        return {rid: self.runner.states.pop(rid) for rid in request_ids if rid in self.runner.states}

    def park(self, request_ids: list[str]) -> dict[str, int]:
        """Move paused requests' states into this process's host memory; the bytes each holds there."""
        return {rid: self.runner.park(rid) for rid in request_ids}

    def release(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.runner.release(rid)

    def held(self) -> CacheBytes:
        """What this device's caches hold, released requests' entries freed (calls run between steps)."""
        return self.runner.held()
