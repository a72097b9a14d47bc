"""The forward composer: the one place where a step's techniques are stacked on the denoiser.

A step is declared (`StepSpec`: the batch's layout, whether it may cache, its split over
devices) and each of its requests declares the techniques it uses (`row_techniques`); the
compatibility table (`gouache.techniques`) is checked for every row before anything runs. The
forward is then built in one order, outermost first (docs/architecture.md, "One forward"):

1. **parallel split** (`Split`): Ulysses sequence parallelism (DiTs) or CFG halves (UNets),
   installed on the denoiser for the whole step;
2. **adapters** (`Adapters`, LoRA): merged, segmented per row, or one forward per adapter set;
3. **residuals** (`Residuals`, ControlNet): a plain forward per latent shape that has
   ControlNet requests, with their residuals; the other rows go on;
4. **layout** (`Layout`, the family): one shape's batch, a patched UNet or packed DiT tokens;
5. **block pass** (inside the layout): block-cache reuse or template replay.

Under --compile the denoiser runs compiled where every technique of the step allows it
(`eager_reason`, `gouache.techniques`) and eagerly otherwise, counted
(`gouache.runner.compiled`).

Each technique is reached through its Protocol here, and a technique's runtime reads nothing of
another's: what a split changes for the layers inside it (which rows this rank runs, whether
residuals are computed before the denoiser, how ranks agree on a failure) is the `Split` it is
handed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from gouache.block_cache.store import BlockCache
from gouache.runner.sampler import DenoiseState
from gouache.templates.replay import TemplateCache
from gouache.techniques import TECHNIQUES, check_row

ORDER = ("parallel", "lora", "controlnet", "layout", "block pass")  # outermost first

RowMaps = dict[int, torch.Tensor]  # a forward's leading size -> the forward row of each index


class Split(Protocol):
    """A step on several devices, as the techniques inside it see it."""

    residuals_first: bool  # ControlNet residuals are computed before the denoiser runs (its rows are cut first)

    def rows(self, maps: RowMaps) -> RowMaps:
        """The row maps of this rank's part of a forward whose rows are `maps`."""

    def agree(self, ok: bool) -> bool:
        """Whether every rank is ok (each says for itself): ranks raise together or not at all."""

    @property
    def collective_s(self) -> float:
        """Seconds this rank spent in the split's collectives so far."""


class Adapters(Protocol):
    """LoRA (`gouache.lora.runtime.LoraRuntime`)."""

    def run(self, states: list[DenoiseState], adapters: list, predict: Callable, row_maps: Callable,
            step, slots=None) -> list[torch.Tensor]:
        """predict(states) with each state's adapters applied (row_maps(states): the forward's
        rows, or None where they cannot be told apart); `slots`: where a compiled forward
        takes segmented adapters (`gouache.lora.apply.RowSlots`), if the step may compile."""


class Residuals(Protocol):
    """ControlNet (`gouache.controlnet.runtime.ControlRuntime`)."""

    def predict(self, states: list[DenoiseState], forward: Callable, rest: Callable,
                split: Split | None) -> list[torch.Tensor]:
        """Per state, its rows' predictions: each latent shape with ControlNet requests by
        forward(group, residuals), the other states by rest(group)."""


class Layout(Protocol):
    """A model family (`gouache.runner.families.base.Family`): the layout and the block pass."""

    def predict(self, states: list[DenoiseState], patched: bool, cache: BlockCache | None,
                templates: TemplateCache | None) -> list[torch.Tensor]: ...

    def forward(self, states: list[DenoiseState], control=None) -> torch.Tensor: ...

    def row_maps(self, states: list[DenoiseState], patched: bool) -> RowMaps | None: ...


@dataclass(frozen=True)
class StepSpec:
    """What a step's forward is, as the runner declares it."""

    patched: bool  # mixed sizes in one forward (patched UNet, packed DiT) where the batch has several
    degree: int  # devices the step runs on
    cache: BlockCache | None  # the block cache, when the step may reuse (degree 1: ranks must not decide apart)
    templates: TemplateCache | None  # the template store, when the step has an edit replaying or recording one
    split: Split | None = None  # the step's parallel split, once installed (degree > 1)


def row_techniques(state: DenoiseState, spec: StepSpec) -> frozenset[str]:
    """The techniques (`gouache.techniques`) a state's rows use in a step of `spec`."""
    used = set()
    if state.lora is not None:
        used.add("lora" if state.lora.bound == 0 else "lora_async")
    if state.control is not None:
        used.add("controlnet_async" if state.control.mode == "async" else "controlnet")
    if spec.cache is not None and spec.cache.threshold(state.request.request_id, state.request.block_cache):
        used.add("block_cache")
    if spec.templates is not None and state.template is not None:
        used.add("template")
    if spec.degree > 1:
        used.add("parallel")
    if "reference" in state.cond:  # an instruction edit (Kontext, FLUX.2, Qwen-Image-Edit)
        used.add("reference")
    if state.request.strength is not None:
        used.add("img2img")
    return frozenset(used)


def eager_reason(spec: StepSpec, states: list[DenoiseState]) -> str | None:
    """Why a step of `spec` over `states` runs its denoiser eagerly under --compile: the first
    technique it uses that the compiled graph does not hold (None: it may run compiled)."""
    used = set().union(*(row_techniques(s, spec) for s in states))
    if spec.patched and len({s.latents.shape for s in states}) > 1:
        used.add("mixed_sizes")
    return next((name for name in TECHNIQUES if name in used and not TECHNIQUES[name].compiles), None)


class Forward:
    """One step's forward over its states, composed in `ORDER`."""

    def __init__(self, spec: StepSpec, layout: Layout, adapters: Adapters, residuals: Residuals, compiled=None):
        self.spec = spec
        self.layout = layout
        self.adapters = adapters
        self.residuals = residuals
        self.compiled = compiled  # the family's `CompiledDenoiser` under --compile

    @staticmethod
    def check(spec: StepSpec, states: list[DenoiseState]) -> None:
        """Raise ValueError if a state's rows would combine a refused pair of techniques in a step
        of `spec` (admission and the policies keep such a step from being planned)."""
        layout = {"mixed_sizes"} if spec.patched else set()
        for state in states:
            check_row(row_techniques(state, spec) | layout)

    def __call__(self, states: list[DenoiseState], adapters: list, lora_step) -> list[torch.Tensor]:
        """Per state, its rows' predictions, each with `adapters[i]` applied."""
        if self.compiled is None:
            return self.adapters.run(states, adapters, self._residuals, self._row_maps, lora_step)
        reason = eager_reason(self.spec, states)
        with self.compiled.step(reason):
            return self.adapters.run(states, adapters, self._residuals, self._row_maps, lora_step,
                                     self.compiled.slots if reason is None else None)

    def _residuals(self, group: list[DenoiseState]) -> list[torch.Tensor]:
        if all(s.control is None for s in group):
            return self._layout(group)
        return self.residuals.predict(group, self.layout.forward, self._layout, self.spec.split)

    def _layout(self, group: list[DenoiseState]) -> list[torch.Tensor]:
        return self.layout.predict(group, self.spec.patched, self.spec.cache, self.spec.templates)

    def _row_maps(self, group: list[DenoiseState]) -> RowMaps | None:
        """The rows of the forward `_residuals(group)` runs, for adapters applied per row."""
        if any(s.control is not None for s in group):  # a plain forward per latent shape
            maps = self.layout.row_maps(group, False) if len({s.latents.shape for s in group}) == 1 else None
        elif self.spec.templates is not None or any("block_cache" in row_techniques(s, self.spec) for s in group):
            maps = None  # a block cache or template replay computes subsets of rows: no segmenting there
        else:
            maps = self.layout.row_maps(group, self.spec.patched)
        if maps is None or self.spec.split is None:
            return maps
        return self.spec.split.rows(maps)


class _Whole:
    """A step every rank runs whole, rows and tokens (a CFG batch with a request without
    guidance): residuals overlap the encoder as on one device; ranks agree on failures."""

    residuals_first = False
    collective_s = 0.0

    def __init__(self, group, device):
        self.group, self.device = group, device

    def rows(self, maps: RowMaps) -> RowMaps:
        return maps

    def agree(self, ok: bool) -> bool:
        return all_ok(ok, self.group, self.device)


class _Halves(_Whole):
    """CFG halves: this rank runs every other row, from its rank."""

    residuals_first = True  # the rows are cut before the UNet runs

    def __init__(self, group, device, halves):
        super().__init__(group, device)
        self.rank, self._halves = dist.get_rank(group), halves

    def rows(self, maps: RowMaps) -> RowMaps:
        return {n // 2: rows[self.rank::2] for n, rows in maps.items()}

    @property
    def collective_s(self) -> float:
        return self._halves.collective_s


class _Sequence(_Whole):
    """Ulysses: every rank holds every row and a shard of each image's tokens."""

    def __init__(self, group, device, shards):
        super().__init__(group, device)
        self._shards = shards

    @property
    def collective_s(self) -> float:
        return self._shards.collective_s if self._shards is not None else 0.0


@contextlib.contextmanager
def split_step(pipe, states: list[DenoiseState], degree: int, group, device) -> Iterator[Split | None]:
    """The parallel split of a step of `degree` over `group` (None at degree 1), installed on
    the denoiser while inside: a UNet's CFG halves (every request with guidance), a DiT's
    Ulysses sequence shards."""
    if degree == 1:
        yield None
        return
    if group is None:
        raise ValueError(f"a batch of degree {degree} needs the process group of its devices")
    from gouache.parallel.ulysses import check_degree, ulysses

    check_degree(pipe, degree)
    if getattr(pipe, "unet", None) is None:
        with ulysses(pipe.transformer, group) as shards:
            yield _Sequence(group, device, shards)
        return
    if not all(s.rows == 2 for s in states):  # a request without guidance: both ranks run every row
        yield _Whole(group, device)
        return
    from gouache.parallel.cfg import cfg_parallel

    with cfg_parallel(pipe.unet, group) as halves:
        yield _Halves(group, device, halves)


def all_ok(ok: bool, group, device) -> bool:
    """Whether every rank of `group` is ok (each says for itself)."""
    flag = torch.tensor([1 if ok else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
