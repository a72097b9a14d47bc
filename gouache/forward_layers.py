"""What a technique's layer of a step's forward is (docs/architecture.md, "One forward").

A step's forward is a stack of layers, outermost first in `gouache.runner.forward.ORDER`; each
technique's layer lives in its own folder (`gouache.parallel.layer`, `gouache.lora.layer`,
...) and has one shape: `layer(step, inner) -> predictions`, as a middleware stack's. A layer
runs the layers inside it (`inner`) on the step, on parts of it (one forward per adapter set,
per latent shape) or on a step it changed (a split installed, a block pass chosen), and may
run the model's own forward instead where its technique needs one (ControlNet residuals,
template replay). It calls nothing of the composer and reads nothing of another technique's
runtime: what it needs from the layers outside it is in the `Step` it is handed.

The innermost layer is the model's forward (`gouache.runner.families`): its layout (one
shape's batch, a patched UNet, packed DiT tokens) and the block pass it is given.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

Predictions = list[torch.Tensor]  # per state of a step, its rows' predictions
RowMaps = dict[int, torch.Tensor]  # a forward's leading size -> the forward row of each index


class Split(Protocol):
    """A step on several devices, as the layers inside the parallel one see it."""

    residuals_first: bool  # ControlNet residuals are computed before the denoiser runs (its rows are cut first)

    def rows(self, maps: RowMaps) -> RowMaps:
        """The row maps of this rank's part of a forward whose rows are `maps`."""

    def agree(self, ok: bool) -> bool:
        """Whether every rank is ok (each says for itself): ranks raise together or not at all."""

    @property
    def collective_s(self) -> float:
        """Seconds this rank spent in the split's collectives so far."""


@dataclass(frozen=True)
class Step:
    """A forward's part of a step, as each layer hands it to the layers inside."""

    states: list[Any]  # the `DenoiseState`s whose rows this forward predicts, in order
    patched: bool  # mixed sizes share one forward (patched UNet, packed DiT) where they can
    compiled: bool = False  # the denoiser runs compiled in this step (`gouache.runner.compiled`)
    split: Split | None = None  # the step's parallel split, installed by the parallel layer
    blocks: Any = None  # the block pass the model's forward runs (`gouache.block_cache.blocks.CachedForward`)

    def of(self, states: list[Any], **changes) -> Step:
        """This step over `states` (a part of its states), with `changes`."""
        return replace(self, states=states, **changes)


class Inner(Protocol):
    """The layers inside a layer."""

    def __call__(self, step: Step) -> Predictions:
        """Per state of `step`, its rows' predictions."""

    def rows(self, step: Step) -> RowMaps | None:
        """The row maps of the forward these layers run for `step` (this rank's part of it), or
        None where its rows cannot be told apart (patches of mixed sizes, cached rows): adapters
        applied per row segment by them (`gouache.lora.apply.segmented`)."""


class ForwardLayer(Protocol):
    """One technique's part of a step's forward."""

    technique: str  # its place in `gouache.runner.forward.ORDER`

    def uses(self, step: Step, state: Any) -> frozenset[str]:
        """The techniques (`gouache.techniques`) of this layer that `state`'s rows use in `step`."""

    def __call__(self, step: Step, inner: Inner) -> Predictions:
        """Per state of `step`, its rows' predictions, the layers inside run through `inner`."""

    def rows(self, step: Step, inner: Inner) -> RowMaps | None:
        """The row maps of the forward this layer runs for `step` (`Inner.rows`); a layer that
        runs none of its own asks `inner`."""


def this_rank(step: Step, maps: RowMaps | None) -> RowMaps | None:
    """A forward's row maps as this rank runs them: cut by the step's split, if any (a layer
    that runs the model's forward says its rows through this)."""
    return maps if maps is None or step.split is None else step.split.rows(maps)
