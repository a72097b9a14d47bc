"""Instruction edits of shapes scenes: a source scene, an instruction in words ("make the red
circle blue", "move the square to the bottom right"), and the scene it asks for. Every
instruction parses back against its source exactly, so an edit model's output can be checked by
a program (`checker.check_edit`), as a generation's can.

Five kinds: recolour a shape, move it to a free cell, remove it (scenes of two or three), add one
(scenes of one or two), change the background. A shape is named by its colour and kind (colours
are distinct within a scene, so the colour alone would do; the kind makes the sentence natural).
Source and target render with one seed: a shape's jitter depends on the seed and its cell alone
(`shapes.shape_box`), so what an edit leaves alone keeps its pixels."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import numpy as np

from gouache.data.shapes import (
    BACKGROUNDS,
    COLOURS,
    KINDS,
    POSITIONS,
    WORDS,
    Scene,
    Shape,
    place_phrase,
    regex_alternatives,
    render,
    sample_scene,
)

EDIT_KINDS = ("recolour", "move", "remove", "add", "background")
# Every word an instruction can use beyond a caption's, in a fixed order (one token each).
EDIT_WORDS: tuple[str, ...] = tuple(dict.fromkeys([*WORDS, "make", "the", "move", "to", "remove", "add"]))


@dataclass(frozen=True)
class Edit:
    """One instruction edit: `target` is `source` changed as `instruction` says."""

    kind: str  # one of EDIT_KINDS
    source: Scene
    target: Scene
    instruction: str
    shape: int | None  # index in `target.shapes` of the shape the edit made or changed; None: remove, background
    removed: Shape | None = None  # the source's shape a remove took away


def _name(shape: Shape) -> str:
    return f"the {shape.colour} {shape.kind}"


def _destination(position: str) -> str:
    return "to the center" if position == "center" else f"to the {position}"


def recolour(source: Scene, index: int, colour: str) -> Edit:
    shape = source.shapes[index]
    if colour == shape.colour:
        raise ValueError(f"{_name(shape)} is {colour} already")
    changed = Shape(shape.kind, colour, shape.position)
    target = Scene(source.shapes[:index] + (changed,) + source.shapes[index + 1:], source.background)
    return Edit("recolour", source, target, f"make {_name(shape)} {colour}", index)


def move(source: Scene, index: int, position: str) -> Edit:
    shape = source.shapes[index]
    if position == shape.position:
        raise ValueError(f"{_name(shape)} is {place_phrase(position)} already")
    changed = Shape(shape.kind, shape.colour, position)
    target = Scene(source.shapes[:index] + (changed,) + source.shapes[index + 1:], source.background)
    return Edit("move", source, target, f"move {_name(shape)} {_destination(position)}", index)


def remove(source: Scene, index: int) -> Edit:
    shape = source.shapes[index]
    if len(source.shapes) == 1:
        raise ValueError(f"{_name(shape)} is the scene's only shape; a scene keeps one at least")
    target = Scene(source.shapes[:index] + source.shapes[index + 1:], source.background)
    return Edit("remove", source, target, f"remove {_name(shape)}", None, shape)


def add(source: Scene, shape: Shape) -> Edit:
    target = Scene(source.shapes + (shape,), source.background)
    return Edit("add", source, target, f"add a {shape.colour} {shape.kind} {place_phrase(shape.position)}",
                len(source.shapes))


def background(source: Scene, colour: str) -> Edit:
    if colour == source.background:
        raise ValueError(f"the background is {colour} already")
    target = Scene(source.shapes, colour)
    return Edit("background", source, target, f"make the background {colour}", None)


def sample_edit(rng: random.Random, kind: str | None = None) -> Edit:
    """A uniformly drawn edit of `kind` (any, uniformly, if None) of a scene drawn to allow it."""
    kind = kind if kind is not None else rng.choice(EDIT_KINDS)
    while True:
        source = sample_scene(rng)
        n = len(source.shapes)
        if (kind == "remove" and n < 2) or (kind == "add" and n > 2):
            continue
        free_cells = [p for p in POSITIONS if p not in {s.position for s in source.shapes}]
        free_colours = [c for c in sorted(COLOURS) if c not in {s.colour for s in source.shapes}]
        index = rng.randrange(n)
        if kind == "recolour":
            return recolour(source, index, rng.choice(free_colours))
        if kind == "move":
            return move(source, index, rng.choice(free_cells))
        if kind == "remove":
            return remove(source, index)
        if kind == "add":
            return add(source, Shape(rng.choice(KINDS), rng.choice(free_colours), rng.choice(free_cells)))
        if kind == "background":
            return background(source, rng.choice([b for b in sorted(BACKGROUNDS) if b != source.background]))
        raise ValueError(f"edit kind must be one of {EDIT_KINDS}, got {kind!r}")


_NAME_RE = f"the ({regex_alternatives(COLOURS)}) ({regex_alternatives(KINDS)})"
_PATTERNS = {
    "recolour": re.compile(f"make {_NAME_RE} ({regex_alternatives(COLOURS)})"),
    "move": re.compile(f"move {_NAME_RE} ({regex_alternatives(_destination(p) for p in POSITIONS)})"),
    "remove": re.compile(f"remove {_NAME_RE}"),
    "add": re.compile(f"add a ({regex_alternatives(COLOURS)}) ({regex_alternatives(KINDS)}) "
                      f"({regex_alternatives(place_phrase(p) for p in POSITIONS)})"),
    "background": re.compile(f"make the background ({regex_alternatives(BACKGROUNDS)})"),
}
_POSITION_OF = {**{_destination(p): p for p in POSITIONS}, **{place_phrase(p): p for p in POSITIONS}}


def parse_instruction(text: str, source: Scene) -> Edit:
    """The edit `text` asks of `source`; ValueError, saying why, on text no edit of it produces."""
    text = text.strip()
    for kind, pattern in _PATTERNS.items():
        match = pattern.fullmatch(text)
        if match is not None:
            break
    else:
        raise ValueError(f"not a shapes instruction: {text!r}; expected e.g. 'make the red circle blue', "
                         "'move the red circle to the top left', 'remove the red circle', "
                         "'add a blue square in the center' or 'make the background black'")
    groups = match.groups()
    if kind == "background":
        return background(source, groups[0])
    if kind == "add":
        return add(source, Shape(groups[1], groups[0], _POSITION_OF[groups[2]]))
    index = next((i for i, s in enumerate(source.shapes) if (s.colour, s.kind) == groups[:2]), None)
    if index is None:
        raise ValueError(f"the scene has no {groups[0]} {groups[1]}: it has "
                         + ", ".join(f"a {s.colour} {s.kind}" for s in source.shapes))
    if kind == "recolour":
        return recolour(source, index, groups[2])
    if kind == "move":
        return move(source, index, _POSITION_OF[groups[2]])
    return remove(source, index)


@dataclass(frozen=True)
class EditDataset:
    """An unlimited, reproducible dataset of edit pairs: item i depends on (seed, i) alone."""

    seed: int
    sizes: list[tuple[int, int]]  # (height, width) choices, each 32..256 px; one is drawn per item

    def drawn(self, index: int) -> tuple[Edit, tuple[int, int], int]:
        """(edit, (height, width), render seed) of item `index`."""
        rng = random.Random(f"edits:{self.seed}:{index}")
        edit = sample_edit(rng)
        return edit, rng.choice(self.sizes), rng.getrandbits(32)

    def item(self, index: int) -> tuple[np.ndarray, np.ndarray, Edit, tuple[int, int]]:
        """(source image, target image, edit, (height, width)) of item `index`, both [H, W, 3] uint8."""
        edit, (height, width), seed = self.drawn(index)
        return render(edit.source, width, height, seed), render(edit.target, width, height, seed), edit, (height, width)
