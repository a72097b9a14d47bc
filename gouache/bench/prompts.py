"""The prompts of `gouache bench fidelity`: shapes scenes at sizes and seeds, and the layout-map
ControlNet that may place them (then the captions say no positions)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from gouache.data.shapes import Scene, caption, sample_scene


@dataclass(frozen=True)
class Prompt:
    """One image to make: a scene's caption at a size, with a seed."""

    scene: Scene
    width: int
    height: int
    seed: int

    @property
    def caption(self) -> str:
        return caption(self.scene)


def make_prompts(n: int, seeds: int, sizes: list[tuple[int, int]], seed: int = 0) -> list[Prompt]:
    """n scenes (deterministic from `seed`), sizes ((h, w) each) taken in turn, each with seeds 0..seeds-1."""
    rng = random.Random(f"fidelity:{seed}")
    scenes = [sample_scene(rng) for _ in range(n)]
    return [
        Prompt(scene, width=sizes[i % len(sizes)][1], height=sizes[i % len(sizes)][0], seed=s)
        for i, scene in enumerate(scenes) for s in range(seeds)
    ]


@dataclass(frozen=True)
class Control:
    """Every prompt placed by a layout-map ControlNet (`gouache train controlnet`): the caption
    says what and which colour, the map where (`layout_map` of the prompt's scene)."""

    name: str
    directory: str
    workers: int = 1  # ControlNet service processes (async mode needs one)


def controls(prompt: Prompt, control: Control | None, mode: str | None) -> dict:
    """An ImageRequest's ControlNet fields for `prompt` (none without a ControlNet, or in mode "none")."""
    if control is None or mode == "none":
        return {}
    from gouache.data.shapes import layout_map
    from gouache.engine.imaging import encode_image

    image = encode_image(layout_map(prompt.scene, prompt.width, prompt.height), "png")
    return {"controlnets": ((control.name, image, 1.0),), "controlnet_mode": mode}
