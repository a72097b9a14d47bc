import random

import numpy as np
import pytest

from gouache.data.shapes import (
    BACKGROUNDS,
    COLOURS,
    Scene,
    Shape,
    ShapesDataset,
    caption,
    parse_caption,
    render,
    sample_scene,
)


def test_dataset_items_depend_on_seed_and_index_alone():
    a, b = ShapesDataset(3, [(64, 64), (96, 64)]), ShapesDataset(3, [(64, 64), (96, 64)])
    for index in (0, 7, 123456):
        image_a, caption_a, scene_a, size_a = a.item(index)
        image_b, caption_b, scene_b, size_b = b.item(index)
        assert np.array_equal(image_a, image_b) and (caption_a, scene_a, size_a) == (caption_b, scene_b, size_b)
    assert (a.item(0)[1] != ShapesDataset(4, [(64, 64)]).item(0)[1]
            or a.item(1)[1] != ShapesDataset(4, [(64, 64)]).item(1)[1])


def test_caption_round_trips_over_many_scenes():
    rng = random.Random(0)
    for _ in range(2000):
        scene = sample_scene(rng)
        assert parse_caption(caption(scene)) == scene


def test_caption_reads_naturally():
    scene = Scene((Shape("circle", "red", "top left"), Shape("square", "blue", "center")), "white")
    assert caption(scene) == "a red circle at the top left and a blue square in the center on a white background"


@pytest.mark.parametrize(
    "text",
    [
        "a red circle",
        "a brown circle at the top on a white background",
        "a red circle at the top, a blue square at the left on a white background",  # no "and"
        "a red circle at the top and a red square at the left on a white background",  # same colour
        "a red circle at the top and a blue square at the top on a white background",  # same cell
        "a red circle at the top on a red background",
    ],
)
def test_parse_caption_refuses_non_captions(text):
    with pytest.raises(ValueError):
        parse_caption(text)


@pytest.mark.parametrize("size", [(32, 32), (64, 64), (96, 64), (64, 128), (256, 200)])
def test_render_has_the_asked_size_and_only_scene_colours_in_cell_centres(size):
    width, height = size
    scene = Scene((Shape("square", "green", "center"), Shape("circle", "yellow", "bottom right")), "black")
    image = render(scene, width, height, seed=1)
    assert image.shape == (height, width, 3) and image.dtype == np.uint8
    assert tuple(image[height // 2, width // 2]) == COLOURS["green"]
    assert tuple(image[5 * height // 6, 5 * width // 6]) == COLOURS["yellow"]
    assert tuple(image[0, 0]) == BACKGROUNDS["black"]


def test_circle_stays_round_in_a_non_square_image():
    image = render(Scene((Shape("circle", "red", "center"),), "white"), 192, 64)
    ys, xs = np.nonzero((image == COLOURS["red"]).all(axis=-1))
    assert abs((xs.max() - xs.min()) - (ys.max() - ys.min())) <= 1


def test_render_refuses_out_of_range_sizes():
    with pytest.raises(ValueError, match="32 to 256"):
        render(Scene((Shape("circle", "red", "center"),), "white"), 16, 64)



def test_a_layout_map_marks_each_shape_where_render_draws_it_in_the_grey_of_its_place():
    from gouache.data.shapes import LAYOUT_LEVELS, layout_map, unplaced_caption

    rng = random.Random(3)
    scene = next(s for s in (sample_scene(rng) for _ in range(100)) if len(s.shapes) == 3)
    image, layout = render(scene, 96, 64, seed=5), layout_map(scene, 96, 64, seed=5)
    drawn = (image != np.array(BACKGROUNDS[scene.background])).any(axis=2)
    assert ((layout[..., 0] > 0) == drawn).mean() > 0.99  # the same silhouettes (edges may antialias apart)
    assert set(np.unique(layout)) <= {0, *LAYOUT_LEVELS} and len(np.unique(layout)) == 4
    assert unplaced_caption(scene).count(" at the ") == unplaced_caption(scene).count(" in the center") == 0
    assert unplaced_caption(scene).endswith(f"on a {scene.background} background")
