"""The masked edits `gouache bench edit` judges template replay on, and their contact sheet.

Each case is an image, the mask of what an edit repaints, the edit's prompt and its template's,
and a judge (the shapes checker's verdict on an output): a captioned scene with one shape
recoloured (`recolour_cases`), or on an instruction-edit model an instruction edit of a few cells
(`instruction_cases`).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from PIL import Image

from gouache.bench.fidelity import alignment, edit_rates
from gouache.bench.sheet import contact_sheet, difference
from gouache.data.checker import Check, EditCheck, check, check_edit
from gouache.data.edits import Edit, sample_edit
from gouache.data.shapes import COLOURS, Scene, caption, cell_box, render, sample_scene

OUTLINE = (255, 140, 0)  # the mask's border on the sheet: no shape or background has this colour


@dataclass(frozen=True)
class Case:
    """One masked edit of the fidelity measurement."""

    template: np.ndarray  # [H, W, 3] uint8: the image edited, and the template registered from it
    mask: np.ndarray  # [H, W] float32, 1 where the edit repaints
    prompt: str  # the edit's
    template_prompt: str  # the template's, registered with it
    judge: Callable[[np.ndarray], Check | EditCheck]  # the checker's verdict on an output


def recolour_cases(n: int, size: int) -> list[Case]:
    """A scene's shape recoloured, its grid cell the mask, the new caption the prompt (the
    template registered with the scene's own caption)."""
    rng = random.Random("edit-fidelity")
    cases = []
    for i in range(n):
        scene = sample_scene(rng)
        target = rng.randrange(len(scene.shapes))
        colour = rng.choice(sorted(set(COLOURS) - {s.colour for s in scene.shapes}))
        edited = Scene(tuple(replace(s, colour=colour) if j == target else s for j, s in enumerate(scene.shapes)),
                       scene.background)
        cases.append(Case(picture(scene, size, seed=i), cells_mask([scene.shapes[target].position], size),
                          caption(edited), caption(scene), functools.partial(check, scene=edited)))
    return cases


def instruction_cases(n: int, size: int) -> list[Case]:
    """Instruction edits of the kinds that change a few cells (recolour, move, remove, add) in
    turn, the cells they change the mask, the instruction the prompt of the edit and of its
    template; judged by `check_edit` (carried out, the rest kept)."""
    rng = random.Random("edit-fidelity-instructions")
    cases = []
    for i in range(n):
        edit = sample_edit(rng, LOCAL_KINDS[i % len(LOCAL_KINDS)])
        cases.append(Case(picture(edit.source, size, seed=i), cells_mask(changed_cells(edit), size),
                          edit.instruction, edit.instruction, functools.partial(check_edit, edit=edit)))
    return cases


LOCAL_KINDS = ("recolour", "move", "remove", "add")  # the edit kinds a mask of a few cells holds


def changed_cells(edit: Edit) -> list[str]:
    """The grid cells (`shapes.POSITIONS`) whose pixels a local edit changes."""
    if edit.kind == "remove":
        return [edit.removed.position]
    cells = [edit.target.shapes[edit.shape].position]
    if edit.kind == "move":
        cells.append(edit.source.shapes[edit.shape].position)
    return cells


def cells_mask(cells: list[str], size: int) -> np.ndarray:
    """[size, size] float32: 1 over the grid cells named."""
    mask = np.zeros((size, size), np.float32)
    for cell in cells:
        left, top, right, bottom = (round(v) for v in cell_box(cell, size, size))
        mask[top:bottom, left:right] = 1
    return mask


def rates(checks: list[Check | EditCheck]) -> dict[str, float]:
    """The share of outputs the checker passes: all right (a generation's checks), or carried
    out, rest kept and both (an instruction edit's)."""
    if checks and isinstance(checks[0], EditCheck):
        return edit_rates(checks)
    return {"all": alignment(checks)["all"]}


def picture(scene: Scene, size: int, seed: int) -> np.ndarray:
    """A scene's render at `size` (rendered at most 256 px, enlarged beyond)."""
    if size <= 256:
        return render(scene, size, size, seed=seed)
    small = Image.fromarray(render(scene, 256, 256, seed=seed))
    return np.asarray(small.resize((size, size), Image.Resampling.BICUBIC))


def outlined(image: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """`image` with the border of the mask's region drawn in `OUTLINE`."""
    inside = np.pad(mask > 0, 1)
    interior = inside[1:-1, 1:-1] & inside[:-2, 1:-1] & inside[2:, 1:-1] & inside[1:-1, :-2] & inside[1:-1, 2:]
    out = image.copy()
    out[(mask > 0) & ~interior] = OUTLINE
    return out


@dataclass(frozen=True)
class Shown:
    """One edit of the contact sheet: the exact output and the two replays."""

    case: Case
    exact: np.ndarray
    same_seed: np.ndarray  # replayed from a template registered with the edit's seed
    other_seed: np.ndarray  # ... with another seed


def write_sheet(shown: list[Shown], path: Path) -> None:
    """template (the mask outlined) | exact | replay, the edit's seed | replay, another seed |
    |exact - replay| x4 of each; the edit's prompt under each row."""
    titles = ["template, mask outlined", "exact edit", "replayed: template of the edit's seed",
              "replayed: template of another seed", "|exact - edit's seed| x4", "|exact - another seed| x4"]
    contact_sheet(titles, [([outlined(s.case.template, s.case.mask), s.exact, s.same_seed, s.other_seed,
                             difference(s.exact, s.same_seed), difference(s.exact, s.other_seed)], s.case.prompt)
                           for s in shown], path)
