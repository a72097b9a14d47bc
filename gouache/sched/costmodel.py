"""Cost models: what a step will cost, for the policies that plan against deadlines.

- `BatchCostModel` (PatchedServe §6.1.2): per-step latency of a mixed-resolution batch, from a
  table of measured compositions, else an SVR on the paper's features.
- `ParallelCostModel` (TetriServe §4.2.1, in `parallel_costmodel.py`): per-step latency
  T(resolution, k) with k devices of sequence parallelism, a lookup table; `h100_flux_default()`
  derives one from published figures.
- `MaskCostModel` (InstGenIE §3.2, §4.4): compute and cache-load latency of a batch of masked
  edits, two linear regressions on FLOPs and bytes.

Each is a plain object with `to_json()` / `from_json()` (dicts of plain values); `save` and
`load` write and read them as JSON files. Derivations and sources: docs/costmodels.md.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gouache.files import write_atomic
from gouache.sched.cost_fields import (
    MAX_STEP_S,
    composition_entry,
    entries,
    field,
    integer,
    number,
    resolution_entry,
    seconds,
    side,
)
from gouache.sched.interface import Resolution, as_resolution
from gouache.sched.parallel_costmodel import ParallelCostModel
from gouache.sched.predictors import FitReport, LinearPredictor, SvrPredictor, evaluate, predictor_from_json

Composition = Mapping[Resolution, int]  # {resolution: number of images of it in the batch}
# sorted (height, width, count), or a clip's (height, width, frames, count); counts > 0
CompositionKey = tuple[tuple[int, ...], ...]


def composition_key(composition: Composition) -> CompositionKey:
    return tuple(sorted((*res, int(c)) for res, c in composition.items() if c > 0))


class BatchCostModel:
    """Per-step seconds of one patched forward over a mix of resolutions.

    Measured compositions are looked up exactly (the mean of their measurements); any other is
    predicted by an SVR on PatchedServe's features: the count of each known resolution (in the
    order of `resolutions`), the number of distinct resolutions, and the number of patches.

    Policies that do not patch (orca, fcfs-static, round-knapsack) run one plain forward per
    resolution; those are priced from a second table, `grouped`: seconds of a plain forward of
    b images of one resolution, measured for b = 1..max and linear in b between and beyond.
    `stages` holds what one request costs the device outside its steps (preparation, and
    post-processing), for a simulator that charges it.
    """

    kind = "batch"

    def __init__(
        self,
        resolutions: Sequence[int | Sequence[int]],
        patch_px: int = 256,
        predictor: SvrPredictor | None = None,
    ):
        self.resolutions = [as_resolution(r) for r in resolutions]  # feature order; fixed once fitted
        if not self.resolutions or len(set(self.resolutions)) != len(self.resolutions):
            raise ValueError("resolutions must be a non-empty list of distinct (height, width) sizes or "
                             "(height, width, frames) clips")
        if patch_px <= 0:
            raise ValueError(f"patch_px must be positive, got {patch_px}")
        self.patch_px = patch_px  # patch side in pixels, for the patch-count feature
        self.predictor = predictor or SvrPredictor()
        self.table: dict[CompositionKey, tuple[float, int]] = {}  # key -> (mean seconds, measurements)
        self.grouped: dict[Resolution, dict[int, float]] = {}  # resolution -> {batch size: s of a plain forward}
        self.stages: dict[Resolution, tuple[float, float]] = {}  # resolution -> (prep s, post s) of one request
        self.report: FitReport | None = None  # held-out errors of the last fit()

    def features(self, composition: Composition) -> list[float]:
        unknown = set(r for r, c in composition.items() if c > 0) - set(self.resolutions)
        if unknown:
            known = self.resolutions
            raise ValueError(f"resolutions {sorted(unknown)} are not in this cost model's {known}; re-profile")
        counts = [float(composition.get(r, 0)) for r in self.resolutions]
        distinct = float(sum(c > 0 for c in counts))
        patches = float(sum(c * self._patches(r) for r, c in zip(self.resolutions, counts)))
        return [*counts, distinct, patches]

    def record(self, composition: Composition, seconds: float) -> None:
        """Add one measurement to the table (the table keeps the running mean)."""
        key = composition_key(composition)
        mean, n = self.table.get(key, (0.0, 0))
        self.table[key] = ((mean * n + seconds) / (n + 1), n + 1)

    def fit(self, samples: Sequence[tuple[Composition, float]], holdout: float = 0.2, seed: int = 0) -> FitReport:
        """Report the errors of an SVR fitted with a seeded `holdout` share of the distinct
        compositions held out, then keep an SVR refitted on all `samples` (the report describes
        the split's model, a slightly pessimistic estimate of the kept one). The samples are also
        recorded; the table accumulates across calls, the predictor is replaced."""
        X = [self.features(c) for c, _ in samples]
        y = [s for _, s in samples]
        keys = [composition_key(c) for c, _ in samples]
        self.report = evaluate(self.predictor, X, y, holdout, seed, groups=keys)
        self.predictor = self.predictor.unfitted().fit(X, y)
        for composition, took in samples:
            self.record(composition, took)
        return self.report

    def predict(self, composition: Composition) -> float:
        key = composition_key(composition)
        if not key:
            return 0.0
        if key in self.table:
            return self.table[key][0]
        if not self.predictor.fitted:
            raise RuntimeError(f"{dict(composition)} was not measured and no predictor is fitted; call fit()")
        return float(self.predictor.predict([self.features(composition)])[0])

    def record_grouped(self, resolution: int | Sequence[int], batch: int, seconds: float) -> None:
        """Set the measured seconds of one plain forward of `batch` images of `resolution`."""
        if batch < 1 or not seconds > 0:
            raise ValueError(f"a grouped measurement needs batch >= 1 and seconds > 0, got ({batch}, {seconds})")
        self.grouped.setdefault(as_resolution(resolution), {})[batch] = seconds

    def grouped_time(self, resolution: Resolution, batch: int) -> float:
        """Seconds of one plain forward of `batch` images of `resolution`: measured, else
        linear in the batch size through the nearest measured sizes (through the origin when
        only one size was measured)."""
        row = self.grouped.get(resolution)
        if not row:
            raise ValueError(f"no plain-forward profile of {resolution}; re-run `gouache profile` with that size")
        if batch in row:
            return row[batch]
        sizes = sorted(row)
        if len(sizes) == 1:
            return row[sizes[0]] * batch / sizes[0]
        i = min(max(bisect.bisect(sizes, batch), 1), len(sizes) - 1)  # the measured pair around (or nearest) batch
        lo, hi = sizes[i - 1], sizes[i]
        estimate = row[lo] + (row[hi] - row[lo]) / (hi - lo) * (batch - lo)
        return max(estimate, 1e-6)  # a falling extrapolation must not price a forward at zero

    def record_stages(self, resolution: int | Sequence[int], prep_s: float, post_s: float) -> None:
        """Set the measured device seconds of one request's preparation and post-processing."""
        if prep_s < 0 or post_s < 0:
            raise ValueError(f"stage times must be >= 0 seconds, got ({prep_s}, {post_s})")
        self.stages[as_resolution(resolution)] = (prep_s, post_s)

    def stage_time(self, res: Resolution) -> tuple[float, float]:
        """(prep, post) seconds of a request of resolution `res`: a simulator's `StageCost`."""
        if res not in self.stages:
            raise ValueError(f"no stage profile of {res}; re-run `gouache profile` with that size")
        return self.stages[res]

    def step_time(self, resolutions: Sequence[Resolution], patched: bool, degree: int = 1) -> float:
        """`StepTimePredictor` for the policies: seconds of one step, one patched forward over
        all of `resolutions`, or one plain forward per resolution; one device only (inf beyond)."""
        if degree != 1:
            return math.inf
        composition: dict[Resolution, int] = {}
        for res in resolutions:
            composition[res] = composition.get(res, 0) + 1
        if not patched:
            return sum(self.grouped_time(res, count) for res, count in composition.items())
        return self.predict(composition)

    def sizes(self, patched: bool) -> set[Resolution]:
        """What `step_time` prices: a patched batch of the profiled resolutions (the SVR's features
        count images per known resolution, so it cannot price another), or plain forwards of
        the resolutions in `grouped`."""
        return set(self.resolutions) if patched else set(self.grouped)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "resolutions": [list(r) for r in self.resolutions],
            "patch_px": self.patch_px,
            "table": [
                {"composition": [list(t) for t in key], "seconds": seconds, "n": n}
                for key, (seconds, n) in self.table.items()
            ],
            "grouped": [
                {"resolution": list(res), "batch": b, "seconds": seconds}
                for res, row in self.grouped.items()
                for b, seconds in sorted(row.items())
            ],
            "stages": [{"resolution": list(res), "prep_s": prep, "post_s": post}
                       for res, (prep, post) in self.stages.items()],
            "predictor": self.predictor.to_json(),
            "report": self.report.to_json() if self.report else None,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BatchCostModel:
        """A model from `to_json()`'s data; a ValueError naming the entry whose number the
        planners cannot use (`cost_fields`: times in [1e-6, 1e6] s, sizes and counts bounded)."""
        resolutions = [resolution_entry(r, at) for r, at in _rows(*field(data, "resolutions"), 1)]
        predictor = predictor_from_json(*field(data, "predictor"))
        if predictor.features not in (None, len(resolutions) + 2):
            raise ValueError(f"predictor was fitted on {predictor.features} features; {len(resolutions)} "
                             f"resolutions make {len(resolutions) + 2}")
        model = cls(resolutions, side(*field(data, "patch_px")), predictor)  # type: ignore[arg-type]
        for row, at in _rows(*field(data, "table")):
            key = tuple(sorted(composition_entry(*entry) for entry in _rows(*field(row, "composition", at), 1)))
            model.table[key] = (seconds(*field(row, "seconds", at)), integer(*field(row, "n", at)))
        for row, at in _rows(data.get("grouped", []), "grouped"):  # absent in files profiled before plain forwards were
            model.record_grouped(resolution_entry(*field(row, "resolution", at)), integer(*field(row, "batch", at)),
                                 seconds(*field(row, "seconds", at)))
        for row, at in _rows(data.get("stages", []), "stages"):
            model.record_stages(resolution_entry(*field(row, "resolution", at)),
                                seconds(*field(row, "prep_s", at), 0.0), seconds(*field(row, "post_s", at), 0.0))
        model.report = FitReport.from_json(data["report"]) if data.get("report") else None
        return model

    def _patches(self, res: Resolution) -> int:
        """Patches of an image, or of each of a clip's frames, the frames counted."""
        frames = res[2] if len(res) == 3 else 1
        return math.ceil(res[0] / self.patch_px) * math.ceil(res[1] / self.patch_px) * frames


EditBatch = Sequence[tuple[int, float]]  # [(image tokens L, mask ratio m in [0, 1])], one per request


@dataclass
class MaskFitReport:
    """R^2 of the two regressions on the samples they were fitted on (InstGenIE reports 0.99)."""

    compute_r2: float
    load_r2: float


class MaskCostModel:
    """Per-step compute and cache-load seconds of a batch of mask-aware edits (InstGenIE).

    Following InstGenIE Table 1, per transformer block and request, only the m*L masked tokens
    are computed: projections q, k, v, o (4 x 2mLH^2 FLOPs), the feed-forward H->4H->H
    (2 x 8mLH^2), and attention of masked queries to all L keys (QK^T and AV: 2 x 2mL^2H).
    A DiT's T text rows run in full in every block (24TH^2, and they attend to all L + T); the
    paper's 4096-token images make them small, small images do not. The activations of the
    (1-m)*L unmasked tokens are loaded instead: `tensors` x H elements each per block (the
    block's output, and the keys and values when those are cached too). Latency is linear in
    each (InstGenIE §4.4), fitted per model and device. `plain` (optional) is the step time of a full
    regeneration on the model's own path, fitted on the m = 1 FLOPs: where a replay would not
    beat it, the edit runs in full.
    """

    kind = "mask"

    def __init__(
        self,
        hidden: int,
        num_blocks: int,
        bytes_per_element: int = 2,
        compute: LinearPredictor | None = None,
        load: LinearPredictor | None = None,
        text_tokens: int = 0,
        tensors: int = 1,
        plain: LinearPredictor | None = None,
    ):
        self.hidden = hidden  # H
        self.num_blocks = num_blocks  # transformer blocks whose unmasked activations are cached
        self.bytes_per_element = bytes_per_element  # of the cached activations (2 = bf16/fp16)
        self.compute = compute or LinearPredictor(nonnegative=True)  # FLOPs -> seconds
        self.load = load or LinearPredictor(nonnegative=True)  # bytes -> seconds
        self.text_tokens = text_tokens  # T: text rows each request runs in full in every block
        self.tensors = tensors  # cached tensors per unmasked token and block
        self.plain = plain  # m = 1 FLOPs -> seconds of a full regeneration, or None
        self.report: MaskFitReport | None = None

    def flops(self, batch: EditBatch) -> float:
        H, T = self.hidden, self.text_tokens
        per_block = sum(24 * (m * L + T) * H * H + 4 * (m * L + T) * (L + T) * H for L, m in _checked(batch))
        return self.num_blocks * per_block

    def cache_bytes(self, batch: EditBatch) -> float:
        per_token = self.tensors * self.hidden * self.bytes_per_element
        return self.num_blocks * sum((1 - m) * L * per_token for L, m in _checked(batch))

    def fit(
        self, compute_samples: Sequence[tuple[EditBatch, float]], load_samples: Sequence[tuple[EditBatch, float]],
        plain_samples: Sequence[tuple[EditBatch, float]] = (),
    ) -> MaskFitReport:
        """Fit the regressions on (batch, measured seconds) samples; returns their R^2."""
        Xc, yc = [[self.flops(b)] for b, _ in compute_samples], [s for _, s in compute_samples]
        Xl, yl = [[self.cache_bytes(b)] for b, _ in load_samples], [s for _, s in load_samples]
        self.compute.fit(Xc, yc)
        self.load.fit(Xl, yl)
        if plain_samples:
            self.plain = LinearPredictor(nonnegative=True).fit([[self.flops(b)] for b, _ in plain_samples],
                                               [s for _, s in plain_samples])
        self.report = MaskFitReport(self.compute.score(Xc, yc), self.load.score(Xl, yl))
        return self.report

    def compute_time(self, batch: EditBatch) -> float:
        return float(self.compute.predict([[self.flops(batch)]])[0])

    def load_time(self, batch: EditBatch) -> float:
        return float(self.load.predict([[self.cache_bytes(batch)]])[0])

    def plain_time(self, batch: EditBatch) -> float | None:
        """Step seconds of regenerating these requests in full; None without a `plain` fit."""
        if self.plain is None:
            return None
        return float(self.plain.predict([[self.flops([(L, 1.0) for L, _ in batch])]])[0])

    def predict(self, batch: EditBatch) -> float:
        """Per-step seconds with block-wise pipelined loading (InstGenIE §4.2): the longer of the two."""
        return max(self.compute_time(batch), self.load_time(batch)) if batch else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "hidden": self.hidden,
            "num_blocks": self.num_blocks,
            "bytes_per_element": self.bytes_per_element,
            "text_tokens": self.text_tokens,
            "tensors": self.tensors,
            "compute": self.compute.to_json(),
            "load": self.load.to_json(),
            "plain": self.plain.to_json() if self.plain is not None else None,
            "report": asdict(self.report) if self.report else None,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MaskCostModel:
        """A model from `to_json()`'s data; a ValueError naming the entry the replay's plan cannot
        use: sizes bounded (so FLOPs and bytes stay finite), and each line fitted on its one
        feature (`_line`)."""
        model = cls(
            integer(*field(data, "hidden")),
            integer(*field(data, "num_blocks"), high=MAX_BLOCKS),
            integer(*field(data, "bytes_per_element"), high=8),
            _line(*field(data, "compute")),
            _line(*field(data, "load")),
            integer(data.get("text_tokens", 0), "text_tokens", 0),
            integer(data.get("tensors", 1), "tensors", 1, 16),
            _line(data["plain"], "plain") if data.get("plain") else None,
        )
        model.report = MaskFitReport(**data["report"]) if data.get("report") else None
        return model


MAX_BLOCKS = 4096  # transformer blocks of a mask model


def _rows(value, where: str, least: int = 0) -> list[tuple[Any, str]]:
    """(entry, its name in a message) of a file's list `where`."""
    return [(entry, f"{where}[{i}]") for i, entry in enumerate(entries(value, where, least))]


def _line(data, where: str) -> LinearPredictor:
    """A mask model's fitted line of one feature (FLOPs or bytes) to seconds: a slope of at most
    a second per FLOP or byte (so the largest edits' times stay finite) and a fixed cost within
    a step's range. Either may be slightly negative: profiles from before the fits were kept
    nonnegative hold lines through -1e-4 s, or falling by 5e-13 s a FLOP, which the load plan
    takes as they are (a time below zero breaks no arithmetic there)."""
    line = LinearPredictor.from_json(data, where) if isinstance(data, dict) else None
    if line is None or line.features != 1:
        raise ValueError(f"{where} must be a line fitted on one feature (`gouache profile --edits` writes one)")
    number(line.coef[0], f"{where}.coef[0]", -1.0, 1.0, "seconds per FLOP or byte")
    number(line.intercept, f"{where}.intercept", -MAX_STEP_S, MAX_STEP_S, "a number of seconds")
    return line


def _checked(batch: EditBatch) -> EditBatch:
    for tokens, ratio in batch:
        if tokens <= 0 or not 0.0 <= ratio <= 1.0:
            raise ValueError(f"an edit needs tokens > 0 and a mask ratio in [0, 1], got ({tokens}, {ratio})")
    return batch


CostModel = BatchCostModel | ParallelCostModel | MaskCostModel
COST_MODELS: dict[str, type[BatchCostModel] | type[ParallelCostModel] | type[MaskCostModel]] = {
    cls.kind: cls for cls in (BatchCostModel, ParallelCostModel, MaskCostModel)
}


def save(model: CostModel, path: str | Path) -> None:
    write_atomic(path, json.dumps(model.to_json(), indent=1))


def load_mask_model(path: str | Path) -> MaskCostModel:
    """The mask-aware model of `gouache profile --edits` at `path`; a ValueError naming the flag otherwise."""
    model = load(path)
    if not isinstance(model, MaskCostModel):
        raise ValueError(f"{path} is a {model.kind!r} cost model; --template-cost-model takes the mask-aware one "
                         "of `gouache profile --edits` (kind 'mask')")
    return model


def load(path: str | Path) -> CostModel:
    """Read a cost model written by `save`, whichever kind it is; a ValueError naming the file
    and the entry when it is not one the planners can use."""
    try:
        data = json.loads(Path(path).read_text())
    except (ValueError, RecursionError) as error:  # RecursionError: nested past Python's stack
        raise ValueError(f"{path}: not a cost model's JSON ({error})") from None
    kind = data.get("kind") if isinstance(data, dict) else None
    if kind not in COST_MODELS:
        raise ValueError(f"{path}: unknown cost model kind {kind!r}; expected one of {', '.join(COST_MODELS)}")
    try:
        return COST_MODELS[kind].from_json(data)
    except (KeyError, TypeError, ValueError) as error:
        why = f"{error} is missing" if isinstance(error, KeyError) else error
        raise ValueError(f"{path}: {why}; profile it again (`gouache profile`)") from None
