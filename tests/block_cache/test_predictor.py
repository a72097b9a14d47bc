"""The reuse predictor (PatchedServe §7): the forest evaluated from its arrays equals scikit-learn's,
the recorder's samples are the changes it should see, decisions follow the forest and the
request's cut-off, and training scores how well the forest and the threshold rank the units
(refusing another model's predictor: tests/engine/test_block_cache.py)."""

import json
import math

import numpy as np
import pytest
import torch

from gouache.block_cache.predictor import FEATURES, KIND, Recorder, ReusePredictor, predicted, train
from gouache.block_cache.store import BlockCache
from gouache.config import BlockCacheConfig
from tests.block_cache.test_store import run_block, units


def split_on_change(at: float, reusable: float = 1.0, model: str = "model") -> ReusePredictor:
    """One tree: P(reusable) = `reusable` when the input's relative change is <= `at`, else 0."""
    tree = dict(feature=[[0, 0, 0]], threshold=[[at, 0.0, 0.0]], left=[[1, 1, 2]], right=[[2, 1, 2]])
    arrays = [torch.tensor(v, dtype=d) for v, d in ((tree["feature"], torch.long), (tree["threshold"], torch.float64),
                                                    (tree["left"], torch.long), (tree["right"], torch.long),
                                                    ([[0.5, reusable, 0.0]], torch.float32))]
    return ReusePredictor(model, "test", 0.05, *arrays, depth=1)


def test_the_forest_as_arrays_equals_scikit_learns_predict_proba_and_survives_its_file(tmp_path):
    from sklearn.ensemble import RandomForestClassifier

    rng = np.random.default_rng(0)
    X = rng.normal(size=(600, len(FEATURES))).astype(np.float32)
    y = (X[:, 0] + 0.5 * X[:, 2] * X[:, 3] + 0.3 * rng.normal(size=600)) < 0.2
    forest = RandomForestClassifier(16, max_depth=6, random_state=0).fit(X[:400], y[:400])
    predictor = ReusePredictor.from_forest(forest, "model", "test", 0.05)
    ours = predictor.probability(X[400:])
    theirs = forest.predict_proba(X[400:])[:, list(forest.classes_).index(True)]
    np.testing.assert_allclose(ours, theirs, atol=1e-6)
    assert 0 < theirs.mean() < 1  # the held-out rows are not all one class
    # on a threshold itself (a float64 that no float32 equals), each side's choice is scikit-learn's
    on = np.repeat(X[400:401], len(FEATURES) * 8, 0)
    tree = forest.estimators_[0].tree_
    for i, (f, t) in enumerate(zip(tree.feature[:8], tree.threshold[:8])):
        if f >= 0:
            on[i, f], on[8 + i, f] = np.float32(t), np.nextafter(np.float32(t), np.float32(np.inf))
    np.testing.assert_allclose(predictor.probability(on),
                               forest.predict_proba(on)[:, list(forest.classes_).index(True)], atol=1e-6)
    predictor.save(tmp_path / "p.json")
    loaded = ReusePredictor.load(tmp_path / "p.json", "model")
    assert np.array_equal(loaded.probability(X[400:]), ours)


def test_the_recorder_sees_each_units_input_change_and_the_error_reuse_would_have_made():
    recorder = Recorder()
    cache = BlockCache(BlockCacheConfig(), recorder.pass_type())
    context = [(0.25, 12.0), (0.5, 13.0)]
    for x in (units(1.0, 10.0), units(1.05, 20.0)):
        cache_pass = cache.begin([("a", 0), ("b", 0)], [1, 1], [0.5, 0.5], "patch", context)
        assert torch.equal(run_block(cache_pass, x), 2 * x + 1)  # every unit computed
        cache_pass.end()
    features, errors = recorder.samples()
    change = np.array([0.05, 1.0])
    np.testing.assert_allclose(features[:, 0], change, rtol=1e-6)
    np.testing.assert_allclose(features[:, 1], np.array([0.05 ** 2, 1.0]), rtol=1e-5)  # relative MSE
    np.testing.assert_allclose(features[:, 2:], [[0.25, 0, 12, 1], [0.5, 0, 13, 1]])  # progress, block, pixels, part
    np.testing.assert_allclose(errors, [(3.1 - 3.0) / 3.1, (41 - 21) / 41], rtol=1e-6)  # outputs 2x + 1


def test_a_unit_reuses_where_the_forest_says_so_at_its_requests_cut_off():
    cache = BlockCache(BlockCacheConfig(), predicted(split_on_change(0.1, reusable=0.7)))
    calls = []
    for x, value in ((units(1.0, 10.0), 0.5), (units(1.05, 12.0), 0.5), (units(1.05, 15.0), 0.2)):
        cache_pass = cache.begin([("a", 0), ("b", 0)], [1, 1], [value, value], "image")
        run_block(cache_pass, x, calls=calls)
        cache_pass.end()
    # first: nothing cached; then a (change 0.05: P = 0.7 > 1 - 0.5) is reused and b (0.2: P = 0)
    # computed; at a value of 0.2 a needs P > 0.8, and both are computed
    assert calls == [None, [1], None]
    assert cache.take_report().decide_s > 0


def test_the_features_of_a_large_unit_read_a_sample_that_estimates_its_change():
    from gouache.block_cache.predictor import SAMPLE, sample, unit_features

    generator = torch.Generator().manual_seed(0)
    then = torch.randn(3, 320, 32, 32, generator=generator)
    x = then + torch.tensor([0.01, 0.1, 1.0]).reshape(3, 1, 1, 1) * torch.randn(then.shape, generator=generator)
    assert (SAMPLE <= sample(x).shape[1] <= 2 * SAMPLE
            and torch.equal(sample(x[:, :1, :4, :4]), x[:, :1, :4, :4].flatten(1)))
    features = unit_features(then, x, np.zeros((3, 3), np.float32), 0)
    full = (x - then).flatten(1).abs().mean(1) / then.flatten(1).abs().mean(1)
    np.testing.assert_allclose(features[:, 0], full.numpy(), rtol=0.05, atol=0)


def test_training_scores_how_well_the_forest_and_the_threshold_rank_reusable_units_per_kind():
    rng = np.random.default_rng(0)
    features = rng.uniform(size=(4000, len(FEATURES))).astype(np.float32)
    features[:, FEATURES.index("part")] = np.arange(4000) % 2
    change, progress = FEATURES.index("change"), FEATURES.index("progress")
    # whole images: reuse is safe late in a request whatever the change; parts: where the change is small
    errors = np.where(features[:, FEATURES.index("part")] == 0, 1 - features[:, progress], features[:, change])
    auc = train(features, errors.astype(np.float32), 0.5, "model", "test", trees=8, depth=4).report["holdout_auc"]
    assert auc["image"]["units"] + auc["part"]["units"] == 800  # the 20 % held out
    assert auc["image"]["forest"] > 0.95 and abs(auc["image"]["threshold"] - 0.5) < 0.1
    assert auc["part"]["forest"] > 0.95 and auc["part"]["threshold"] == 1.0
    only_images = features[features[:, FEATURES.index("part")] == 0]
    assert train(only_images, errors[::2].astype(np.float32), 0.5, "m", "t", 4, 3).report["holdout_auc"]["part"] is None


def forest_data(**changes) -> dict:
    """`split_on_change(0.1)`'s file as JSON data (one tree: a root and two leaves), with `changes`."""
    data = {"kind": KIND, "model": "model", "model_name": "test", "bound": 0.05, "features": list(FEATURES),
            "depth": 1, "report": {}, "feature": [[0, 0, 0]], "threshold": [[0.1, 0.0, 0.0]], "left": [[1, 1, 2]],
            "right": [[2, 1, 2]], "reusable": [[0.5, 1.0, 0.0]]}
    return {**data, **changes}


def node(name: str, tree: int, index: int, value) -> dict:
    """forest_data's array `name` with one node's value changed (in a copy of a forest of two trees)."""
    arrays = {key: [list(row), list(row)] for key, row in ((k, forest_data()[k][0]) for k in
                                                          ("feature", "threshold", "left", "right", "reusable"))}
    arrays[name][tree][index] = value
    return arrays


def write_forest(tmp_path, data: dict) -> str:
    path = tmp_path / "predictor.json"
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize("damage, why", [
    # feature indices: one of FEATURES, never past them (the walk would read another unit's) nor negative
    (node("feature", 1, 0, len(FEATURES)), "tree 1: feature[0] must be a feature index in [0, 6), got 6"),
    (node("feature", 0, 0, -1), "tree 0: feature[0] must be a feature index in [0, 6), got -1"),
    (node("feature", 0, 0, 10**400), "feature must hold only 64-bit integers"),
    (node("feature", 0, 0, 1.5), "feature must hold only 64-bit integers"),
    (node("feature", 0, 0, "0"), "feature must hold only 64-bit integers"),
    # children: inside the tree, and forward, so that a walk ends on a leaf
    (node("left", 1, 0, 3), "tree 1: left[0] must be a node index in [0, 3), got 3"),
    (node("right", 0, 2, -1), "tree 0: right[2] must be a node index in [0, 3), got -1"),
    (node("right", 0, 0, 2**63), "right must hold only 64-bit integers"),
    (node("left", 0, 0, 0), "tree 0: node 0's children (0, 2) must both be itself (a leaf) or both come after it"),
    (node("left", 1, 1, 0), "tree 1: node 1's children (0, 1) must both be itself (a leaf) or both come after it"),
    # numbers: finite, and probabilities
    *((node("threshold", 0, 0, x), "tree 0: threshold[0] must be a finite number")
      for x in (math.nan, math.inf, -math.inf)),
    (node("threshold", 0, 0, 10**400), "threshold must hold only numbers"),
    (node("threshold", 0, 0, None), "threshold must hold only numbers"),
    *((node("reusable", 0, 1, x), "tree 0: reusable[1] must be a probability in [0, 1]")
      for x in (math.nan, math.inf, 1.0000001, -1e-9, 1e308, -1e308)),
    # shapes: the same trees in every array, at least one of at least one node, and not huge
    ({"feature": []}, "feature must be a list of 1 to 4096 trees"),
    ({"left": [[]]}, "left's trees must have the same number of nodes, at least one"),
    ({"right": [[2, 1, 2], [2]]}, "right's trees must have the same number of nodes"),
    ({"threshold": [[0.1, 0.0]]}, "threshold has 1 trees of 2 nodes, feature 1 of 3"),
    ({"reusable": [[[0.5], [1.0], [0.0]]]}, "reusable must hold only numbers"),
    ({"feature": "0"}, "feature must be a list of 1 to 4096 trees"),
    ({"feature": [[0]] * 4097}, "feature must be a list of 1 to 4096 trees"),
    ({"left": None}, "left must be a list of 1 to 4096 trees"),
    # the depth a walk takes: enough to reach every leaf, and bounded
    ({"depth": 0}, "tree 0: a walk from its root is at node 0, not a leaf, after depth 0 levels"),
    *(({"depth": x}, "depth must be an integer in [0, 64]") for x in (-1, 65, 1.5, True, 10**400, None, math.nan)),
    *(({"bound": x}, "bound must be a relative output error in (0, 1)")
      for x in (math.nan, math.inf, -0.0, 0, 1e308, -1e308, 10**400, "0.05")),
])
def test_a_damaged_forest_is_refused_at_load_naming_the_array_and_tree(damage, why, tmp_path):
    path = write_forest(tmp_path, forest_data(**damage))
    with pytest.raises(ValueError, match="block-cache predictor .*: malformed: ") as refused:
        ReusePredictor.load(path, "model")
    assert why in str(refused.value) and "gouache profile --reuse" in str(refused.value)


def test_a_forest_past_the_node_bound_is_refused_before_numpy_builds_it(tmp_path, monkeypatch):
    from gouache.block_cache import forest_check

    monkeypatch.setattr(forest_check, "MAX_NODES", 8)  # the real bound (4M nodes) is 100 MB of JSON
    data = forest_data(**{name: [row[0]] * 3 for name, row in forest_data().items()  # 3 trees of 3 nodes
                          if name in ("feature", "threshold", "left", "right", "reusable")})
    with pytest.raises(ValueError, match="feature holds more than 8 nodes"):
        ReusePredictor.load(write_forest(tmp_path, data), "model")


def test_a_forest_at_the_ends_of_the_ranges_loads_and_decides(tmp_path):
    """Thresholds at a float's extremes (past float32's: `_pack` rounds them to its largest),
    a leaf alone at depth 0, more depth than a tree needs, and padding past a tree's nodes."""
    units = np.array([[0.0] * len(FEATURES), [1e30] + [0.0] * (len(FEATURES) - 1)], np.float32)
    for at, expected in ((1e308, [1.0, 1.0]), (-1e308, [0.0, 0.0]), (5e-324, [1.0, 0.0]), (-5e-324, [0.0, 0.0])):
        loaded = ReusePredictor.load(write_forest(tmp_path, forest_data(threshold=[[at, 0.0, 0.0]],
                                                                         reusable=[[0.5, 1.0, 0.0]])), "model")
        np.testing.assert_array_equal(loaded.probability(units), expected)
    leaf = {"feature": [[0]], "threshold": [[0.0]], "left": [[0]], "right": [[0]], "reusable": [[0.25]], "depth": 0}
    np.testing.assert_array_equal(ReusePredictor.load(write_forest(tmp_path, forest_data(**leaf))).probability(units),
                                  [0.25, 0.25])
    padded = forest_data(depth=64, **{name: [row[0] + [0, 0], [0] * 5]  # a leaf-only tree padded with zeros
                                      for name, row in forest_data().items()
                                      if name in ("feature", "threshold", "left", "right", "reusable")})
    padded["reusable"][1][0] = 1.0
    np.testing.assert_array_equal(ReusePredictor.load(write_forest(tmp_path, padded)).probability(units), [1.0, 0.5])


def test_a_file_nested_past_pythons_stack_is_refused_as_unreadable(tmp_path):
    (tmp_path / "deep.json").write_text("[" * 100_000)
    with pytest.raises(ValueError, match="cannot read it"):
        ReusePredictor.load(tmp_path / "deep.json")
