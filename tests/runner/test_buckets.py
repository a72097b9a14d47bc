"""Bucket choice for compiled graphs (`gouache.runner.buckets`): plain values, no model."""

import itertools

import pytest

from gouache.config import COMPILE_GRAPHS
from gouache.runner.buckets import Buckets, Range, choose, series


def test_a_series_splits_the_bucket_that_pads_most_at_its_geometric_mean():
    assert series(Range("rows", 1, 32), 1) == (32,)
    assert series(Range("rows", 1, 32), 2) == (6, 32)  # ceil(sqrt(1 x 32)): 1 pads to 6, 7 to 32
    assert series(Range("rows", 1, 32), 3) == (3, 6, 32)
    assert series(Range("rows", 5, 5), 4) == (5,)
    for n in range(1, 40):  # a larger budget keeps every bucket of a smaller one
        assert set(series(Range("tokens", 80, 5000, 64), n)) <= set(series(Range("tokens", 80, 5000, 64), n + 1))
    assert series(Range("rows", 1, 32), 100) == tuple(range(1, 33))  # every size its own bucket, then no more


def test_aligned_buckets_are_multiples_of_the_alignment_and_the_last_holds_the_largest():
    buckets = series(Range("tokens", 80, 5000, 64), 8)
    assert all(b % 64 == 0 for b in buckets) and buckets[0] >= 128 and buckets[-1] == 5056
    assert list(buckets) == sorted(set(buckets)) and len(buckets) <= 8


def test_the_budget_holds_over_every_kind_and_each_kind_gets_a_bucket():
    ranges = [Range("rows", 1, 32), Range("tokens", 80, 5000, 64), Range("computed", 16, 1024, 16)]
    for graphs in (3, 4, 7, 16, COMPILE_GRAPHS, 100):
        buckets = choose(ranges, graphs)
        assert len(buckets) <= graphs and set(buckets.by_kind) == {"rows", "tokens", "computed"}
        for r in ranges:  # the largest step of every kind compiles
            assert buckets.bucket(r.kind, r.hi) is not None and buckets.bucket(r.kind, r.hi + r.align) is None


def test_more_graphs_never_pad_more_and_a_wide_range_gets_more_buckets_than_a_narrow_one():
    wide, narrow = Range("tokens", 64, 8192, 64), Range("rows", 1, 4)
    worst = []
    for graphs in range(2, 40):
        buckets = choose([wide, narrow], graphs)
        worst.append(max(buckets.bucket("tokens", s) / s for s in range(wide.lo, wide.hi + 1)))
        if graphs >= 8:
            assert len(buckets.by_kind["tokens"]) > len(buckets.by_kind["rows"])
    assert all(a >= b for a, b in itertools.pairwise(worst)), worst
    # 38 buckets over 64..8192 tokens: the alignment pads 65 tokens to 128, but no step of 512 or more by a quarter
    assert max(buckets.bucket("tokens", s) / s for s in range(512, wide.hi + 1)) < 1.25


def test_a_range_of_known_steps_puts_its_buckets_on_them():
    """A packed forward's token counts are known from the compiled sizes (`Range.of_steps`):
    the buckets are steps, split where they leave the least padding on either side, and a
    step pads only to the next known step up."""
    known = Range.of_steps("tokens x8", [3072, 3584, 4608, 5120, 6656], 64)
    assert (known.lo, known.hi) == (3072, 6656)
    assert series(known, 1) == (6656,)
    assert series(known, 2) == (3584, 6656)  # 3072 pads by 1.17 to it, 4608 by 1.44 to 6656: the least
    assert series(known, 5) == series(known, 9) == (3072, 3584, 4608, 5120, 6656)  # each its own, then no more
    for n in range(1, 6):
        assert set(series(known, n)) <= set(series(known, n + 1))
    assert Range.of_steps("t", [100, 65], 64).steps == (128,)  # aligned, once
    with pytest.raises(ValueError, match="at least one step"):
        Range.of_steps("t", [], 64)


def test_every_size_maps_to_the_smallest_bucket_that_holds_it():
    buckets = choose([Range("patches", 1, 200)], 6)
    series_ = buckets.by_kind["patches"]
    for size in range(1, 201):
        b = buckets.bucket("patches", size)
        assert b >= size and not any(size <= c < b for c in series_)
    assert buckets.bucket("patches", 201) is None and buckets.bucket("tokens", 1) is None


def test_a_narrow_range_stops_taking_buckets_once_each_size_has_one():
    buckets = choose([Range("rows", 1, 3), Range("tokens", 64, 640, 64)], 32)
    assert buckets.by_kind == {"rows": (1, 2, 3), "tokens": (64, 128, 192, 256, 320, 384, 448, 512, 576, 640)}
    assert "rows 1, 2, 3; tokens 64" in buckets.describe()


@pytest.mark.parametrize("bad", [lambda: Range("rows", 0, 4), lambda: Range("rows", 5, 4),
                                 lambda: Range("rows", 1, 4, align=0), lambda: series(Range("rows", 1, 4), 0),
                                 lambda: choose([Range("rows", 1, 4), Range("rows", 1, 8)], 8),
                                 lambda: choose([Range("rows", 1, 4), Range("tokens", 64, 128)], 1)])
def test_impossible_ranges_and_budgets_say_what_to_fix(bad):
    with pytest.raises(ValueError, match="range|graphs|kind"):
        bad()


def test_buckets_count_their_graphs():
    assert len(Buckets({"rows": (1, 2), "tokens": (64,)})) == 3
