"""PatchedServe §7's cache reuse predictor: instead of one fixed threshold on the input's change,
a random forest trained offline on exact runs says, per unit and block, whether the block's
cached output may stand in for the one it would compute.

Features of a unit at a block (`FEATURES`, one row per unit, computed in one batched call):

- `change`: mean |x - x_then| / mean |x_then|, the fixed threshold's own measure (over a
  sample of the unit's elements, `sample`), where x_then is the unit's input when the block
  last computed it;
- `change_mse`: mean (x - x_then)^2 / mean x_then^2, the paper's MSE similarity, relative;
- `progress`: denoising steps done / steps of its request;
- `block`: the block's position in the forward (0 for the first cached block);
- `pixels`: log2 of its image's pixels;
- `part`: 0 when the unit is a whole image, 1 a patch or a token group of one.

Labels come from exact runs (`gouache profile --reuse`): there every unit is computed at every
step, and the error reusing would have caused is the relative change of the block's output,
mean |y - y_then| / mean |y|; a unit may reuse when that is under the predictor's `bound`.

Serving evaluates the forest's arrays with numpy (a gather per level, every tree and unit at
once), never with scikit-learn, whose per-call cost is milliseconds. A decision runs before
every cached block, so it is a few dozen small operations: four torch reductions for the
features, one copy of their results to the host (on a GPU, its only wait), and a forest packed
for numpy's gathers (pointer-sized indices, float32 thresholds, children side by side: four
operations a level).
The file is JSON (the trees' arrays), names the model it was trained on (`model_digest`), and
is refused for any other, or where its arrays do not make a forest every walk of which ends on a
leaf (`forest_check`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gouache.block_cache.forest_check import forest_arrays
from gouache.block_cache.store import CachePass
from gouache.config import BlockCacheConfig
from gouache.files import write_atomic

FEATURES = ("change", "change_mse", "progress", "block", "pixels", "part")
KIND = "block-cache-reuse-forest"


SAMPLE = 4096  # elements per unit the change features read at most, in runs of RUN contiguous ones
RUN = 64


def sample(t: torch.Tensor) -> torch.Tensor:
    """[rows, n] every k-th run of RUN contiguous elements of each row of t, k chosen so that at
    most about SAMPLE are read: a change's mean over a unit's elements, estimated at a fraction of
    the memory traffic (a block's input is as large as its output)."""
    flat = t.flatten(1)
    n = flat.shape[1]
    if n <= 2 * SAMPLE:
        return flat
    runs = flat[:, : n // RUN * RUN].unflatten(1, (n // RUN, RUN))
    return runs[:, :: -(-n // SAMPLE)].flatten(1)


def unit_features(then: torch.Tensor, x: torch.Tensor, context: np.ndarray, block: int) -> np.ndarray:
    """[rows, len(FEATURES)] float32 on the host: each row of x [rows, ...] against its input
    then (over a sample of its elements); `context` [rows, 3] holds (progress, pixels, part).
    Four reductions where the activations are, one copy of their results to the host (a GPU's
    only wait), the rest numpy."""
    then, x = sample(then), sample(x)
    if then.dtype != torch.float32:
        then, x = then.float(), x.float()
    diff = x - then
    norm = torch.linalg.vector_norm
    l1, l1_then, l2, l2_then = torch.stack([norm(diff, 1, dim=1), norm(then, 1, dim=1), norm(diff, 2, dim=1),
                                            norm(then, 2, dim=1)]).cpu().numpy()
    tiny = np.float32(1e-12)
    out = np.empty((len(l1), len(FEATURES)), np.float32)
    out[:, 0] = l1 / np.maximum(l1_then, tiny)
    out[:, 1] = np.square(l2 / np.maximum(l2_then, tiny))
    out[:, 2] = context[:, 0]
    out[:, 3] = block
    out[:, 4:] = context[:, 1:]
    return out


def output_error(then: Sequence[torch.Tensor], now: Sequence[torch.Tensor]) -> torch.Tensor:
    """[rows] the relative change of a block's outputs (all of them, per row): what reusing
    `then` in place of `now` would have cost."""
    diff = sum((n.flatten(1).float() - t.flatten(1).float()).abs().sum(1) for t, n in zip(then, now))
    size = sum(n.flatten(1).float().abs().sum(1) for n in now)
    return diff / size.clamp_min(1e-12)


@dataclass
class ReusePredictor:
    """A trained forest as arrays [trees, nodes] (a leaf's children are itself), and what it was
    trained on."""

    model: str  # `model_digest` of the pipeline whose runs it learned
    model_name: str
    bound: float  # a unit was labelled reusable when its output error was under this
    feature: torch.Tensor  # [T, N] long: feature tested at each node (0 at leaves)
    threshold: torch.Tensor  # [T, N] float64: go left when feature <= threshold
    left: torch.Tensor  # [T, N] long
    right: torch.Tensor  # [T, N] long
    reusable: torch.Tensor  # [T, N] float32: P(reusable) at each leaf
    depth: int
    report: dict[str, Any] = field(default_factory=dict)  # how it scored on held-out samples
    _packed: tuple[np.ndarray, ...] | None = field(default=None, repr=False)
    _starts: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict, repr=False)

    def _pack(self) -> tuple[np.ndarray, ...]:
        """The trees flattened into one node array: feature, threshold as float32 (the
        largest float32 <= the float64 one, so that a float32 feature x <= it exactly when
        x <= the original, as scikit-learn compares), children side by side (int32: node i goes
        to children[2 i] when x <= threshold, else children[2 i + 1]), leaves' P(reusable)."""
        trees, width = self.feature.shape
        offset = np.arange(trees, dtype=np.intp)[:, None] * width
        threshold = self.threshold.numpy()
        with np.errstate(over="ignore"):  # past float32's range: ±inf, then below +inf to its largest
            rounded = threshold.astype(np.float32)
        rounded = np.where(rounded.astype(np.float64) > threshold, np.nextafter(rounded, np.float32(-np.inf)), rounded)
        children = np.stack([self.left.numpy() + offset, self.right.numpy() + offset], -1).astype(np.intp)
        return (self.feature.numpy().astype(np.intp).ravel(), rounded.ravel(), children.ravel(),
                self.reusable.numpy().ravel(), offset.ravel())

    def probability(self, features: np.ndarray) -> np.ndarray:
        """[units] P(reusable) for float32 features [units, len(FEATURES)]: the mean over trees of
        each tree's leaf, as scikit-learn's predict_proba. Evaluated with numpy on the host: a
        few dozen units a call, where torch's per-operation cost would dominate."""
        if self._packed is None:
            self._packed = self._pack()
        feature, threshold, children, reusable, offset = self._packed
        x = np.ascontiguousarray(features, np.float32).ravel()
        units = len(features)
        if units not in self._starts:  # [trees * units]: each unit's first feature, each tree's root
            self._starts[units] = (np.tile(np.arange(units, dtype=np.intp) * len(FEATURES), len(offset)),
                                   np.repeat(offset, units))
        base, node = self._starts[units]
        for _ in range(self.depth):
            node = children[2 * node + (x[base + feature[node]] > threshold[node])]
        return reusable[node].reshape(len(offset), units).mean(0)

    @classmethod
    def from_forest(cls, forest, model: str, model_name: str, bound: float,
                    report: dict | None = None) -> ReusePredictor:
        """From a fitted scikit-learn RandomForestClassifier over `FEATURES`, labels True = reusable."""
        trees = [estimator.tree_ for estimator in forest.estimators_]
        width = max(t.node_count for t in trees)
        shape = (len(trees), width)
        feature, left, right = (np.zeros(shape, np.int64) for _ in range(3))
        threshold, reusable = np.zeros(shape), np.zeros(shape, np.float32)
        classes = list(forest.classes_)
        for i, t in enumerate(trees):
            n = t.node_count
            leaf = t.children_left[:n] < 0
            own = np.arange(n)
            feature[i, :n] = np.where(leaf, 0, t.feature[:n])
            threshold[i, :n] = np.where(leaf, 0.0, t.threshold[:n])
            left[i, :n] = np.where(leaf, own, t.children_left[:n])
            right[i, :n] = np.where(leaf, own, t.children_right[:n])
            value = t.value[:n, 0, :]
            fraction = value / value.sum(1, keepdims=True)
            reusable[i, :n] = fraction[:, classes.index(True)] if True in classes else 0.0
        depth = max(e.get_depth() for e in forest.estimators_)
        return cls(model, model_name, bound,
                   *(torch.from_numpy(a) for a in (feature, threshold, left, right, reusable)), depth, report or {})

    def save(self, path: str | Path) -> None:
        data = {"kind": KIND, "model": self.model, "model_name": self.model_name, "bound": self.bound,
                "features": list(FEATURES), "depth": self.depth, "report": self.report,
                **{name: getattr(self, name).tolist()
                   for name in ("feature", "threshold", "left", "right", "reusable")}}
        write_atomic(path, json.dumps(data) + "\n")

    @classmethod
    def load(cls, path: str | Path, model: str | None = None) -> ReusePredictor:
        """The predictor at `path`; a ValueError saying why when it is not one, or was trained
        on features other than these, or (`model` given) on another model."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError, RecursionError) as error:
            raise ValueError(f"block-cache predictor {path}: cannot read it ({error})") from None
        if not isinstance(data, dict) or data.get("kind") != KIND:
            raise ValueError(f"block-cache predictor {path}: not a reuse predictor (kind {KIND!r}); "
                             "`gouache profile --reuse` writes one")
        if data.get("features") != list(FEATURES):
            raise ValueError(f"block-cache predictor {path}: trained on features {data.get('features')}, "
                             f"this version computes {list(FEATURES)}; train it again")
        if model is not None and data.get("model") != model:
            raise ValueError(f"block-cache predictor {path} was trained on another model ({data.get('model_name')}); "
                             "its decisions do not carry over: train one on this model with `gouache profile --reuse`")
        try:
            arrays, depth = forest_arrays(data, len(FEATURES))
            bound = data["bound"]
            if not (isinstance(bound, int | float) and not isinstance(bound, bool) and 0 < bound < 1):
                raise ValueError("bound must be a relative output error in (0, 1), as --bound is; "
                                 f"got {str(bound)[:24]}")
            return cls(data["model"], data["model_name"], float(bound),
                       *(torch.from_numpy(arrays[name]) for name in ("feature", "threshold", "left", "right")),
                       torch.from_numpy(arrays["reusable"]).float(), depth, data.get("report", {}))
        except (KeyError, TypeError, ValueError) as error:
            why = f"{error} is missing" if isinstance(error, KeyError) else str(error)
            raise ValueError(f"block-cache predictor {path}: malformed: {why}; write it again with "
                             "`gouache profile --reuse`") from None


def reuse_pass(config: BlockCacheConfig | None, pipe) -> type[CachePass] | None:
    """The pass that decides reuse under `config`: its predictor's, loaded for `pipe`'s model
    (refused for another), or None for the fixed threshold."""
    if config is None or config.predictor is None:
        return None
    from gouache.models.digest import model_digest

    return predicted(ReusePredictor.load(config.predictor, model_digest(pipe)))


class FeaturePass(CachePass):
    """A pass that sees each cached unit's `FEATURES` at every block (its context made once)."""

    def __init__(self, *args):
        super().__init__(*args)
        self._context: np.ndarray | None = None

    def features(self, block: Hashable, entry, x: torch.Tensor) -> np.ndarray:
        if self._context is None:
            self._context = self.context(torch.device("cpu")).numpy()
        return unit_features(entry.inputs, self._cached(x), self._context, self._depth[block])


def predicted(predictor: ReusePredictor) -> type[CachePass]:
    """A `CachePass` that reuses a unit where the predictor's P(reusable) is above 1 - its
    request's `block_cache` value (0.5: the forest's majority; nearer 1: more reuse)."""

    class PredictedPass(FeaturePass):
        def __init__(self, *args):
            super().__init__(*args)
            self._cut_offs: np.ndarray | None = None  # [store rows] 1 - each unit's request's value

        def unchanged(self, block: Hashable, entry, x: torch.Tensor) -> torch.Tensor:
            start = time.perf_counter()
            if self._cut_offs is None:
                self._cut_offs = 1 - self._thresholds.cpu().numpy()
            reusable = torch.from_numpy(predictor.probability(self.features(block, entry, x)) > self._cut_offs)
            self.cache.decide_s += time.perf_counter() - start
            return reusable.to(x.device)

    return PredictedPass


class Recorder:
    """Samples of exact forwards for training: per cached unit and block, its features and the
    output error reusing the block's previous output would have caused. Every unit is computed."""

    def __init__(self) -> None:
        self.features: list[np.ndarray] = []
        self.errors: list[np.ndarray] = []

    def pass_type(self) -> type[CachePass]:
        recorder = self

        class RecordingPass(FeaturePass):
            def __init__(self, *args):
                super().__init__(*args)
                self._pending: dict[Hashable, tuple[torch.Tensor, torch.Tensor]] = {}

            def unchanged(self, block: Hashable, entry, x: torch.Tensor) -> torch.Tensor:
                self._pending[block] = self.features(block, entry, x), entry.valid.clone()
                return torch.zeros(len(entry.inputs), dtype=torch.bool, device=x.device)

            def merge(self, block: Hashable, x, computed, fresh):
                pending = self._pending.pop(block, None)
                entry = self.store.blocks.get(block)
                if pending is not None and fresh is not None and entry is not None:
                    pairs = [(then, self._cached(now)) for then, now in zip(entry.outputs, fresh)
                             if then is not None and now is not None]
                    error = output_error([t for t, _ in pairs], [n for _, n in pairs])
                    features, valid = pending
                    recorder.features.append(features[valid.cpu().numpy()])
                    recorder.errors.append(error[valid].cpu().numpy())
                return super().merge(block, x, computed, fresh)

        return RecordingPass

    def samples(self) -> tuple[np.ndarray, np.ndarray]:
        """(features [n, len(FEATURES)], output errors [n])."""
        if not self.features:
            return np.zeros((0, len(FEATURES)), np.float32), np.zeros(0, np.float32)
        return np.concatenate(self.features), np.concatenate(self.errors)


def train(features: np.ndarray, errors: np.ndarray, bound: float, model: str, model_name: str,
          trees: int = 32, depth: int = 8, holdout: float = 0.2, seed: int = 0) -> ReusePredictor:
    """A forest over `features` labelled reusable where the error is under `bound`, scored on a
    seeded held-out share: accuracy, and among the held-out units it would reuse (at the 0.5
    cut-off) the share truly under the bound and their mean error."""
    from sklearn.ensemble import RandomForestClassifier  # training only; serving never imports it

    if len(errors) < 10:
        raise ValueError(f"{len(errors)} samples: too few to train a reuse predictor (run more requests or steps)")
    labels = errors < bound
    order = np.random.default_rng(seed).permutation(len(errors))
    cut = int(len(order) * (1 - holdout))
    fit, test = order[:cut], order[cut:]
    forest = RandomForestClassifier(trees, max_depth=depth, random_state=seed, n_jobs=1)
    forest.fit(features[fit], labels[fit])
    report = {"samples": len(errors), "reusable_share": float(labels.mean()), "trees": trees, "depth": depth}
    predictor = ReusePredictor.from_forest(forest, model, model_name, bound, report)
    if len(test):
        chosen = predictor.probability(features[test]) > 0.5
        report.update(holdout_accuracy=float((chosen == labels[test]).mean()), holdout_reused=float(chosen.mean()),
                      holdout_precision=float(labels[test][chosen].mean()) if chosen.any() else None,
                      holdout_reused_error=float(errors[test][chosen].mean()) if chosen.any() else None,
                      holdout_auc=ranking_auc(features[test], labels[test], predictor))
    return predictor


def ranking_auc(features: np.ndarray, labels: np.ndarray, predictor: ReusePredictor) -> dict[str, dict | None]:
    """Per unit kind (whole images, parts), how well each decider ranks the reusable units first
    (ROC AUC, 1 = perfectly, 0.5 = by chance): the forest's probability, and the fixed
    threshold's measure, the input's change (less change first). Where the two are close the
    threshold is already as good a decision; None where the kind's labels are all one class."""
    from sklearn.metrics import roc_auc_score

    scores = {}
    for kind, part in (("image", 0.0), ("part", 1.0)):
        rows = features[:, FEATURES.index("part")] == part
        if len(np.unique(labels[rows])) < 2:
            scores[kind] = None
            continue
        scores[kind] = {"units": int(rows.sum()),
                        "forest": float(roc_auc_score(labels[rows], predictor.probability(features[rows]))),
                        "threshold": float(roc_auc_score(labels[rows], -features[rows, FEATURES.index("change")]))}
    return scores
