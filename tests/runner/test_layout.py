import pytest
import torch

from gouache.runner.layout import NO_NEIGHBOUR, PatchLayout

SHAPES = [(8, 12), (4, 4), (8, 12), (4, 8)]  # caller order; two of one size, one non-square


def test_obc_orders_by_resolution_and_records_offsets():
    layout = PatchLayout.build(SHAPES, 4)
    assert layout.order == (1, 3, 0, 2)  # 4x4, 4x8, then both 8x12 in arrival order
    assert layout.request_offsets == (0, 1, 3, 9, 15)
    assert layout.resolution_offsets == (0, 1, 3, 15)
    assert layout.groups == ((0, 1, 1), (1, 1, 2), (2, 2, 6))
    assert layout.patch_image == (0, 1, 1) + (2,) * 6 + (3,) * 6


def test_neighbours_of_a_2x3_grid():
    layout = PatchLayout.build([(8, 12)], 4)
    # patches 0 1 2 / 3 4 5
    assert layout.patch_position[4] == (1, 1)
    assert layout.neighbours[0] == (NO_NEIGHBOUR, 1, NO_NEIGHBOUR, 3)
    assert layout.neighbours[4] == (3, 5, 1, NO_NEIGHBOUR)
    assert layout.neighbours[5] == (4, NO_NEIGHBOUR, 2, NO_NEIGHBOUR)


def test_split_cuts_the_right_pixels_and_merge_restores_every_image():
    images = [torch.randn(3, h, w) for h, w in SHAPES]
    layout = PatchLayout.build(SHAPES, 4)
    patches = layout.split(images)
    assert patches.shape == (15, 3, 4, 4)
    # the second patch of image 0 (layout position 2) is its row 0, col 1 block
    first = layout.request_offsets[2]
    assert torch.equal(patches[first + 1], images[0][:, 0:4, 4:8])
    assert all(torch.equal(a, b) for a, b in zip(layout.merge(patches), images))


def test_neighbour_indices_point_at_the_adjacent_blocks():
    layout = PatchLayout.build(SHAPES, 4)
    for index, (left, right, top, bottom) in enumerate(layout.neighbours):
        for other, (dr, dc) in ((left, (0, -1)), (right, (0, 1)), (top, (-1, 0)), (bottom, (1, 0))):
            row, col = layout.patch_position[index]
            rows, cols = layout.grid(layout.patch_image[index])
            inside = 0 <= row + dr < rows and 0 <= col + dc < cols
            assert (other != NO_NEIGHBOUR) == inside
            if inside:
                assert layout.patch_image[other] == layout.patch_image[index]
                assert layout.patch_position[other] == (row + dr, col + dc)


def test_merge_works_at_a_downsampled_level():
    layout = PatchLayout.build(SHAPES, 4)
    halves = [torch.randn(5, h // 2, w // 2) for h, w in SHAPES]
    half_patches = PatchLayout.build([(h // 2, w // 2) for h, w in SHAPES], 2).split(halves)
    assert all(torch.equal(a, b) for a, b in zip(layout.merge(half_patches), halves))


def test_sizes_must_be_multiples_of_the_patch():
    with pytest.raises(ValueError, match="multiple of the patch size 4"):
        PatchLayout.build([(8, 6)], 4)
