"""Prompts of the shapes world for the benches and profilers (`gouache bench fidelity`, `bench
adapters`, `profile-lora`): shapes scenes at sizes and seeds, or instruction edits of them (for a
model that only edits), and the request each one makes."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from gouache.data.edits import EDIT_KINDS, Edit, sample_edit
from gouache.data.shapes import Scene, caption, render, sample_scene


@dataclass(frozen=True)
class Prompt:
    """One image to make: a scene's caption at a size, with a seed; or, with `edit`, the edit's
    source rendered at that size (jitter seeded by `render_seed`) changed by its instruction
    into `scene`, its target."""

    scene: Scene
    width: int
    height: int
    seed: int
    edit: Edit | None = None
    render_seed: int = 0

    @property
    def caption(self) -> str:
        """The request's prompt: the caption, or the edit's instruction."""
        return self.edit.instruction if self.edit else caption(self.scene)

    def upload(self) -> np.ndarray | None:
        """[H, W, 3] uint8: the image an edit changes; None for a generation."""
        return render(self.edit.source, self.width, self.height, self.render_seed) if self.edit else None

    def prepared(self, request_id: str, steps: int, guidance: float, **fields):
        """(its request, its upload or None): what an in-process runner's `prepare` takes."""
        from gouache.request import ImageRequest
        from gouache.uploads import Upload

        request = ImageRequest(request_id, self.caption, self.width, self.height, steps, guidance, self.seed,
                               image=b"upload" if self.edit else None, **fields)
        return request, Upload(self.upload()) if self.edit else None


def make_prompts(n: int, seeds: int, sizes: list[tuple[int, int]], seed: int = 0) -> list[Prompt]:
    """n scenes (deterministic from `seed`), sizes ((h, w) each) taken in turn, each with seeds 0..seeds-1."""
    rng = random.Random(f"fidelity:{seed}")
    scenes = [sample_scene(rng) for _ in range(n)]
    return [
        Prompt(scene, width=sizes[i % len(sizes)][1], height=sizes[i % len(sizes)][0], seed=s)
        for i, scene in enumerate(scenes) for s in range(seeds)
    ]


def make_edit_prompts(n: int, seeds: int, sizes: list[tuple[int, int]], seed: int = 0) -> list[Prompt]:
    """n instruction edits of every kind in turn (deterministic from `seed`, apart from the
    training data's), sizes ((h, w) each) taken in turn, each with seeds 0..seeds-1."""
    rng = random.Random(f"fidelity-edits:{seed}")
    edits = [(sample_edit(rng, EDIT_KINDS[i % len(EDIT_KINDS)]), rng.getrandbits(32)) for i in range(n)]
    return [
        Prompt(edit.target, width=sizes[i % len(sizes)][1], height=sizes[i % len(sizes)][0], seed=s, edit=edit,
               render_seed=jitter)
        for i, (edit, jitter) in enumerate(edits) for s in range(seeds)
    ]


def shapes_prompts(edits: bool, n: int, size: int, rng: random.Random, start: int = 0) -> list[Prompt]:
    """n prompts drawn from `rng` at size x size, the k-th with seed k: shapes scenes captioned, or
    for a model that only edits (`edits`) instruction edits of every kind in turn, from the
    `start`-th kind on."""
    if not edits:
        return [Prompt(sample_scene(rng), size, size, seed=k) for k in range(n)]
    drawn = [(sample_edit(rng, EDIT_KINDS[(start + k) % len(EDIT_KINDS)]), rng.getrandbits(32)) for k in range(n)]
    return [Prompt(edit.target, size, size, seed=k, edit=edit, render_seed=jitter)
            for k, (edit, jitter) in enumerate(drawn)]
