"""Holds the denoising states of running requests and executes step plans on the model."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch

from gouache.adapter_names import ControlNetError, ControlNetUnavailable, LoraError
from gouache.block_cache.layer import BlockCacheLayer
from gouache.block_cache.predictor import reuse_pass
from gouache.block_cache.store import BlockCache, BlockCacheConfig
from gouache.config import CompileConfig, ControlNetConfig, LoraConfig, TemplateConfig
from gouache.controlnet.layer import ControlNetLayer
from gouache.controlnet.runtime import ControlRuntime
from gouache.forward_layers import Step
from gouache.lora.layer import LoraLayer
from gouache.lora.runtime import LoraRuntime
from gouache.models.digest import model_digest
from gouache.outputs import CacheBytes, LoraReport, StepOutput
from gouache.parallel.layer import ParallelLayer
from gouache.request import ImageRequest, RequestState
from gouache.runner.background import BackgroundCompiler, Recipe
from gouache.runner.compiled import CompiledDenoiser
from gouache.runner.conditioning import ConditioningCache
from gouache.runner.describe import instruction_edits
from gouache.runner.families import Family, make_family
from gouache.runner.forward import Forward, LayoutLayer, prepared_techniques
from gouache.runner.pieces import graphs_left
from gouache.runner.quantize import quantized
from gouache.runner.sampler import DenoiseState, Parked
from gouache.sched.plan import Batch
from gouache.techniques import applies
from gouache.templates.layer import TemplateLayer
from gouache.templates.replay import (
    TemplateCache,
    TemplateUse,
    content_id,
    template_key,
    text_digest,
)
from gouache.uploads import Upload

log = logging.getLogger(__name__)


class ModelRunner:
    """One model on one device. `prepare` and `decode` are called from the stage threads,
    `execute` from the engine thread; the only shared structure is `states`. An entry is added
    before the scheduler learns of its request, and removed only where no step can be using it:
    by the engine thread between steps, or by a stage once the request left the scheduler."""

    def __init__(self, pipe, patch_pixels: int | None = None, block_cache: BlockCacheConfig | None = None,
                 templates: TemplateConfig | None = None, lora: LoraConfig | None = None, prefetch_loras: bool = True,
                 controlnet: ControlNetConfig | None = None, conditioning_bytes: int = 0,
                 compile: CompileConfig | None = None, recipe: Recipe | None = None):
        """`recipe`: how a child process builds this runner's compiled denoiser, to compile shapes
        first met while serving off the serving path (`gouache.runner.background`; None, or
        `CompileConfig.background` off: they compile in their step)."""
        self.pipe = pipe
        self.conditioning = ConditioningCache(conditioning_bytes)  # prompts' and uploads' encodings, for repeats
        self.family: Family = make_family(pipe, patch_pixels, self.conditioning)
        self.compile_config = compile or CompileConfig()
        if self.compile_config.enabled:
            compiled = CompiledDenoiser(self.family.denoiser, self.compile_config, self.family.device,
                                        adapters=bool(lora and lora.directory))
            if recipe is not None and self.compile_config.background:
                compiled.background = BackgroundCompiler(recipe, compiled.cache)
            self.family.compile(compiled, self.compile_config)
        self.states: dict[str, DenoiseState | Parked] = {}  # Parked: a paused request moved to host memory
        # holds nothing until a request asks for reuse
        self.cache = BlockCache(block_cache, reuse_pass(block_cache, pipe))
        self.template_config = templates or TemplateConfig()
        self._model = model_digest(pipe) if self.template_config.directory else ""  # before a LoRA merges
        self._templates: TemplateCache | None = None  # made at the first edit that uses one, or now with a directory
        self.lora_runtime = LoraRuntime(lora or LoraConfig(), pipe, self.family.denoiser,
                                 merges=quantized(self.family.denoiser) is None)
        self.prefetch_loras = prefetch_loras  # start reading a request's adapters when it is prepared (it runs here)
        self.controls = ControlRuntime(controlnet or ControlNetConfig(), pipe)
        if self.family.compiled is not None:
            self.controls.compile(self.family.compiled.controlnet)
        if self.template_config.directory:  # claimed (and an earlier run's files adopted) before serving
            _ = self.templates

    @property
    def templates(self) -> TemplateCache:
        if self._templates is None:
            self._templates = TemplateCache(self.template_config, self.family.device, self._model)
        return self._templates

    def held(self) -> CacheBytes:
        """Free what released requests hold in the block cache (between steps) and say what every
        cache holds."""
        self.cache.settle()
        templates = self._templates.store.held() if self._templates is not None else {}
        return CacheBytes(self.cache.nbytes, self.lora_runtime.store.nbytes, templates)

    def close(self) -> None:
        """Let go of what outlives a forward: the ControlNet service's connections, the template
        directory, a background compile."""
        self.controls.close()
        if self.family.compiled is not None:
            self.family.compiled.close()
        if self._templates is not None:
            self._templates.store.close()

    def prepare(self, request: ImageRequest, upload: Upload | None = None,
                controls: list[np.ndarray] = ()) -> RequestState:
        """Text encoding and initial latents; returns the scheduler's view of the request.
        `upload`: an edit's decoded uploads; `controls`: the decoded conditioning image of each
        of its ControlNets."""
        loras = self.lora_runtime.use(request.loras)
        state = self.family.prepare(request, upload, self.lora_runtime.text_adapters(loras))
        state.control = self.controls.use(tuple((name, scale) for name, _, scale in request.controlnets),
                                          list(controls), request.controlnet_mode, self.family.device,
                                          self.family.dtype)
        # a server default applies only where it composes with what the request uses (`gouache.techniques`)
        used = set(prepared_techniques(state) | ControlNetLayer.used_by(state))
        if request.block_cache:
            used.add("block_cache")
        uses_template = self.uses_template(request) and state.edit is not None and applies("template", used)
        if uses_template:
            used.add("template")
        if request.block_cache is None and not applies("block_cache", used):
            state.request = replace(request, block_cache=0.0)
        # a template records or replays with its adapters: they load before its first step
        state.lora = replace(loras, bound=0) if loras is not None and uses_template else loras
        if state.lora is not None and self.prefetch_loras:
            self.lora_runtime.start(request.request_id, state.lora)  # read while it waits and its first steps run
        if uses_template:
            content = content_id(upload.image)
            key = template_key(request.template_id or content, content, request.height, request.width,
                               len(state.timesteps), state.rows, self.lora_runtime.key(loras))
            state.template = TemplateUse(key, self.family.token_mask(state), text_digest(state.cond, state.rows),
                                         request.register_template)
        self.states[request.request_id] = state
        return RequestState.of(request, len(state.timesteps))

    def warm_up(self, default_size: int, ranks: Sequence[tuple[int, int]] = ()) -> None:
        """Compile the forwards of the sizes the server expects (--compile-sizes, else the model's
        default size) at every bucket, before serving; with `ranks`, (degree, rank) of each group
        of devices this process is in, those of its Ulysses shards too."""
        compiled = self.family.compiled
        if compiled is None:
            return
        sizes = self.compile_config.sizes or ((default_size, default_size),)
        states = [self.family.prepare(ImageRequest(f"warm-up-{w}x{h}", "warm-up", w, h, 2, 5.0, seed=0,
                                                   num_frames=frames[0] if frames else 1))
                  for h, w, *frames in sizes]
        forwards = [self.family.forward_inputs([state]) for state in states]
        edits = []  # a forward with references is a row graph per size and reference layout (the
        if instruction_edits(self.pipe):  # references' tokens after the image's): an edit of each size
            edits = [self.family.forward_inputs([self.family.prepare(
                ImageRequest(f"warm-up-edit-{w}x{h}", "warm-up", w, h, 2, 5.0, seed=0, image=b"-"),
                Upload(np.zeros((h, w, 3), np.uint8)))]) for (h, w, *_), state in zip(sizes, states)
                if "reference" not in state.cond]  # (Qwen-Image-Edit's warm-up requests are edits already)
        graphs = compiled.row_graphs(forwards + edits)
        pieces = self.family.pieces
        if pieces is not None:
            text_len = states[0].cond["prompt_embeds"].shape[1]
            graphs += pieces.graphs(text_len)
            if ranks and "parallel" in compiled.holds:
                graphs += pieces.shard_graphs([self.family.token_layout(s) for s in states], text_len, states[0].rows,
                                              ranks)
        # forwards slow to compile that the load is likely to meet, within --compile-graphs: left to
        # the background child (after `/health`); without one, those a request's technique makes
        # (ControlNet residuals, template replays) compile when first met, and the others (a
        # ControlNet's own graphs, which the child does not build; patched forwards) with the warm-up
        control = compiled.row_graphs([({**rows, **self.controls.zeros(rows["sample"])}, shared)
                                       for rows, shared in forwards]) if self.controls.served else []
        first = self.controls.first()
        control += compiled.controlnet_graphs(first, forwards) if first is not None else []
        replays = self.family.replay_graphs(states)
        if compiled.background is None:
            replays, control = [], [graph for graph in control if graph.forward is None]
        patched = self.family.patched_graphs(states)
        later = (control + replays + patched)[:max(0, graphs_left(compiled, self.compile_config))]
        log.info("warm-up: %d graphs (%s)%s", len(graphs), (pieces.buckets.describe() if pieces is not None else "")
                 or "rows only",
                 f", then {len(later)} of forwards with ControlNet residuals ({len(control)}), template replays "
                 f"({len(replays)}) and patched forwards of mixed sizes ({len(patched)})" if later else "")
        compiled.warm_up(graphs, lambda line: log.info("warm-up: %s", line), later=later)

    def uses_template(self, request: ImageRequest) -> bool:
        """Whether the edit reuses a template: a registration does; an edit as it says (the API
        sets `template_cache` when a request names its template), else by the server's default."""
        if request.register_template:
            return True
        return self.template_config.default if request.template_cache is None else request.template_cache

    def execute(self, batch: Batch, group=None) -> StepOutput:
        """One denoising step of the batch: one forward composed of the techniques its requests
        use (`forward`), then each member's sampler step. A batch of degree > 1 runs on the
        devices of `group` (a worker's process group), each rank with the same states; the block
        cache and templates run at degree 1 only (ranks must not decide apart).

        One request's error fails that request only: a forward that raises is retried one
        request at a time, and each request's sampler step is its own.
        """
        start = time.perf_counter()
        self.controls.collect()  # the service's async residuals of the last step, computed meanwhile
        for rid in batch.request_ids:  # a paused request parked in host memory comes back to its device
            if isinstance(self.states.get(rid), Parked):
                self.states[rid] = self.states[rid].restore()
        stepped: list[str] = []
        failed: dict[str, str] = {rid: "its denoising state is gone"
                                  for rid in batch.request_ids if rid not in self.states}
        present = [rid for rid in batch.request_ids if rid not in failed]
        states = [self.states[rid] for rid in present]
        lora, invalid = LoraReport(), {}
        adapters = self.lora_runtime.arrived(states, batch.degree > 1, failed, lora)
        invalid.update((rid, "loras") for rid in present if rid in failed)  # an adapter that did not load
        forward = self.forward(batch, states, adapters, lora, group)
        forward.check(Step(states, batch.patched))
        present = [rid for rid in present if rid in adapters]
        for rid, prediction in self._predict(forward, Step([self.states[rid] for rid in present], batch.patched),
                                             (failed, invalid)):
            try:
                self.family.advance(self.states[rid], prediction)
            except Exception as error:
                log.exception("sampler step of %s failed", rid)
                failed[rid] = f"{type(error).__name__}: {error}"
            else:
                stepped.append(rid)
        self.cache.settle()
        output = StepOutput(request_ids=stepped, forward_s=time.perf_counter() - start, failed=failed, invalid=invalid,
                            collective_s=forward.layer("parallel").collective_s,
                            block_cache=self.cache.take_report(), lora=self.lora_runtime.take_report(lora),
                            controlnet=self.controls.take_report())
        if self.family.compiled is not None:
            output.compile = self.family.compiled.take_report()
        templates = forward.layer("template").templates
        if templates is not None:
            output.templates = templates.take_report()
        return output

    def forward(self, batch: Batch, states: list[DenoiseState], adapters: dict, lora: LoraReport, group) -> Forward:
        """The forward of a step of `batch` over `states`, its layers in `ORDER`: `adapters`, each
        request's that arrived (and `lora`, the step's report); `group`: the devices of a step
        of degree > 1. The block cache and templates run at degree 1 only (ranks must not
        decide apart)."""
        whole = batch.degree == 1  # the step runs on this device alone
        templates = self.templates if whole and any(s.template for s in states) else None
        compiled = self.family.compiled
        return Forward((
            ParallelLayer(self.pipe, batch.degree, group, self.family.device, compiled),
            LoraLayer(self.lora_runtime, adapters, lora, compiled.slots if compiled is not None else None),
            ControlNetLayer(self.controls, self.family),
            TemplateLayer(templates, self.family),
            BlockCacheLayer(self.cache if whole else None),
            LayoutLayer(self.family),
        ), compiled)

    def _predict(self, forward: Forward, step: Step, failures: tuple[dict[str, str], dict[str, str]]
                 ) -> list[tuple[str, torch.Tensor]]:
        """(id, prediction) of each state of `step` by `forward`; if it raises, of each request
        alone, and the requests that fail alone go to `failures` (why, and the request field at
        fault where it is the request's own input: StepOutput's `failed` and `invalid`)."""
        ids = [s.request.request_id for s in step.states]
        if not ids:
            return []
        try:
            return list(zip(ids, forward(step)))
        except Exception as error:
            if len(ids) == 1:
                log.exception("denoising %s failed", ids[0])
                failed, invalid = failures
                failed[ids[0]] = f"{type(error).__name__}: {error}"
                if fault_of(error) is not None:  # the request's own input: its error says what to fix
                    failed[ids[0]], invalid[ids[0]] = str(error), fault_of(error)
                return []
            log.warning("a forward of %d requests failed (%s); retrying them one by one", len(ids), error)
        alone = [step.of([state], patched=False) for state in step.states]
        return [pair for one in alone for pair in self._predict(forward, one, failures)]

    def decode(self, request_id: str, latents=None) -> np.ndarray | None:
        """The request's image, uint8 [H, W, 3]: of its final latents, or of a preview snapshot;
        None if the request was released meanwhile."""
        return self.decode_many([(request_id, latents)])[0]

    def decode_many(self, items: list[tuple[str, torch.Tensor | None]]) -> list[np.ndarray | None]:
        """`decode` of each (request id, latents or None) pair, one VAE call per latent shape."""
        states = [self.states.get(rid) for rid, _ in items]
        present = [(state, state.latents if latents is None else latents)
                   for state, (_, latents) in zip(states, items) if state is not None]
        images = iter(self.family.decode_many(*map(list, zip(*present))) if present else [])
        return [next(images) if state is not None else None for state in states]

    def park(self, request_id: str) -> int:
        """Move a paused request's state into host memory (`Parked`), freeing its device copies;
        its next step brings it back. The bytes it holds there; 0 if it is not held here as a
        state (released, or parked already)."""
        self.controls.collect()  # async ControlNet residuals in flight belong to its state
        state = self.states.get(request_id)
        if not isinstance(state, DenoiseState):
            return 0
        self.states[request_id] = parked = Parked.of(state)
        return len(parked.blob)

    def release(self, request_id: str) -> None:
        self.states.pop(request_id, None)
        self.release_caches(request_id)

    def release_caches(self, request_id: str) -> None:
        """Forget the request's block-cache history, template role and adapter loads on this device."""
        self.cache.release(request_id)
        self.lora_runtime.release(request_id)
        self.controls.release(request_id)
        if self._templates is not None:
            self._templates.release(request_id)


def fault_of(error: Exception) -> str | None:
    """The request field at fault when a request's step fails with `error`: an adapter of its
    own that cannot serve it (a file caught half-written, one that no longer fits); None when
    the server is at fault (a ControlNet service worker that died is not the request's doing)."""
    if isinstance(error, LoraError):
        return "loras"
    if isinstance(error, ControlNetError) and not isinstance(error, ControlNetUnavailable):
        return "controlnets"
    return None
