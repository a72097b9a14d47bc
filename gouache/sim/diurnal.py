"""A day of traffic for a fleet: a diurnal arrival rate and a mix of sizes, edits, adapters and tiers.

Arrivals are a non-homogeneous Poisson process with rate

    λ(t) = mean_rps · (1 + amplitude · cos(2π (t/day_s - peak_hour/24))),

made by drawing a unit-rate Poisson process and mapping it through the inverse of the
cumulative rate Λ(t) (exact for any λ; `np.interp` on a grid of `_GRID` points a day).
`day_s` is the length of the day the trace spans: 86,400 s for a real day, less for a day whose
hours are compressed (the same rate at the same hour, each hour lasting day_s / 24 seconds).

Each request draws, from its own seeded stream:
- its size (square, pixels) by `size_shares`;
- whether it is an edit (`edit_share`); an edit's mask ratio is heavy-tailed: a Pareto
  power law P(m > x) ∝ x^-`mask_alpha` truncated to [`mask_min`, 1], so most masks are small
  and a tail reaches the whole image (mean 0.13, median 0.066, p99 0.85 at the defaults;
  InstGenIE reports means of 0.11 and 0.19);
- a LoRA (`lora_share`, generations and edits alike) and a ControlNet (`controlnet_share`
  of generations: an edit is conditioned by its image already);
- its service tier by `tier_shares` (priority, default, flex: exp_tiers' 20/60/20) and its
  tenant by `tenant_shares`;
- its SLO: its tier's multiple (`tier_slo_scale`) of the standalone latency of a plain
  generation of its size (None: no SLO), the figure a deadline policy plans with (its
  predictor sees sizes only, `gouache.sched.interface.StepTimePredictor`).

`SimRequest` has no adapter fields, so the trace carries the ids with a LoRA and with a
ControlNet beside its requests; the fleet's step cost reads them (`exp_fleet_day.FleetStepCost`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from gouache.request import TIERS
from gouache.sim.workloads import SimRequest

DAY_S = 86_400.0
_GRID = 24 * 60  # points of the cumulative rate per day: one a (possibly compressed) minute


@dataclass(frozen=True)
class DayMix:
    """What a day's requests ask for: shares of sizes, edits, adapters and tiers."""

    size_shares: tuple[tuple[int, float], ...] = ((512, 0.3), (768, 0.3), (1024, 0.4))  # (pixels, share)
    steps: int = 28  # FLUX.1-dev's default
    edit_share: float = 0.3  # requests that are masked edits
    mask_min: float = 0.03  # smallest mask ratio of an edit
    mask_alpha: float = 0.8  # Pareto exponent of the mask ratio's tail (smaller: heavier)
    lora_share: float = 0.3  # requests with a LoRA
    controlnet_share: float = 0.15  # generations with a ControlNet
    tier_shares: tuple[float, float, float] = (0.2, 0.6, 0.2)  # priority, default, flex (exp_tiers)
    tenant_shares: tuple[tuple[str, float], ...] = (("alpha", 0.5), ("beta", 0.3), ("gamma", 0.2))
    tier_slo_scale: tuple[float | None, float | None, float | None] = (2.0, 5.0, None)  # x standalone, per tier

    def __post_init__(self) -> None:
        for name, shares in (("size_shares", [s for _, s in self.size_shares]), ("tier_shares", self.tier_shares),
                             ("tenant_shares", [s for _, s in self.tenant_shares])):
            if not shares or abs(sum(shares) - 1) > 1e-9 or min(shares) < 0:
                raise ValueError(f"{name} must be shares summing to 1, got {shares}")
        for name in ("edit_share", "lora_share", "controlnet_share"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if not 0 < self.mask_min < 1 or self.mask_alpha <= 0:
            raise ValueError(f"mask_min must be in (0, 1) and mask_alpha > 0, got {self.mask_min}, {self.mask_alpha}")
        if len(self.tier_shares) != len(TIERS) or len(self.tier_slo_scale) != len(TIERS):
            raise ValueError(f"tier_shares and tier_slo_scale need one entry per tier ({', '.join(TIERS)})")


@dataclass(frozen=True)
class Diurnal:
    """The arrival rate over a day: a cosine around the mean, highest at `peak_hour`."""

    mean_rps: float  # requests per second averaged over the day
    amplitude: float = 0.6  # peak = mean·(1 + a), trough = mean·(1 - a)
    peak_hour: float = 20.0  # hour of the day the rate peaks
    day_s: float = DAY_S  # seconds the day lasts in the trace (< 86,400: hours compressed)

    def __post_init__(self) -> None:
        if self.mean_rps <= 0 or not 0 <= self.amplitude < 1 or self.day_s <= 0:
            raise ValueError("mean_rps and day_s must be positive and amplitude in [0, 1)")

    def rate(self, t: np.ndarray | float) -> np.ndarray | float:
        """λ(t), requests/s, t in seconds of the trace."""
        return self.mean_rps * (1 + self.amplitude * np.cos(2 * math.pi * (np.asarray(t) / self.day_s
                                                                            - self.peak_hour / 24)))

    def cumulative(self, t: np.ndarray) -> np.ndarray:
        """Λ(t) = ∫₀ᵗ λ: the expected arrivals by t."""
        phase = 2 * math.pi * self.peak_hour / 24
        w = 2 * math.pi / self.day_s
        return self.mean_rps * (t + self.amplitude / w * (np.sin(w * t - phase) + math.sin(phase)))

    def arrivals(self, rng: np.random.Generator) -> np.ndarray:
        """Arrival times over one day: a unit-rate Poisson process through Λ⁻¹."""
        grid = np.linspace(0.0, self.day_s, _GRID + 1)
        total = self.cumulative(grid)  # increasing: λ > 0 everywhere since amplitude < 1
        unit = np.cumsum(rng.exponential(1.0, size=int(total[-1] * 1.1) + 100))
        return np.interp(unit[unit < total[-1]], total, grid)


@dataclass(frozen=True)
class FleetTrace:
    """A day's requests and the adapters some of them carry."""

    requests: list[SimRequest]  # in arrival order
    lora: frozenset[str]  # ids of requests with a LoRA
    controlnet: frozenset[str]  # ids of requests with a ControlNet
    day: Diurnal  # the rate they were drawn at


# (width, height, steps) -> seconds of a plain generation alone: what SLOs are multiples of
Standalone = Callable[[int, int, int], float]


def fleet_day_trace(day: Diurnal, mix: DayMix, standalone: Standalone, seed: int = 0,
                    prefix: str = "r") -> FleetTrace:
    """One day of requests at `day`'s rate with `mix`'s shares; every draw has its own stream,
    so changing the rate keeps each request's mix and vice versa (up to the number drawn)."""
    arrival_rng, size_rng, edit_rng, mask_rng, lora_rng, cn_rng, tier_rng, tenant_rng = (
        np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(8))
    arrivals = day.arrivals(arrival_rng)
    n = len(arrivals)
    sizes = np.array([s for s, _ in mix.size_shares])
    size = sizes[size_rng.choice(len(sizes), n, p=[p for _, p in mix.size_shares])]
    edit = edit_rng.random(n) < mix.edit_share
    masks = truncated_pareto(mask_rng, n, mix.mask_min, mix.mask_alpha)
    lora = lora_rng.random(n) < mix.lora_share
    controlnet = (cn_rng.random(n) < mix.controlnet_share) & ~edit
    tier = tier_rng.choice(len(TIERS), n, p=mix.tier_shares)
    tenants = [t for t, _ in mix.tenant_shares]
    tenant = tenant_rng.choice(len(tenants), n, p=[p for _, p in mix.tenant_shares])
    solo = {int(s): standalone(int(s), int(s), mix.steps) for s in sizes}
    requests = []
    for i in range(n):
        scale = mix.tier_slo_scale[tier[i]]
        requests.append(SimRequest(
            f"{prefix}{i}", float(arrivals[i]), int(size[i]), int(size[i]), mix.steps,
            None if scale is None else scale * solo[int(size[i])],
            float(masks[i]) if edit[i] else None, TIERS[tier[i]], tenants[tenant[i]]))
    ids = np.array([r.request_id for r in requests], dtype=object)
    return FleetTrace(requests, frozenset(ids[lora]), frozenset(ids[controlnet]), day)


def truncated_pareto(rng: np.random.Generator, n: int, low: float, alpha: float) -> np.ndarray:
    """[n] draws of P(X > x) ∝ x^-alpha on [low, 1], by inverting the CDF
    F(x) = (1 - (low/x)^alpha) / (1 - low^alpha)."""
    u = rng.random(n)
    return low * (1 - u * (1 - low**alpha)) ** (-1 / alpha)
