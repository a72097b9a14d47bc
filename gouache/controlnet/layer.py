"""The ControlNet layer of a step's forward (`gouache.forward_layers`): each latent shape that
has ControlNet requests runs the model's plain forward with their residuals
(`ControlRuntime.predict`); the other requests go on to the layers inside."""

from __future__ import annotations

from gouache.controlnet.runtime import ControlRuntime
from gouache.forward_layers import Inner, Predictions, RowMaps, Step, this_rank


class ControlNetLayer:
    technique = "controlnet"

    def __init__(self, runtime: ControlRuntime, model):
        """`model`: the family whose `forward(states, control)` takes residuals and whose
        `row_maps` says a plain forward's rows."""
        self.runtime, self.model = runtime, model

    def uses(self, step: Step, state) -> frozenset[str]:
        return self.used_by(state)

    @staticmethod
    def used_by(state) -> frozenset[str]:
        """The technique a state's ControlNets are, in any step."""
        if state.control is None:
            return frozenset()
        return frozenset({"controlnet_async" if state.control.mode == "async" else "controlnet"})

    def __call__(self, step: Step, inner: Inner) -> Predictions:
        if all(s.control is None for s in step.states):
            return inner(step)
        return self.runtime.predict(step.states, self.model.forward, lambda group: inner(step.of(group)), step.split)

    def rows(self, step: Step, inner: Inner) -> RowMaps | None:
        if all(s.control is None for s in step.states):
            return inner.rows(step)
        if len({s.latents.shape for s in step.states}) > 1:  # a plain forward per latent shape
            return None
        return this_rank(step, self.model.row_maps(step.states, False))
