"""The block cache's bookkeeping on plain tensors: decisions, merges, stale fills, budget."""

import torch

from gouache.block_cache.store import BlockCache
from gouache.config import BlockCacheConfig

BLOCK = "block"


def run_block(cache_pass, x: torch.Tensor, block=BLOCK, calls: list | None = None) -> torch.Tensor:
    """A block computing 2x + 1 on the units the cache selects; records which it computed."""
    computed = cache_pass.select(block, x)
    rows = x if computed is None else x[computed]
    if calls is not None:
        calls.append(None if computed is None else computed.tolist())
    fresh = [2 * rows + 1] if len(rows) else None
    return cache_pass.merge(block, x, computed, fresh)[0]


def units(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).reshape(-1, 1).repeat(1, 4)


def test_exact_requests_make_no_pass_and_hold_nothing():
    cache = BlockCache(BlockCacheConfig(threshold=0.0))
    assert cache.begin([("a", 0)], [2], [0.0], "patch") is None
    cache_pass = cache.begin([("a", 0), ("b", 0)], [2, 1], [0.0, 0.5], "patch")
    run_block(cache_pass, units(1, 2, 3))
    cache_pass.end()
    assert cache.nbytes == 2 * 4 * 4  # b's one unit: its input and output, 4 floats each; nothing of a
    assert cache.computed == 1


def test_a_unit_is_reused_below_its_threshold_and_at_most_max_reuse_times_in_a_row():
    cache = BlockCache(BlockCacheConfig(max_reuse=2))
    calls = []
    steps = [units(1.0, 10.0), units(1.05, 20.0), units(1.05, 30.0), units(1.05, 40.0)]
    outs = []
    for x in steps:
        cache_pass = cache.begin([("a", 0)], [2], [0.1], "patch")
        outs.append(run_block(cache_pass, x, calls=calls))
        cache_pass.end()
    # step 0: nothing cached; 1, 2: unit 0 changed 5 % < 10 %, reused; 3: reused twice in a row already
    assert calls == [None, [1], [1], None]
    assert torch.equal(outs[1][0], outs[0][0]) and torch.equal(outs[2][0], outs[0][0])
    assert torch.equal(outs[3][0], 2 * steps[3][0] + 1)
    assert [torch.equal(o[1], 2 * x[1] + 1) for o, x in zip(outs, steps)] == [True] * 4
    assert (cache.reused, cache.computed) == (2, 6)


def test_the_change_is_measured_against_the_input_when_last_computed():
    cache = BlockCache(BlockCacheConfig(max_reuse=10))
    calls = []
    for value in (1.0, 1.06, 1.12):  # 6 % then 12 % from the computed 1.0: reused once, then computed
        cache_pass = cache.begin([("a", 0)], [1], [0.1], "image")
        run_block(cache_pass, units(value), calls=calls)
    assert calls == [None, [], None]


def test_every_unit_reused_skips_the_block_and_keeps_the_output_shape():
    cache = BlockCache()
    x = units(1, 2, 3)
    first = run_block(cache.begin([("a", 0), ("b", 0)], [1, 2], [0.5, 0.5], "patch"), x)
    calls = []
    again = run_block(cache.begin([("a", 0), ("b", 0)], [1, 2], [0.5, 0.5], "patch"), x, calls=calls)
    assert calls == [[]] and torch.equal(again, first)


def test_a_new_unit_layout_starts_the_image_afresh():
    cache = BlockCache()
    run_block(cache.begin([("a", 0)], [1], [0.5], "image"), units(1))
    calls = []
    run_block(cache.begin([("a", 0)], [4], [0.5], "patch"), units(1, 1, 1, 1), calls=calls)
    assert calls == [None]


def test_stale_fills_the_units_not_computed_with_their_last_input():
    cache = BlockCache()
    keys, counts = [("a", 0), ("b", 0)], [2, 1]
    first = cache.begin(keys, counts, [0.5, 0.5], "patch")
    assert torch.equal(first.stale("op", units(1, 2, 3), None), units(1, 2, 3))
    second = cache.begin(keys, counts, [0.5, 0.5], "patch")
    full = second.stale("op", units(7), torch.tensor([1]))
    assert torch.equal(full, units(1, 7, 3))
    third = cache.begin(keys, counts, [0.5, 0.5], "patch")
    assert torch.equal(third.stale("op", units(8, 9), torch.tensor([0, 2])), units(8, 7, 9))


def test_over_budget_the_newest_request_is_evicted_and_runs_exact_from_then_on():
    cache = BlockCache(BlockCacheConfig(budget_bytes=40))  # one unit's input + output (32 bytes) fits
    cache_pass = cache.begin([("old", 0)], [1], [0.5], "image")
    run_block(cache_pass, units(1))
    cache_pass.end()
    assert (cache.evictions, cache.nbytes) == (0, 32)
    cache_pass = cache.begin([("old", 0), ("new", 0)], [1, 1], [0.5, 0.5], "image")
    run_block(cache_pass, units(1, 2))
    cache_pass.end()  # 64 bytes: "new" goes, with the store it shares with "old"
    assert (cache.evictions, cache.nbytes) == (1, 0)
    assert cache.threshold("new", 0.5) == 0.0 and cache.threshold("old", 0.5) == 0.5
    calls = []
    run_block(cache.begin([("old", 0), ("new", 0)], [1, 1], [0.5, 0.0], "image"), units(1, 2), calls=calls)
    assert calls == [None]  # "old" lost its rows with the shared store: computed afresh, "new" exact
    cache.release("new")
    assert cache.begin([("new", 0)], [1], [0.5], "image") is not None  # released: may be cached again


def test_release_forgets_a_request_before_the_next_forward():
    cache = BlockCache()
    cache_pass = cache.begin([("a", 0), ("a", 1)], [1, 1], [0.5, 0.5], "image")
    run_block(cache_pass, units(1, 2))
    cache_pass.end()
    assert cache.nbytes > 0
    cache.release("a")
    cache.settle()  # between steps, whether or not a cached forward follows
    assert cache.nbytes == 0
    calls = []
    run_block(cache.begin([("a", 0), ("a", 1)], [1, 1], [0.5, 0.5], "image"), units(1, 2), calls=calls)
    assert calls == [None]


def test_the_server_default_applies_unless_a_request_sends_its_own():
    cache = BlockCache(BlockCacheConfig(threshold=0.2))
    assert (cache.threshold("a", None), cache.threshold("a", 0.0), cache.threshold("a", 0.05)) == (0.2, 0.0, 0.05)
