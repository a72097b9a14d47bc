"""The forward composer: layers in ORDER, each handed the layers inside it; a layer that runs
parts of a step gets each part's predictions back in its states' order; a refused pair of what
the layers say a row uses stops the step before any layer runs."""

from types import SimpleNamespace

import pytest
import torch

from gouache.forward_layers import Step
from gouache.runner.forward import ORDER, Forward


class Recorder:
    """A layer of `technique` that records the states it saw and, for `split`, runs each state
    alone through the layers inside."""

    def __init__(self, technique, calls, uses=frozenset(), split=False):
        self.technique, self.calls, self._uses, self.split = technique, calls, frozenset(uses), split

    def uses(self, step, state):
        return self._uses

    def __call__(self, step, inner):
        self.calls.append((self.technique, [s.name for s in step.states]))
        if self.technique == "layout":
            return [torch.full((1,), float(s.value)) for s in step.states]
        if self.split:
            return [p for s in reversed(step.states) for p in inner(step.of([s]))][::-1]
        return inner(step)

    def rows(self, step, inner):
        return None if self.technique == "layout" else inner.rows(step)


def state(name, value):
    return SimpleNamespace(name=name, value=value, cond={}, request=SimpleNamespace(strength=None, num_frames=1),
                           latents=torch.zeros(1, 4, 8, 8))


def test_layers_run_outermost_first_and_parts_come_back_in_order():
    calls = []
    layers = [Recorder(name, calls, split=name == "lora") for name in ORDER]
    out = Forward(layers)(Step([state("a", 1), state("b", 2)], patched=False))
    assert [float(p) for p in out] == [1.0, 2.0]
    assert calls[:2] == [("parallel", ["a", "b"]), ("lora", ["a", "b"])]
    assert [c for c in calls[2:] if c[0] == "layout"] == [("layout", ["b"]), ("layout", ["a"])]
    assert [name for name, _ in calls[2:6]] == list(ORDER[2:])  # each part through every inner layer


def test_layers_out_of_order_are_refused():
    with pytest.raises(ValueError, match="ORDER"):
        Forward([Recorder(name, []) for name in reversed(ORDER)])


def test_a_refused_pair_from_two_layers_stops_the_step_before_any_layer_runs():
    calls = []
    uses = {"controlnet": {"controlnet"}, "block_cache": {"block_cache"}}
    forward = Forward([Recorder(name, calls, uses.get(name, ())) for name in ORDER])
    step = Step([state("a", 1)], patched=False)
    assert forward.uses(step, step.states[0]) == {"controlnet", "block_cache"}
    with pytest.raises(ValueError, match="controlnet and block_cache do not compose"):
        forward.check(step)
    assert forward.eager_reason(step) == "block_cache"  # ControlNet residuals compile
    assert calls == []
