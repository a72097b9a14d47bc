"""The template layer of a step's forward (`gouache.forward_layers`): edits of a template
compute their masked tokens only, replaying the rest from the template's recorded activations
(InstGenIE); a packed DiT forward replays any mix of sizes, a UNet one pass per latent shape.
A group of states that replays nothing this step goes on to the layers inside."""

from __future__ import annotations

from gouache.forward_layers import Inner, Predictions, RowMaps, Step
from gouache.templates.replay import TemplateCache


class TemplateLayer:
    technique = "template"

    def __init__(self, templates: TemplateCache | None, model):
        """`templates`: the store, when the step has an edit recording or replaying a template;
        `model`: the family whose `replay(states, replay)` runs a replaying forward."""
        self.templates, self.model = templates, model

    def uses(self, step: Step, state) -> frozenset[str]:
        return frozenset({"template"}) if self.templates is not None and state.template is not None else frozenset()

    def __call__(self, step: Step, inner: Inner) -> Predictions:
        if self.templates is None or all(s.template is None for s in step.states):
            return inner(step)
        groups: dict[tuple, list] = {}  # a packed forward takes any sizes; a UNet one latent shape
        for state in step.states:
            groups.setdefault(tuple(state.latents.shape) if self.model.patches else (), []).append(state)
        out = {}
        for group in groups.values():
            tokens = [self.model.token_count(s) for s in group]
            replay = self.templates.begin(self.model.denoiser, group, tokens, self.model.template_blocks())
            if replay is None:
                predictions = inner(step.of(group, patched=step.patched and len(groups) == 1))
            else:
                predictions = self.model.replay(group, replay)
            out.update(zip(map(id, group), predictions))
        return [out[id(s)] for s in step.states]

    def rows(self, step: Step, inner: Inner) -> RowMaps | None:
        return None if self.templates is not None else inner.rows(step)  # replays compute subsets of rows
