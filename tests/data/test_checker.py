import random

import numpy as np

from gouache.data.checker import Degrade, accuracy, check, largest_blob, mutate
from gouache.data.shapes import Scene, Shape, render

SIZES = [(64, 64), (96, 64), (64, 128), (128, 128)]


def test_largest_blob_keeps_one_8_connected_component():
    mask = np.zeros((8, 8), bool)
    mask[0:2, 0:2] = True  # 4 pixels
    mask[4:7, 4:7] = True  # 9 pixels
    mask[7, 7] = True  # diagonal neighbour of the 3x3 block: joins it
    blob = largest_blob(mask)
    assert blob.sum() == 10 and not blob[0, 0] and blob[7, 7]


def test_checker_accepts_its_own_clean_and_degraded_renders():
    for degrade in (None, Degrade(blur_radius=1.5, noise_sigma=12.0, seed=1)):
        result = accuracy(150, seed=1, sizes=SIZES, degrade=degrade)
        for attribute in ("colour", "shape", "position", "all"):
            assert result[attribute] >= 0.98, (degrade, attribute, result)
        assert result["false_accept"] <= 0.02, (degrade, result)


def test_checker_rejects_each_kind_of_mismatch():
    scene = Scene((Shape("triangle", "red", "top left"), Shape("circle", "blue", "bottom")), "gray")
    image = render(scene, 96, 96, seed=0)
    assert check(image, scene).all_ok
    wrong_colour = check(image, Scene((Shape("triangle", "green", "top left"), scene.shapes[1]), "gray"))
    wrong_kind = check(image, Scene((Shape("square", "red", "top left"), scene.shapes[1]), "gray"))
    wrong_place = check(image, Scene((Shape("triangle", "red", "top right"), scene.shapes[1]), "gray"))
    assert not wrong_colour.colour_ok and wrong_colour.shapes[1].colour_ok
    assert wrong_kind.colour_ok and not wrong_kind.shape_ok and wrong_kind.position_ok
    assert wrong_place.colour_ok and wrong_place.shape_ok and not wrong_place.position_ok


def test_mutate_changes_exactly_the_named_attribute():
    scene = Scene((Shape("square", "red", "top"), Shape("circle", "cyan", "left")), "white")
    rng = random.Random(0)
    for attribute in ("colour", "kind", "position"):
        changed = mutate(scene, rng, attribute)
        diffs = [(a, b) for a, b in zip(scene.shapes, changed.shapes) if a != b]
        assert len(diffs) == 1 and getattr(diffs[0][0], attribute) != getattr(diffs[0][1], attribute)


def test_blank_image_has_no_shapes():
    blank = np.full((64, 64, 3), 255, np.uint8)
    result = check(blank, Scene((Shape("circle", "red", "center"),), "white"))
    assert not result.colour_ok and not result.all_ok
