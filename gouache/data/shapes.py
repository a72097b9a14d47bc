"""Deterministic scenes of one to three coloured shapes on a 3x3 grid, their captions, and their
renders. Every scene can be captioned, parsed back exactly, and checked (`checker.py`), so a model
trained on them can be scored without a human looking."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

# Shape colours: far apart in RGB (>= 135 from each other and from every background), so blur and
# noise rarely move a pixel nearer to another named colour.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (225, 30, 30),
    "green": (30, 180, 40),
    "blue": (30, 60, 230),
    "yellow": (245, 225, 30),
    "purple": (165, 20, 225),
    "cyan": (30, 215, 225),
}
BACKGROUNDS: dict[str, tuple[int, int, int]] = {"white": (255, 255, 255), "black": (0, 0, 0), "gray": (128, 128, 128)}
KINDS = ("circle", "square", "triangle")
# Grid cells in row-major order: index // 3 is the row, index % 3 the column.
POSITIONS = ("top left", "top", "top right", "left", "center", "right", "bottom left", "bottom", "bottom right")
MAX_SHAPES = 3
SIZE_RANGE = (0.55, 0.8)  # shape side as a fraction of the cell's smaller side; the rest is margin
NOMINAL_SIZE = 0.7  # side fraction when render() is given no seed


@dataclass(frozen=True)
class Shape:
    """One shape of a scene."""

    kind: str  # one of KINDS
    colour: str  # a key of COLOURS
    position: str  # one of POSITIONS, the grid cell holding the shape

    def __post_init__(self) -> None:
        for value, allowed, what in ((self.kind, KINDS, "kind"), (self.colour, COLOURS, "colour"),
                                     (self.position, POSITIONS, "position")):
            if value not in allowed:
                raise ValueError(f"shape {what} must be one of {sorted(allowed)}, got {value!r}")


@dataclass(frozen=True)
class Scene:
    """One to three shapes in distinct cells with distinct colours, on a plain background."""

    shapes: tuple[Shape, ...]  # [1..3] in caption order
    background: str  # a key of BACKGROUNDS, never a shape colour

    def __post_init__(self) -> None:
        if not 1 <= len(self.shapes) <= MAX_SHAPES:
            raise ValueError(f"a scene has 1 to {MAX_SHAPES} shapes, got {len(self.shapes)}")
        if len({s.position for s in self.shapes}) != len(self.shapes):
            raise ValueError("shapes of a scene must take distinct grid cells")
        if len({s.colour for s in self.shapes}) != len(self.shapes):
            raise ValueError("shapes of a scene must have distinct colours, so each can be found")
        if self.background not in BACKGROUNDS:
            raise ValueError(f"background must be one of {sorted(BACKGROUNDS)}, got {self.background!r}")


def place_phrase(position: str) -> str:
    """'at the top left', 'in the center': where a caption (or an instruction) puts a shape."""
    return "in the center" if position == "center" else f"at the {position}"


def caption(scene: Scene) -> str:
    """'a red circle at the top left and a blue square at the bottom on a white background'."""
    parts = [f"a {s.colour} {s.kind} {place_phrase(s.position)}" for s in scene.shapes]
    shapes = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    return f"{shapes} on a {scene.background} background"


# Every word a caption can use, in a fixed order (a tokenizer makes each one token).
WORDS: tuple[str, ...] = tuple(
    dict.fromkeys(
        ["a", "and", "on", "background", ","]
        + [w for p in POSITIONS for w in place_phrase(p).split()]
        + [*COLOURS, *KINDS, *BACKGROUNDS]
    )
)


def regex_alternatives(words) -> str:
    """A regular expression matching any of `words` exactly, the longest first."""
    return "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True))


_SHAPE_RE = (
    f"a ({regex_alternatives(COLOURS)}) ({regex_alternatives(KINDS)}) "
    f"({regex_alternatives(place_phrase(p) for p in POSITIONS)})"
)
_CAPTION_RE = re.compile(
    f"{_SHAPE_RE}(?:, {_SHAPE_RE})?(?: and {_SHAPE_RE})? on a ({regex_alternatives(BACKGROUNDS)}) background"
)
_POSITION_OF_PHRASE = {place_phrase(p): p for p in POSITIONS}


def parse_caption(text: str) -> Scene:
    """Invert `caption` exactly; ValueError on any text that `caption` cannot produce."""
    match = _CAPTION_RE.fullmatch(text.strip())
    if match is None:
        raise ValueError(
            f"not a shapes caption: {text!r}; expected e.g. "
            "'a red circle at the top left and a blue square in the center on a white background'"
        )
    groups = match.groups()
    shapes = [
        Shape(kind=groups[i + 1], colour=groups[i], position=_POSITION_OF_PHRASE[groups[i + 2]])
        for i in range(0, 9, 3)
        if groups[i] is not None
    ]
    if groups[3] is not None and groups[6] is None:  # "x, y on ..." lacks the final "and"
        raise ValueError(f"not a shapes caption: {text!r}; the last shape must follow 'and'")
    return Scene(shapes=tuple(shapes), background=groups[9])


def cell_box(position: str, width: int, height: int) -> tuple[float, float, float, float]:
    """(left, top, right, bottom) in pixels of a grid cell; cells scale with width and height."""
    row, col = divmod(POSITIONS.index(position), 3)
    return col * width / 3, row * height / 3, (col + 1) * width / 3, (row + 1) * height / 3


def cell_of(x: float, y: float, width: int, height: int) -> str:
    """The grid cell holding pixel coordinate (x, y)."""
    col = min(max(int(3 * x / width), 0), 2)
    row = min(max(int(3 * y / height), 0), 2)
    return POSITIONS[3 * row + col]


def shape_box(shape: Shape, width: int, height: int, seed: int | None) -> tuple[float, ...]:
    """Square box (left, top, right, bottom) of a shape inside its cell, with a margin. With a seed,
    side and offset are jittered by (seed, the shape's cell) alone: a scene's other shapes, and
    an edit that keeps this one where it is, leave its pixels as they were. The side uses the
    cell's smaller side, so a circle stays round."""
    left, top, right, bottom = cell_box(shape.position, width, height)
    cell = min(right - left, bottom - top)
    rng = random.Random(f"{seed}:{shape.position}") if seed is not None else None
    side = cell * (rng.uniform(*SIZE_RANGE) if rng else NOMINAL_SIZE)
    cx, cy = (left + right) / 2, (top + bottom) / 2
    if rng:  # move at most half the free space, keeping a margin on every side
        cx += rng.uniform(-0.5, 0.5) * (right - left - side) / 2
        cy += rng.uniform(-0.5, 0.5) * (bottom - top - side) / 2
    return cx - side / 2, cy - side / 2, cx + side / 2, cy + side / 2


def _draw(draw: ImageDraw.ImageDraw, kind: str, box: tuple[float, ...], fill: tuple[int, int, int]) -> None:
    left, top, right, bottom = box
    if kind == "circle":
        draw.ellipse(box, fill=fill)
    elif kind == "square":
        draw.rectangle(box, fill=fill)
    else:  # upright isosceles triangle filling half its box
        draw.polygon([((left + right) / 2, top), (right, bottom), (left, bottom)], fill=fill)


def render(scene: Scene, width: int, height: int, seed: int | None = None) -> np.ndarray:
    """[H, W, 3] uint8 image of the scene. With a seed, sizes and offsets vary a little (each
    shape's by the seed and its cell, `shape_box`); without, every shape has the nominal size at
    its cell's centre."""
    if not (32 <= width <= 256 and 32 <= height <= 256):
        raise ValueError(f"render sizes must be 32 to 256 px, got {width}x{height}")
    image = Image.new("RGB", (width, height), BACKGROUNDS[scene.background])
    draw = ImageDraw.Draw(image)
    for shape in scene.shapes:
        _draw(draw, shape.kind, shape_box(shape, width, height, seed), COLOURS[shape.colour])
    return np.asarray(image)


LAYOUT_LEVELS = (255, 170, 85)  # a layout map's grey for the first, second and third shape of the caption


def layout_map(scene: Scene, width: int, height: int, seed: int | None = None) -> np.ndarray:
    """[H, W, 3] uint8 map of where `render(scene, width, height, seed)` puts each shape: its
    silhouette in the grey of its place in the caption (LAYOUT_LEVELS) on black. A ControlNet
    conditioning image: where and what shape, not which colour."""
    image = Image.new("RGB", (width, height), (0, 0, 0))
    draw = ImageDraw.Draw(image)
    for level, shape in zip(LAYOUT_LEVELS, scene.shapes):
        _draw(draw, shape.kind, shape_box(shape, width, height, seed), (level,) * 3)
    return np.asarray(image)


def unplaced_caption(scene: Scene) -> str:
    """The caption without its positions: 'a red circle and a blue square on a white background'
    (where each shape goes is a layout map's to say)."""
    parts = [f"a {s.colour} {s.kind}" for s in scene.shapes]
    shapes = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    return f"{shapes} on a {scene.background} background"


def sample_scene(rng: random.Random) -> Scene:
    """A uniformly drawn scene: 1-3 shapes, distinct cells and colours, any kinds."""
    n = rng.randint(1, MAX_SHAPES)
    colours = rng.sample(sorted(COLOURS), n)
    positions = rng.sample(POSITIONS, n)
    shapes = tuple(Shape(rng.choice(KINDS), c, p) for c, p in zip(colours, positions))
    return Scene(shapes=shapes, background=rng.choice(sorted(BACKGROUNDS)))


@dataclass(frozen=True)
class ShapesDataset:
    """An unlimited, reproducible dataset: item i depends on (seed, i) alone."""

    seed: int  # the dataset's seed; two datasets with one seed are identical
    sizes: list[tuple[int, int]]  # (height, width) choices, each 32..256 px; one is drawn per item

    def __post_init__(self) -> None:
        if not self.sizes:
            raise ValueError("ShapesDataset needs at least one (height, width) size")
        for h, w in self.sizes:
            if not (32 <= w <= 256 and 32 <= h <= 256):
                raise ValueError(f"sizes must be 32 to 256 px, got {w}x{h}")

    def item(self, index: int) -> tuple[np.ndarray, str, Scene, tuple[int, int]]:
        """(image [H, W, 3] uint8, caption, scene, (height, width)) of item `index`."""
        rng = random.Random(f"shapes:{self.seed}:{index}")  # str seeds are stable across runs
        scene = sample_scene(rng)
        height, width = rng.choice(self.sizes)
        return render(scene, width, height, seed=rng.getrandbits(32)), caption(scene), scene, (height, width)
