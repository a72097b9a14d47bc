"""T(resolution, k): per-step seconds of one image (or clip) with k devices of sequence
parallelism (TetriServe §4.2.1), a lookup table, and the assumptions behind the FLUX.1-dev H100 default.
Measured tables come from `gouache profile --devices N`; derivations in docs/costmodels.md.
Plain Python (no scikit-learn), so the simulator can load it cheaply.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from gouache.sched.cost_fields import MAX_DEGREE, MAX_FRAMES, entries, field, integer, seconds, side
from gouache.sched.interface import Resolution, as_resolution


@dataclass
class FluxH100Assumptions:
    """Every number behind `ParallelCostModel.h100_flux_default()`; sources in docs/costmodels.md."""

    # TetriServe Table 1: FLUX.1-dev TFLOPs by square image side. They are whole-generation
    # totals, not per step (24,964 TFLOPs per step would take 25 s per step at full H100 peak).
    table1_tflops: tuple[tuple[int, float], ...] = ((256, 556.48), (512, 1388.24), (1024, 5045.92), (2048, 24964.72))
    table1_steps: int = 50  # steps those totals cover (assumed; reconciles the anchors below)
    peak_tflops: float = 989.0  # H100 SXM dense bf16 tensor-core peak, TFLOP/s
    mfu: float = 0.42  # achieved fraction of peak, eager PyTorch: xDiT's 1-H100 FLUX.1-dev 1024 px time
    params: float = 12e9  # FLUX.1-dev transformer parameters (TetriServe §2.1: "12B")
    bytes_per_param: int = 2  # bf16 weights
    hbm_gbps: float = 3350.0  # H100 SXM HBM3 bandwidth, GB/s
    hbm_efficiency: float = 0.8  # achieved fraction of HBM bandwidth when streaming weights (assumed)
    px_per_token: int = 16  # 8x VAE downsampling, then 2x2 patchify (Table 1: 256 px -> 256 tokens)
    text_tokens: int = 512  # T5 tokens joined to the image tokens (diffusers' FluxPipeline default)
    hidden: int = 3072  # FLUX.1-dev hidden size
    attention_layers: int = 57  # 19 double-stream + 38 single-stream blocks, one attention each
    all_to_alls_per_layer: int = 4  # Ulysses: q, k, v sequence->head shards, output head->sequence
    bytes_per_activation: int = 2  # bf16 activations
    link_gbps: float = 450.0  # NVLink 4 per GPU per direction (900 GB/s both ways, TetriServe §6.1)
    link_efficiency: float = 0.6  # achieved fraction of link bandwidth by NCCL all-to-all (assumed)
    collective_latency_s: float = 40e-6  # fixed cost per all-to-all, fitted to xDiT's 2/4-GPU times
    degrees: tuple[int, ...] = (1, 2, 4, 8)  # one 8-GPU node; FLUX's 24 heads split evenly
    latent_channels: int = 16  # FLUX VAE latents, one per 8x8 pixels
    text_dim: int = 4096  # T5-XXL states a request carries with it (text_tokens of them)

    def handoff(self) -> tuple[float, float]:
        """(fixed seconds, seconds per megapixel) to move a started request to other devices
        between rounds: its T5 states and one collective's latency, then its latents (pixels /
        64 x channels values), over the same link as the all-to-alls."""
        link = self.link_efficiency * self.link_gbps * 1e9
        text = self.text_tokens * self.text_dim * self.bytes_per_activation
        latents_per_megapixel = 1e6 / 64 * self.latent_channels * self.bytes_per_activation
        return self.collective_latency_s + text / link, latents_per_megapixel / link

    def step_time(self, side: int, k: int) -> float:
        """Seconds of one FLUX.1-dev step of a side x side image on k H100s (Ulysses SP)."""
        tflops = dict(self.table1_tflops)[side] / self.table1_steps
        compute = tflops * 1e12 / (k * self.mfu * self.peak_tflops * 1e12)
        # However few tokens a device holds, every step reads all weights once.
        weights = self.params * self.bytes_per_param / (self.hbm_efficiency * self.hbm_gbps * 1e9)
        return max(compute, weights) + self.communication_time(side, k)

    def communication_time(self, side: int, k: int) -> float:
        if k == 1:
            return 0.0
        tokens = (side // self.px_per_token) ** 2 + self.text_tokens
        sent = tokens / k * self.hidden * self.bytes_per_activation * (k - 1) / k  # bytes out of each GPU
        one = self.collective_latency_s + sent / (self.link_efficiency * self.link_gbps * 1e9)
        return self.attention_layers * self.all_to_alls_per_layer * one

    def table(self) -> dict[Resolution, dict[int, float]]:
        return {(s, s): {k: self.step_time(s, k) for k in self.degrees} for s, _ in self.table1_tflops}


class ParallelCostModel:
    """T(resolution, k): per-step seconds with k devices of sequence parallelism, k a power of two."""

    kind = "parallel"

    def __init__(self, table: Mapping[int | Sequence[int], Mapping[int, float]], source: str = ""):
        self.table: dict[Resolution, dict[int, float]] = {}
        for res, row in table.items():
            for k, took in row.items():
                if k < 1 or k & (k - 1) or took <= 0:
                    raise ValueError(f"{res}: degrees must be powers of two and times positive, got k={k}, {took} s")
            self.table[as_resolution(res)] = {int(k): float(s) for k, s in sorted(row.items())}
        self.source = source  # where the numbers came from: a profile run, or a derivation

    @classmethod
    def h100_flux_default(cls, assumptions: FluxH100Assumptions | None = None) -> ParallelCostModel:
        """FLUX.1-dev on H100 SXM (NVLink), derived from published figures, not measured here."""
        a = assumptions or FluxH100Assumptions()
        return cls(a.table(), source=f"derived: FluxH100Assumptions{asdict(a)}; see docs/costmodels.md")

    @property
    def resolutions(self) -> list[Resolution]:
        return list(self.table)

    def degrees(self, res: int | Sequence[int]) -> list[int]:
        return list(self._row(res))

    def seconds(self, res: int | Sequence[int], k: int = 1) -> float:
        """T(res, k): one step of one image of `res` on k devices."""
        row = self._row(res)
        if k not in row:
            raise KeyError(f"no profile of {as_resolution(res)} at k={k}; profiled degrees: {list(row)}")
        return row[k]

    def step_time(self, resolutions: Sequence[Resolution], patched: bool, degree: int = 1) -> float:
        """`StepTimePredictor` for the policies: T(res, degree) of one image; inf for a batch or a
        patched forward, which this model does not price (so round policies never batch on it),
        and for a degree it has no time for."""
        if patched or len(resolutions) != 1:
            return math.inf
        return self._row(resolutions[0]).get(degree, math.inf)

    def sizes(self, patched: bool) -> set[Resolution] | None:
        return set() if patched else set(self.table)

    def standalone_latency(self, res: int | Sequence[int], steps: int, k: int = 1) -> float:
        """Seconds of `steps` denoising steps alone on k devices (no queueing)."""
        return steps * self.seconds(res, k)

    def scaling_efficiency(self, res: int | Sequence[int], k: int) -> float:
        """T(res, 1) / (k * T(res, k)): 1 is linear scaling; below 1/k is a slowdown."""
        return self.seconds(res, 1) / (k * self.seconds(res, k))

    def to_json(self) -> dict[str, Any]:
        rows = [
            {"height": res[0], "width": res[1], **({"frames": res[2]} if len(res) == 3 else {}), "k": k,
             "seconds": seconds}
            for res, row in self.table.items()
            for k, seconds in row.items()
        ]
        return {"kind": self.kind, "source": self.source, "table": rows}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ParallelCostModel:
        """A model from `to_json()`'s data; a ValueError naming the row whose number the
        planners cannot use (`cost_fields`), or that repeats another's."""
        table: dict[Resolution, dict[int, float]] = {}
        for i, row in enumerate(entries(*field(data, "table"), 1)):
            where = f"table[{i}]"
            res = (side(*field(row, "height", where)), side(*field(row, "width", where)))
            if "frames" in row:  # a clip's
                res += (integer(*field(row, "frames", where), high=MAX_FRAMES),)
            k = integer(*field(row, "k", where), high=MAX_DEGREE)
            if k & (k - 1) or k in table.get(res, {}):
                raise ValueError(f"{where}.k must be a power of two, once per resolution; got {k} for {res}")
            table.setdefault(res, {})[k] = seconds(*field(row, "seconds", where))
        return cls(table, str(data.get("source", "")))

    def _row(self, res: int | Sequence[int]) -> dict[int, float]:
        key = as_resolution(res)
        if key not in self.table:
            raise KeyError(f"no profile of resolution {key}; profiled: {self.resolutions}")
        return self.table[key]
