"""Fitted predictors behind the cost models: scikit-learn estimators with JSON-able state.

Two kinds, picked by `kind` when loading:

- `SvrPredictor` ("svr"): `SVR` after a `StandardScaler`, fitted on log(seconds) so that the
  SVR's epsilon-tube is a relative tolerance (latencies span orders of magnitude); C and gamma
  are fixed defaults or, with `search=True`, chosen by cross-validation. An SVR's state (support
  vectors, dual coefficients, scaler statistics) is not a handful of numbers, so its JSON holds
  the chosen hyper-parameters and the training samples, and loading refits with those
  hyper-parameters (no search); `SVR` is deterministic, so the refit predicts identically.
- `LinearPredictor` ("linear"): `LinearRegression`; its JSON holds the coefficients and the
  intercept, and loading restores them without refitting.

Nothing here imports torch (the scheduler must not; `tests/sched/test_costmodel.py` checks).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from sklearn.compose import TransformedTargetRegressor
from sklearn.linear_model import LinearRegression
from sklearn.metrics import r2_score
from sklearn.model_selection import GridSearchCV, KFold
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.svm import SVR

from gouache.sched.cost_fields import MAX_SAMPLES, entries, field, finite, number, seconds, shown

MAX_FEATURES = 1000  # columns of a predictor's features: a batch model has one per resolution, plus two
MAX_FEATURE = 1e12  # |a feature|: image counts, patches, FLOPs, bytes


@dataclass
class FitReport:
    """Errors of a predictor fitted on a seeded split: relative errors |pred - true| / true."""

    n_train: int  # samples it was fitted on
    n_test: int  # held-out samples it was scored on
    train_mape: float  # mean absolute percentage error on the training split, in percent
    test_mape: float  # the same on the held-out split
    test_max_rel_error: float  # worst held-out relative error, as a fraction (0.05 = 5 %)
    test_r2: float  # coefficient of determination on the held-out split

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FitReport:
        return cls(**data)


def mape(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    """Mean absolute percentage error, in percent."""
    return float(100.0 * np.mean(relative_errors(y_true, y_pred)))


def relative_errors(y_true: np.ndarray, y_pred: np.ndarray) -> np.ndarray:
    y_true, y_pred = np.asarray(y_true, float), np.asarray(y_pred, float)
    return np.abs(y_pred - y_true) / np.abs(y_true)


def split(groups: Sequence[Hashable], holdout: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded (train, test) sample indices, holding out about `holdout` of the distinct groups
    (all samples of a group fall on one side, so repeated measurements never leak)."""
    if not 0.0 < holdout < 1.0:
        raise ValueError(f"holdout must be a fraction in (0, 1), got {holdout}")
    distinct = list(dict.fromkeys(groups))
    order = np.random.default_rng(seed).permutation(len(distinct))
    n_test = max(1, round(len(distinct) * holdout))
    if len(distinct) - n_test < 2:
        raise ValueError(f"{len(distinct)} distinct samples leave too few to fit after holding out {n_test}")
    held_out = {distinct[i] for i in order[:n_test]}
    test = np.array([i for i, g in enumerate(groups) if g in held_out], dtype=int)
    train = np.array([i for i, g in enumerate(groups) if g not in held_out], dtype=int)
    return train, test


def evaluate(
    predictor: SvrPredictor | LinearPredictor,
    X,
    y,
    holdout: float = 0.2,
    seed: int = 0,
    groups: Sequence[Hashable] | None = None,
) -> FitReport:
    """Fit a copy of `predictor` on a seeded train split; report its errors on both splits.
    `groups` (default: every sample its own) names samples that must stay together."""
    X, y = np.asarray(X, float), np.asarray(y, float)
    train, test = split(list(range(len(y))) if groups is None else groups, holdout, seed)
    probe = predictor.unfitted().fit(X[train], y[train])
    pred_train, pred_test = probe.predict(X[train]), probe.predict(X[test])
    return FitReport(
        n_train=len(train),
        n_test=len(test),
        train_mape=mape(y[train], pred_train),
        test_mape=mape(y[test], pred_test),
        test_max_rel_error=float(relative_errors(y[test], pred_test).max()),
        test_r2=float(r2_score(y[test], pred_test)) if len(test) > 1 else float("nan"),
    )


SVR_GRID: dict[str, list[float]] = {"C": [10.0, 100.0], "gamma": [0.01, 0.03, 0.1]}  # searched with search=True


class SvrPredictor:
    """RBF support-vector regression of positive targets (seconds) on standardized features.

    Defaults (C=100, gamma=0.03, epsilon=0.01 of log seconds, i.e. errors within ~1 % are
    free) suit a few hundred profiled batches over 3-6 resolutions: a wider RBF than sklearn's
    gamma="scale" extrapolates better to batches at the edge of what was profiled. With
    `search=True`, `fit` instead picks C and gamma from `SVR_GRID` by seeded 5-fold
    cross-validation on MAPE (a few seconds for 300 samples) and records them in `params`.
    """

    kind = "svr"

    def __init__(self, C: float = 100.0, gamma: float = 0.03, epsilon: float = 0.01, search: bool = False):
        self.params: dict[str, float] = {"C": C, "gamma": gamma, "epsilon": epsilon}  # SVR's, as fitted
        self.search = search  # choose C and gamma by cross-validation at each fit
        self._model: TransformedTargetRegressor | None = None
        self._X: np.ndarray | None = None  # kept for serialization: loading refits on them
        self._y: np.ndarray | None = None

    def unfitted(self) -> SvrPredictor:
        """A fresh predictor configured like this one."""
        return SvrPredictor(**self.params, search=self.search)

    def fit(self, X, y) -> SvrPredictor:
        X, y = np.asarray(X, float), np.asarray(y, float)
        if np.any(y <= 0):
            raise ValueError("SVR targets are latencies and must be positive")
        if self.search:
            self.params = self._search(X, y)
        return self._fit_with(self.params, X, y)

    def _fit_with(self, params: dict[str, float], X: np.ndarray, y: np.ndarray) -> SvrPredictor:
        self.params = dict(params)
        self._model = self._build(self.params).fit(X, y)
        self._X, self._y = X, y
        return self

    @property
    def fitted(self) -> bool:
        return self._model is not None

    def predict(self, X) -> np.ndarray:
        if self._model is None:
            raise RuntimeError("SvrPredictor is not fitted; call fit() or load a fitted one")
        return self._model.predict(np.asarray(X, float))

    def score(self, X, y) -> float:
        """R^2 of the predictions on (X, y)."""
        return float(r2_score(np.asarray(y, float), self.predict(X)))

    def to_json(self) -> dict[str, Any]:
        fitted = self._X is not None
        return {
            "kind": self.kind,
            "params": self.params,  # C, gamma, epsilon (the chosen ones, if searched)
            "search": self.search,
            "X": self._X.tolist() if fitted else None,  # [n_samples][n_features] training features
            "y": self._y.tolist() if fitted else None,  # [n_samples] training targets, seconds
        }

    @property
    def features(self) -> int | None:
        """Columns of the features it was fitted on; None unfitted."""
        return None if self._X is None else self._X.shape[1]

    @classmethod
    def from_json(cls, data: dict[str, Any], where: str = "svr") -> SvrPredictor:
        """A predictor from `to_json()`'s data; a ValueError naming the entry (`where.X[3][1]`)
        whose number is not one it can be fitted with."""
        params, at = field(data, "params", where)
        if not isinstance(params, dict) or set(params) != {"C", "gamma", "epsilon"}:
            raise ValueError(f"{at} must hold C, gamma and epsilon; got {shown(params)}")
        chosen = {name: number(params[name], f"{at}.{name}", low, 1e9)
                  for name, low in (("C", 1e-9), ("gamma", 1e-9), ("epsilon", 0.0))}
        search = data.get("search", False)
        if not isinstance(search, bool):
            raise ValueError(f"{where}.search must be true or false; got {shown(search)}")
        predictor = cls(**chosen, search=search)
        if data.get("X") is not None:  # refit with the stored hyper-parameters, never re-search
            X = _samples(data["X"], f"{where}.X")
            targets, at = field(data, "y", where)
            y = [seconds(v, f"{at}[{i}]") for i, v in enumerate(entries(targets, at, len(X), len(X)))]
            predictor._fit_with(chosen, np.asarray(X, float), np.asarray(y, float))
        return predictor

    @staticmethod
    def _build(params: dict[str, float]) -> TransformedTargetRegressor:
        # log target: the epsilon-tube becomes relative, as latencies span orders of magnitude
        regressor = make_pipeline(StandardScaler(), SVR(kernel="rbf", **params))
        return TransformedTargetRegressor(regressor=regressor, func=np.log, inverse_func=np.exp, check_inverse=False)

    def _search(self, X: np.ndarray, y: np.ndarray) -> dict[str, float]:
        grid = {f"regressor__svr__{name}": values for name, values in SVR_GRID.items()}
        folds = KFold(n_splits=min(5, len(y)), shuffle=True, random_state=0)
        scoring = "neg_mean_absolute_percentage_error"
        search = GridSearchCV(self._build(self.params), grid, scoring=scoring, cv=folds).fit(X, y)
        chosen = {name.removeprefix("regressor__svr__"): value for name, value in search.best_params_.items()}
        return self.params | chosen


class LinearPredictor:
    """Ordinary least squares, y = intercept + coef . x. `nonnegative`: the coefficients and the
    intercept are kept >= 0 (seconds per FLOP or byte, and a fixed cost, are never negative), so
    that a fit on few noisy samples never predicts a negative time outside their range."""

    kind = "linear"

    def __init__(self, nonnegative: bool = False) -> None:
        self.nonnegative = nonnegative
        self._model: LinearRegression | None = None

    def unfitted(self) -> LinearPredictor:
        return LinearPredictor(self.nonnegative)

    def fit(self, X, y) -> LinearPredictor:
        X, y = np.asarray(X, float), np.asarray(y, float)
        model = LinearRegression(positive=self.nonnegative).fit(X, y)
        if self.nonnegative and model.intercept_ < 0:  # no fixed cost then: the line through the origin
            model = LinearRegression(positive=True, fit_intercept=False).fit(X, y)
        self._model = model
        return self

    @property
    def fitted(self) -> bool:
        return self._model is not None

    @property
    def coef(self) -> list[float]:
        return self._require().coef_.tolist()

    @property
    def intercept(self) -> float:
        return float(self._require().intercept_)

    def predict(self, X) -> np.ndarray:
        return self._require().predict(np.asarray(X, float))

    def score(self, X, y) -> float:
        """R^2 of the predictions on (X, y)."""
        return float(r2_score(np.asarray(y, float), self.predict(X)))

    def to_json(self) -> dict[str, Any]:
        fitted = self._model is not None
        return {
            "kind": self.kind,
            "coef": self.coef if fitted else None,  # [n_features]
            "intercept": self.intercept if fitted else None,
        }

    @property
    def features(self) -> int | None:
        """Columns of the features it was fitted on; None unfitted."""
        return None if self._model is None else len(self._model.coef_)

    @classmethod
    def from_json(cls, data: dict[str, Any], where: str = "linear") -> LinearPredictor:
        """A predictor from `to_json()`'s data; a ValueError naming a coefficient that is not a
        finite number."""
        predictor = cls()
        if data.get("coef") is not None:
            model = LinearRegression()
            coef = entries(data["coef"], f"{where}.coef", 1, MAX_FEATURES)
            model.coef_ = np.asarray([finite(c, f"{where}.coef[{i}]") for i, c in enumerate(coef)], float)
            model.intercept_ = finite(*field(data, "intercept", where))
            model.n_features_in_ = len(model.coef_)
            predictor._model = model
        return predictor

    def _require(self) -> LinearRegression:
        if self._model is None:
            raise RuntimeError("LinearPredictor is not fitted; call fit() or load a fitted one")
        return self._model


PREDICTORS: dict[str, type[SvrPredictor] | type[LinearPredictor]] = {
    cls.kind: cls for cls in (SvrPredictor, LinearPredictor)
}


def predictor_from_json(data: dict[str, Any], where: str = "predictor") -> SvrPredictor | LinearPredictor:
    """Rebuild a predictor saved by its `to_json()`, whichever kind it is."""
    if not isinstance(data, dict) or data.get("kind") not in PREDICTORS:
        kind = data.get("kind") if isinstance(data, dict) else None
        raise ValueError(f"{where}: unknown predictor kind {kind!r}; expected one of {', '.join(PREDICTORS)}")
    return PREDICTORS[data["kind"]].from_json(data, where)


def _samples(value, where: str) -> list[list[float]]:
    """[samples][features] finite numbers, every sample as long as the first."""
    rows = entries(value, where, 1, MAX_SAMPLES)
    width = len(entries(rows[0], f"{where}[0]", 1, MAX_FEATURES))
    return [[number(x, f"{where}[{i}][{j}]", -MAX_FEATURE, MAX_FEATURE)
             for j, x in enumerate(entries(row, f"{where}[{i}]", width, width))] for i, row in enumerate(rows)]
