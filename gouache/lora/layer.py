"""The LoRA layer of a step's forward (`gouache.forward_layers`): each request's adapters that
arrived for this step (`LoraRuntime.arrived`), merged, segmented per row or one forward per
adapter set (`LoraRuntime.run`)."""

from __future__ import annotations

from gouache.forward_layers import Inner, Predictions, RowMaps, Step
from gouache.lora.apply import Adapters, RowSlots
from gouache.lora.runtime import LoraRuntime
from gouache.outputs import LoraReport


class LoraLayer:
    technique = "lora"

    def __init__(self, runtime: LoraRuntime, arrived: dict[str, Adapters], report: LoraReport,
                 slots: RowSlots | None = None):
        """`arrived`: each request's adapters for this step, by id; `report`: the step's;
        `slots`: where the compiled forward takes segmented adapters, under --compile."""
        self.runtime, self.arrived, self.report, self.slots = runtime, arrived, report, slots

    def uses(self, step: Step, state) -> frozenset[str]:
        if state.lora is None:
            return frozenset()
        return frozenset({"lora" if state.lora.bound == 0 else "lora_async"})

    def __call__(self, step: Step, inner: Inner) -> Predictions:
        adapters = [self.arrived[s.request.request_id] for s in step.states]
        return self.runtime.run(step.states, adapters, lambda states: inner(step.of(states)),
                                lambda states: inner.rows(step.of(states)), self.report,
                                self.slots if step.compiled else None)

    def rows(self, step: Step, inner: Inner) -> RowMaps | None:
        return inner.rows(step)
