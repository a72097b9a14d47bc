"""What a bench's request carries beside its prompt (`gouache.data.prompts`): an edit's upload as
a client sends it, and the layout-map ControlNet that may place a generation's shapes (then the
captions say no positions)."""

from __future__ import annotations

from dataclasses import dataclass

from gouache.data.prompts import Prompt


def encoded_upload(prompt: Prompt) -> bytes | None:
    """The prompt's upload as a PNG, as a client sends it to the engine; None for a generation."""
    from gouache.engine.imaging import encode_image

    return encode_image(prompt.upload(), "png") if prompt.edit else None


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
