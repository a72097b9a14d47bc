"""The forward composer: the one place where a step's techniques are stacked on the denoiser.

A step's forward is a list of layers, one per technique, composed in `ORDER`, outermost first
(docs/architecture.md, "One forward"); each has one shape, `layer(step, inner) -> predictions`
(`gouache.forward_layers`), and lives in its technique's folder:

1. **parallel** (`gouache.parallel.layer`): a step on several devices, its split (Ulysses
   sequence shards for DiTs, CFG halves for UNets) installed while the layers inside run;
2. **lora** (`gouache.lora.layer`): adapters merged, segmented per row, or one forward per set;
3. **controlnet** (`gouache.controlnet.layer`): a plain forward per latent shape that has
   ControlNet requests, with their residuals; the other rows go on;
4. **template** (`gouache.templates.layer`): edits of a template compute their masked tokens;
5. **block_cache** (`gouache.block_cache.layer`): the block pass that reuses block outputs;
6. **layout** (`LayoutLayer`, the family): the model's own forward, one shape's batch, a
   patched UNet or packed DiT tokens, through the block pass it is handed.

Each request's rows are checked against the compatibility table (`gouache.techniques`) from
what the layers say it uses before anything runs. Under --compile the denoiser runs compiled
where every technique of the step allows it (`eager_reason`) and eagerly otherwise, counted
(`gouache.runner.compiled`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gouache.forward_layers import ForwardLayer, Predictions, RowMaps, Step, this_rank
from gouache.runner.sampler import DenoiseState
from gouache.techniques import TECHNIQUES, check_row

ORDER = ("parallel", "lora", "controlnet", "template", "block_cache", "layout")  # outermost first


def prepared_techniques(state: DenoiseState) -> frozenset[str]:
    """The techniques a state's rows carry from its preparation, whatever the step."""
    used = set()
    if "reference" in state.cond:  # an instruction edit (Kontext, FLUX.2, Qwen-Image-Edit)
        used.add("reference")
    if state.request.strength is not None:
        used.add("img2img")
    if state.request.num_frames > 1:
        used.add("clip")
    return frozenset(used)


class LayoutLayer:
    """The innermost layer: the model's forward (the family), whose layout mixes sizes in one
    forward (patched UNet, packed DiT) where the step is patched."""

    technique = "layout"

    def __init__(self, model):
        self.model = model

    def uses(self, step: Step, state: DenoiseState) -> frozenset[str]:
        return frozenset({"mixed_sizes"}) if step.patched else frozenset()

    def __call__(self, step: Step, inner) -> Predictions:
        return self.model.predict(step.states, step.patched, step.blocks)

    def rows(self, step: Step, inner) -> RowMaps | None:
        return this_rank(step, self.model.row_maps(step.states, step.patched))


class _Inner:
    """The layers from the `at`-th on, as the layer before them sees them (`Inner`)."""

    def __init__(self, layers: Sequence[ForwardLayer], at: int):
        self.layers, self.at = layers, at

    def __call__(self, step: Step) -> Predictions:
        return self.layers[self.at](step, _Inner(self.layers, self.at + 1))

    def rows(self, step: Step) -> RowMaps | None:
        return self.layers[self.at].rows(step, _Inner(self.layers, self.at + 1))


class Forward:
    """One step's forward: its layers, one per technique of `ORDER`."""

    def __init__(self, layers: Sequence[ForwardLayer], compiled=None):
        """`compiled`: the family's `CompiledDenoiser` under --compile."""
        if tuple(layer.technique for layer in layers) != ORDER:
            raise ValueError(f"a forward's layers come in ORDER {ORDER}, "
                             f"not {tuple(layer.technique for layer in layers)}")
        self.layers = tuple(layers)
        self.compiled = compiled

    def layer(self, technique: str) -> ForwardLayer:
        """The layer of `technique` (a name of `ORDER`)."""
        return self.layers[ORDER.index(technique)]

    def uses(self, step: Step, state: DenoiseState) -> frozenset[str]:
        """The techniques (`gouache.techniques`) a state's rows use in `step`."""
        return prepared_techniques(state).union(*(layer.uses(step, state) for layer in self.layers))

    def check(self, step: Step) -> None:
        """Raise ValueError if a state's rows would combine a refused pair of techniques in
        `step` (admission and the policies keep such a step from being planned)."""
        for state in step.states:
            check_row(self.uses(step, state))

    def eager_reason(self, step: Step) -> str | None:
        """Why `step` runs its denoiser eagerly under --compile: the first technique it uses that
        the compiled graph does not hold (None: it may run compiled)."""
        used = set().union(*(self.uses(step, s) for s in step.states))
        if len({s.latents.shape for s in step.states}) == 1:
            used.discard("mixed_sizes")  # a patched step of one shape runs as the model's own batch
        if self.compiled is not None:
            used -= self.compiled.holds  # what this model's graphs hold beyond the table
        return next((name for name in TECHNIQUES if name in used and not TECHNIQUES[name].compiles), None)

    @torch.no_grad()
    def __call__(self, step: Step) -> Predictions:
        """Per state of `step`, its rows' predictions (`check` it first)."""
        if self.compiled is None:
            return _Inner(self.layers, 0)(step)
        reason = self.eager_reason(step)
        with self.compiled.step(reason):
            return _Inner(self.layers, 0)(step.of(step.states, compiled=reason is None))
