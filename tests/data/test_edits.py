"""Instruction edits of shapes scenes: every kind parses back exactly, renders leave what an edit
keeps pixel for pixel, and the edit checker tells a carried-out edit from an undone one and a kept
rest from a changed one."""

import random

import numpy as np
import pytest

from gouache.data.checker import check_edit, edit_accuracy
from gouache.data.edits import EDIT_KINDS, EditDataset, parse_instruction, sample_edit
from gouache.data.shapes import Scene, Shape, cell_box, render


@pytest.mark.parametrize("kind", EDIT_KINDS)
def test_every_kind_of_edit_changes_what_it_says_and_parses_back(kind):
    rng = random.Random(kind)
    for _ in range(30):
        edit = sample_edit(rng, kind)
        assert parse_instruction(edit.instruction, edit.source) == edit
        source, target = edit.source, edit.target
        if kind == "background":
            assert target.shapes == source.shapes and target.background != source.background
            continue
        assert target.background == source.background
        n = len(source.shapes)
        assert len(target.shapes) == {"remove": n - 1, "add": n + 1}.get(kind, n)
        kept = [s for s in source.shapes if s in target.shapes]
        assert len(kept) == len(source.shapes) - (kind != "add")  # one shape changed or gone, or none


def test_an_instruction_names_the_problem_when_it_does_not_fit_its_scene():
    scene = Scene((Shape("circle", "red", "top left"),), "white")
    assert parse_instruction("move the red circle to the center", scene).target.shapes[0].position == "center"
    assert parse_instruction("add a blue square in the center", scene).target.shapes[1] == Shape(
        "square", "blue", "center")
    for text, message in (("make the blue circle red", "no blue circle"), ("make the red circle red", "already"),
                          ("remove the red circle", "only shape"), ("make the background white", "already"),
                          ("paint it black", "not a shapes instruction"),
                          ("add a blue square at the top left", "distinct grid cells")):
        with pytest.raises(ValueError, match=message):
            parse_instruction(text, scene)


def test_what_an_edit_keeps_keeps_its_pixels():
    data = EditDataset(0, [(96, 128)])
    seen = set()
    for index in range(40):
        source, target, edit, (height, width) = data.item(index)
        assert np.array_equal(source, data.item(index)[0])  # item i depends on (seed, i) alone
        if edit.kind not in ("recolour", "remove", "add", "move"):
            continue
        seen.add(edit.kind)
        cells = {s.position for s in edit.source.shapes} ^ {s.position for s in edit.target.shapes}
        cells |= {s.position for s in edit.target.shapes if s not in edit.source.shapes}
        differ = np.zeros((height, width), bool)
        for cell in cells:
            left, top, right, bottom = (round(v) for v in cell_box(cell, width, height))
            differ[top:bottom, left:right] = True
        assert np.array_equal(source[~differ], target[~differ])  # outside the edited cells, every pixel
        assert not np.array_equal(source[differ], target[differ])
    assert seen == {"recolour", "remove", "add", "move"}


def test_the_edit_checker_accepts_exact_edits_and_rejects_undone_ones_and_other_changes():
    edit = parse_instruction("make the red circle blue", Scene((Shape("circle", "red", "top left"),
                                                                Shape("square", "green", "center")), "white"))
    target, source = render(edit.target, 96, 96, 3), render(edit.source, 96, 96, 3)
    assert (check_edit(target, edit).carried_out, check_edit(target, edit).rest_kept) == (True, True)
    assert (check_edit(source, edit).carried_out, check_edit(source, edit).rest_kept) == (False, True)
    moved = render(Scene((edit.target.shapes[0], Shape("square", "green", "right")), "white"), 96, 96, 3)
    assert (check_edit(moved, edit).carried_out, check_edit(moved, edit).rest_kept) == (True, False)
    both = render(Scene(edit.target.shapes + (Shape("circle", "red", "bottom"),), "white"), 96, 96, 3)
    assert not check_edit(both, edit).carried_out  # recoloured, but the red circle is still there
    rates = edit_accuracy(30, 0, [(96, 96), (128, 64)])
    assert rates["carried_out"] == rates["rest_kept"] == 1.0
    assert all(v == 0 for v in rates["false_accept"].values())
