"""Request traces for the simulator: generated from the papers' workload settings, or replayed.

Arrivals are Poisson (exponential gaps) or bursty (Gamma gaps with a chosen coefficient of
variation, CV > 1). Resolutions are drawn from a `uniform` mix or TetriServe's `skewed` mix,
p_i ∝ exp(α · L_i / L_max) with L_i the latent token count. Edits carry a mask ratio drawn
from a Beta distribution whose mean is InstGenIE's (0.11 in their traces, 0.19 in the
public one). Each request's SLO is `slo_scale` × its standalone latency, a callable the caller
passes (a cost model, a profiled table, or TetriServe's per-resolution targets).

Everything is seeded: one `SeedSequence` is split into independent streams for arrivals,
resolutions and masks, so changing the rate keeps the same sizes and masks, and vice versa.

Traces are files with one request per row, `request_id,arrival,width,height,steps,slo_s,mask_ratio`
and on (`COLUMNS`; a clip's `frames` last), CSV with empty cells for "none" or JSONL with nulls;
`request_id` may be left out and becomes `r<row>`, so arrivals recorded elsewhere can be replayed.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from gouache.request import TIERS

# standalone latency of one request alone on the device: (width, height, steps) -> seconds; a
# clip's frames follow its steps
LatencyFn = Callable[..., float]

TETRISERVE_SIZES = ((256, 256), (512, 512), (1024, 1024), (2048, 2048))  # TetriServe §6.1
PATCHEDSERVE_SIZES = ((512, 512), (768, 768), (1024, 1024))  # PatchedServe §8: small, medium, large
# TetriServe §6.1 per-resolution SLO targets in seconds (FLUX on H100), before the SLO scale
TETRISERVE_SLO_S = {(256, 256): 1.5, (512, 512): 2.0, (1024, 1024): 3.0, (2048, 2048): 5.0}
# InstGenIE §2.2: mean mask ratio of their production traces and of the public trace
MASK_MEANS = {"instgenie": 0.11, "public": 0.19}
MIXES = ("uniform", "skewed")


@dataclass(frozen=True)
class SimRequest:
    """One request of a trace: what the simulator needs to know about it, no more."""

    request_id: str
    arrival: float  # seconds since the trace began
    width: int  # pixels
    height: int  # pixels
    steps: int  # denoising steps
    slo_s: float | None = None  # deadline relative to arrival; None = no SLO
    mask_ratio: float | None = None  # edit: repainted fraction of the image; None = generation
    tier: str = "default"  # service tier (`gouache.request.TIERS`)
    tenant: str = ""  # who sent it (fair share within its tier)
    weight: float = 1.0  # its tenant's weight
    frames: int = 1  # a clip's frames (1: an image)

    def __post_init__(self) -> None:
        _check(self.arrival >= 0, f"{self.request_id}: arrival must be >= 0, got {self.arrival}")
        _check(self.width > 0 and self.height > 0, f"{self.request_id}: width and height must be positive")
        _check(self.steps >= 1, f"{self.request_id}: steps must be >= 1, got {self.steps}")
        _check(self.slo_s is None or self.slo_s > 0, f"{self.request_id}: slo_s must be positive, got {self.slo_s}")
        _check(self.mask_ratio is None or 0 <= self.mask_ratio <= 1,
               f"{self.request_id}: mask_ratio must be in [0, 1], got {self.mask_ratio}")
        _check(self.tier in TIERS, f"{self.request_id}: tier must be one of {', '.join(TIERS)}, got {self.tier!r}")
        _check(self.weight > 0, f"{self.request_id}: weight must be positive, got {self.weight}")
        _check(self.frames >= 1, f"{self.request_id}: frames must be >= 1, got {self.frames}")

    @property
    def deadline(self) -> float | None:
        return None if self.slo_s is None else self.arrival + self.slo_s

    @property
    def resolution(self) -> tuple[int, ...]:
        """(height, width), and a clip's frames after them: its `Resolution`."""
        return (self.height, self.width) if self.frames == 1 else (self.height, self.width, self.frames)

    @property
    def pixels(self) -> int:
        """Pixels of every frame."""
        return self.width * self.height * self.frames


@dataclass
class WorkloadSpec:
    """A generated workload: how requests arrive and what they ask for."""

    num_requests: int
    rate: float  # mean arrivals per second
    cv: float = 1.0  # coefficient of variation of inter-arrival gaps: 1 = Poisson, > 1 bursty (Gamma)
    # (width, height) choices in pixels, or clips' (width, height, frames)
    sizes: Sequence[tuple[int, ...]] = TETRISERVE_SIZES
    mix: str = "uniform"  # uniform | skewed (TetriServe: p_i ∝ exp(alpha * L_i / L_max))
    alpha: float = 1.0  # skew of the `skewed` mix; 0 makes it uniform
    steps: int = 50  # denoising steps of every request
    slo_scale: float | None = None  # SLO = slo_scale * standalone latency; None = no SLOs
    mask_mean: float | None = None  # mean mask ratio (every request is an edit); None = generations
    mask_shape: float = 2.0  # Beta's first parameter a; b follows from the mean
    seed: int = 0

    def __post_init__(self) -> None:
        _check(self.num_requests >= 0, f"num_requests must be >= 0, got {self.num_requests}")
        _check(self.rate > 0, f"rate must be positive (requests per second), got {self.rate}")
        _check(self.cv > 0, f"cv must be positive (1 = Poisson), got {self.cv}")
        _check(len(self.sizes) > 0, "sizes must list at least one (width, height)")
        _check(self.mix in MIXES, f"mix must be one of {', '.join(MIXES)}, got {self.mix!r}")
        _check(self.steps >= 1, f"steps must be >= 1, got {self.steps}")
        _check(self.slo_scale is None or self.slo_scale > 0, "slo_scale must be positive")
        _check(self.mask_mean is None or 0 < self.mask_mean < 1, "mask_mean must be in (0, 1)")
        _check(self.mask_shape > 0, "mask_shape must be positive")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


# -- sampling ------------------------------------------------------------------------------

def arrival_times(n: int, rate: float, cv: float, rng: np.random.Generator) -> np.ndarray:
    """[n] arrival times whose gaps have mean 1/rate: exponential if cv == 1, else Gamma.

    A Gamma gap with shape k = 1/cv² and scale 1/(rate·k) has mean 1/rate and CV `cv`;
    k = 1 is the exponential, so cv = 1 is Poisson either way.
    """
    if cv == 1.0:
        gaps = rng.exponential(1.0 / rate, size=n)
    else:
        shape = 1.0 / cv**2
        gaps = rng.gamma(shape, 1.0 / (rate * shape), size=n)
    return np.cumsum(gaps)


def size_probabilities(sizes: Sequence[tuple[int, ...]], mix: str, alpha: float = 1.0) -> np.ndarray:
    """[len(sizes)] probabilities of each size (a clip's, its frames counted): equal, or
    ∝ exp(alpha · L_i / L_max)."""
    _check(mix in MIXES, f"mix must be one of {', '.join(MIXES)}, got {mix!r}")
    if mix == "uniform":
        return np.full(len(sizes), 1.0 / len(sizes))
    tokens = np.array([math.prod(size) for size in sizes], dtype=float)  # ∝ L_i
    weights = np.exp(alpha * tokens / tokens.max())
    return weights / weights.sum()


def mask_beta(mean: float, shape: float = 2.0) -> tuple[float, float]:
    """Beta(a, b) with the given mean: a = shape, b = a(1 - mean)/mean.

    Why Beta(2, b): a mask ratio lives in [0, 1]; InstGenIE reports only the means (0.11,
    0.19) and that masks are "generally small" with "significant variation" (the histogram,
    Fig. 3, is not in the text). a = 2 gives a single right-skewed mode near the small
    ratios, zero density at 0 (every edit repaints something) and a long tail towards large
    masks: CV ≈ 0.65 at mean 0.11 and ≈ 0.61 at 0.19. a = 1 would put the mode at 0.
    """
    _check(0 < mean < 1, f"mask mean must be in (0, 1), got {mean}")
    return shape, shape * (1 - mean) / mean


# -- workloads -----------------------------------------------------------------------------

def make_workload(spec: WorkloadSpec, standalone_latency: LatencyFn | None = None) -> list[SimRequest]:
    """The spec's requests in arrival order; SLOs need `standalone_latency` when slo_scale is set
    (called with a clip's frames after its steps)."""
    _check(spec.slo_scale is None or standalone_latency is not None,
           "slo_scale needs standalone_latency(width, height, steps) -> seconds")
    arrival_rng, size_rng, mask_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(spec.seed).spawn(3))
    n = spec.num_requests
    arrivals = arrival_times(n, spec.rate, spec.cv, arrival_rng)
    size_index = size_rng.choice(len(spec.sizes), size=n, p=size_probabilities(spec.sizes, spec.mix, spec.alpha))
    masks = mask_rng.beta(*mask_beta(spec.mask_mean, spec.mask_shape), size=n) if spec.mask_mean else None
    solo: dict[tuple[int, ...], float] = {}
    requests = []
    for i in range(n):
        size = tuple(spec.sizes[size_index[i]])
        width, height, *frames = size
        slo = None
        if spec.slo_scale is not None:
            if size not in solo:
                solo[size] = standalone_latency(width, height, spec.steps, *frames)
            slo = spec.slo_scale * solo[size]
        requests.append(SimRequest(
            request_id=f"r{i}", arrival=float(arrivals[i]), width=int(width), height=int(height),
            steps=spec.steps, slo_s=slo, mask_ratio=None if masks is None else float(masks[i]),
            frames=int(frames[0]) if frames else 1,
        ))
    return requests


def tiered_trace(rate: float, duration_s: float, sizes: Sequence[tuple[int, int]], steps: int,
                 tiers: dict[str, float], tenants: dict[str, float], slo_s: dict[str, float | None], seed: int,
                 prefix: str = "r", cv: float = 1.0) -> list[SimRequest]:
    """Arrivals at `rate` for `duration_s` (Poisson; `cv` < 1 evener), each of a (width, height)
    of `sizes` drawn uniformly, its service tier and tenant drawn by their shares (`tiers`,
    `tenants`: name -> share), its SLO its tier's (`slo_s`)."""
    rng = np.random.default_rng(seed)
    arrivals = arrival_times(max(1, int(rate * duration_s)), rate, cv, rng)
    size = rng.integers(0, len(sizes), len(arrivals))
    tier = rng.choice(list(tiers), len(arrivals), p=list(tiers.values()))
    tenant = rng.choice(list(tenants), len(arrivals), p=list(tenants.values()))
    return [SimRequest(f"{prefix}{i}", float(t), *sizes[s], steps, slo_s[str(k)], tier=str(k), tenant=str(n))
            for i, (t, s, k, n) in enumerate(zip(arrivals, size, tier, tenant))]


def inter_arrival_cv(requests: Sequence[SimRequest]) -> float:
    """Coefficient of variation of the gaps between consecutive arrivals (1 for Poisson)."""
    gaps = np.diff([0.0, *(r.arrival for r in requests)])
    return float(gaps.std() / gaps.mean())


# -- trace files ---------------------------------------------------------------------------

COLUMNS = tuple(f.name for f in fields(SimRequest))  # request_id, arrival, ..., mask_ratio, tier, tenant, weight


def write_trace(path: str | Path, requests: Iterable[SimRequest]) -> None:
    """Write `requests` as CSV or JSONL, chosen by the suffix (.csv, .jsonl)."""
    path = Path(path)
    if path.suffix == ".csv":
        with path.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(COLUMNS)
            writer.writerows([_csv_cell(v) for v in asdict(r).values()] for r in requests)
    elif path.suffix == ".jsonl":
        with path.open("w") as f:
            f.writelines(json.dumps(asdict(r)) + "\n" for r in requests)
    else:
        raise ValueError(f"trace file must end in .csv or .jsonl, got {path.name!r}")


def _csv_cell(value) -> str:
    """Empty for None; repr for floats, which reads back to the very same float."""
    if value is None:
        return ""
    return repr(value) if isinstance(value, float) else str(value)


def read_trace(path: str | Path) -> list[SimRequest]:
    """Read a trace written by `write_trace` (or by hand: request_id, slo_s, mask_ratio, tier,
    tenant, weight and frames optional)."""
    path = Path(path)
    if path.suffix == ".csv":
        with path.open(newline="") as f:
            rows = [{k: (v if v != "" else None) for k, v in row.items()} for row in csv.DictReader(f)]
    elif path.suffix == ".jsonl":
        with path.open() as f:
            rows = [json.loads(line) for line in f if line.strip()]
    else:
        raise ValueError(f"trace file must end in .csv or .jsonl, got {path.name!r}")
    return [_from_row(i, row, path) for i, row in enumerate(rows)]


def _from_row(index: int, row: dict, path: Path) -> SimRequest:
    missing = [c for c in ("arrival", "width", "height", "steps") if row.get(c) is None]
    _check(not missing, f"{path}: row {index + 1} lacks {', '.join(missing)}")

    def optional(key: str) -> float | None:
        value = row.get(key)
        return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)

    return SimRequest(
        request_id=str(row.get("request_id") or f"r{index}"),
        arrival=float(row["arrival"]), width=int(row["width"]), height=int(row["height"]),
        steps=int(row["steps"]), slo_s=optional("slo_s"), mask_ratio=optional("mask_ratio"),
        tier=str(row.get("tier") or "default"), tenant=str(row.get("tenant") or ""),
        weight=optional("weight") or 1.0, frames=int(row.get("frames") or 1),
    )


# -- masks with a heavy tail (docs/routing.md) -----------------------------------------------

def mixed_masks(n: int, mean: float, full_share: float, rng: np.random.Generator, shape: float = 2.0) -> np.ndarray:
    """[n] mask ratios of mean `mean`: a `full_share` of them 1.0 (whole-image edits, or
    generations mixed in with the edits), the rest small, Beta(shape, b) of the mean that leaves,
    (mean - full_share) / (1 - full_share). InstGenIE gives only the means and says that the
    ratios vary widely; this is the heavy-tailed reading of that, Beta(2, b) the mild one."""
    _check(0 <= full_share < mean < 1, f"need 0 <= full_share < mean < 1, got {full_share} and {mean}")
    masks = rng.beta(*mask_beta((mean - full_share) / (1 - full_share), shape), size=n)
    masks[rng.random(n) < full_share] = 1.0
    return masks


def with_masks(requests: Sequence[SimRequest], masks: Sequence[float]) -> list[SimRequest]:
    """`requests` with these mask ratios, in order (arrivals and sizes kept)."""
    from dataclasses import replace

    _check(len(masks) == len(requests), f"{len(requests)} requests need as many masks, got {len(masks)}")
    return [replace(r, mask_ratio=float(m)) for r, m in zip(requests, masks)]
