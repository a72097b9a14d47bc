"""The step cost of a fleet's mixed traffic: FLUX generations and masked edits of any size, some
with a LoRA or a ControlNet, priced per request.

Base: InstGenIE's FLUX.1-dev edit model on an H100 (`exp_instgenie.COST_MODELS["3-term"]`,
`MaskStepCost`): a forward costs F, each request in it P plus its masked tokens' compute
m·C(L) (m = 1 for a generation), C(L) from FLUX's FLOPs at L latent tokens. So a 1024 px
generation's step alone is 0.243 s, a 512 px one's 0.130 s, and an edit at m = 0.2 is 1.9x
faster than a generation of its size.

Adapters multiply a request's share, P + m·C, by a factor chosen so that a lone 1024 px
generation's step is the measured ratio of this repo's H200 benches (eager, bf16):
- LoRA 1.061: `benchmarks/results/gpu/lora_flux-arch_h200.json`, flux-arch, segmented rank
  16, a step of four requests with their LoRA over one without (rank 64: 1.063);
- ControlNet 1.182: `benchmarks/results/gpu/controlnet_sdxl-arch_h200.json`, sdxl-arch at
  512 px, the async ControlNet service over a plain step (the only model it was measured on;
  sync: 2.04).
A request with both pays both. The factor is per request, so a batch's cost grows with the
adapters in it and a lone request sees the measured ratio.

A patched forward over two or more sizes costs `patched_overhead` more (5 %, the assumed
overhead of `exp_patchedserve`; one size is a plain batch).

Three faces of one cost: `__call__` is what the simulator charges; `batch_step_time` is the
mask-aware router's prediction over `RouteRequest`s (exact: it reads ids); `step_time` is the
predictor a deadline policy plans with, which sees sizes only, as live: every request is
priced as a plain generation, which over-prices edits and under-prices adapters (by up to
18 %).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from gouache.request import RequestState
from gouache.sched.interface import Resolution
from gouache.sched.plan import Batch
from gouache.sched.router import RouteRequest
from gouache.sim.diurnal import FleetTrace
from gouache.sim.exp_instgenie import COST_MODELS, MaskStepCost

LORA_STEP_RATIO = 1.061  # lora_flux-arch_h200.json: flux-arch "segmented rank 16", eager
CONTROLNET_STEP_RATIO = 1.182  # controlnet_sdxl-arch_h200.json: sdxl-arch 512 px, "async"
PATCHED_OVERHEAD = 0.05  # exp_patchedserve's assumed overhead of a forward over several sizes


@dataclass(frozen=True)
class FleetStepCost:
    """Seconds of one step: F (+ patched overhead) + Σ members' share, a member's share being
    its adapters' factor x (P + m·C(L)), made once per request of the trace (`shares`)."""

    base: MaskStepCost  # F, P, C (and each edit's mask ratio, for requests outside `shares`)
    shares: Mapping[str, float] = field(default_factory=dict, repr=False)  # request id -> seconds it adds to a step
    patched_overhead: float = PATCHED_OVERHEAD

    @classmethod
    def for_trace(cls, trace: FleetTrace, base: MaskStepCost | None = None, lora: float = LORA_STEP_RATIO,
                  controlnet: float = CONTROLNET_STEP_RATIO) -> FleetStepCost:
        """This cost with the trace's masks and adapters."""
        base = (base or COST_MODELS["3-term"].cost()).for_trace(trace.requests)
        lora_f, cn_f = share_factor(base, lora), share_factor(base, controlnet)
        shares = {}
        for r in trace.requests:
            factor = lora_f if r.request_id in trace.lora else 1.0
            factor *= cn_f if r.request_id in trace.controlnet else 1.0
            mask = 1.0 if r.mask_ratio is None else r.mask_ratio
            shares[r.request_id] = factor * base.request_s(base.tokens((r.height, r.width)), mask)
        return cls(base, shares)

    def __call__(self, batch: Batch, states: dict[str, RequestState]) -> float:
        ids = batch.request_ids
        seconds = self.base.per_forward_s + sum([self.share(rid, states[rid].resolution) for rid in ids])
        if batch.patched and len({states[rid].resolution for rid in ids}) > 1:
            seconds *= 1 + self.patched_overhead
        return seconds

    def share(self, request_id: str, resolution: Resolution) -> float:
        """Seconds a request adds to a step (a request outside the trace: a plain one of its size)."""
        seconds = self.shares.get(request_id)
        if seconds is None:
            base = self.base
            seconds = base.request_s(base.tokens(resolution), base.mask_ratio.get(request_id, 1.0))
        return seconds

    def alone_s(self, request_id: str, resolution: Resolution) -> float:
        """One step of the request alone: its latency per step on an idle device."""
        return self.base.per_forward_s + self.share(request_id, resolution)

    def batch_step_time(self, batch: Sequence[RouteRequest]) -> float:
        """One forward over the router's view of requests, adapters and masks included (no
        patching overhead: the router does not know how the replica will group them)."""
        shares, base = self.shares, self.base
        return base.per_forward_s + sum([
            shares[r.request_id] if r.request_id in shares
            else base.request_s(r.pixels // base.px_per_token**2, r.mask_ratio) for r in batch])

    def step_time(self, resolutions: Sequence[Resolution], patched: bool, degree: int = 1) -> float:
        """The predictor's view: plain generations of these sizes, one forward if `patched`,
        else one per size; one device only."""
        if degree != 1:
            return float("inf")
        if patched:
            seconds = self._plain_forward(resolutions)
            return seconds * (1 + self.patched_overhead) if len(set(resolutions)) > 1 else seconds
        groups: dict[Resolution, list[Resolution]] = {}
        for res in resolutions:
            groups.setdefault(tuple(res), []).append(res)
        return sum(self._plain_forward(group) for group in groups.values())

    def sizes(self, patched: bool) -> None:
        return None

    def standalone(self, width: int, height: int, steps: int) -> float:
        """Seconds of a plain generation alone: what SLOs are multiples of."""
        return steps * self._plain_forward([(height, width)])

    def _plain_forward(self, resolutions: Sequence[Resolution]) -> float:
        base = self.base
        return base.per_forward_s + sum(base.request_s(base.tokens(res), 1.0) for res in resolutions)


def share_factor(base: MaskStepCost, step_ratio: float, resolution: Resolution = (1024, 1024)) -> float:
    """The factor on a request's share P + C that makes a lone generation's step `step_ratio`
    times its plain step: (F + f·S) / (F + S) = r, so f = 1 + (r - 1)(F + S) / S."""
    share = base.request_s(base.tokens(resolution), 1.0)
    return 1 + (step_ratio - 1) * (base.per_forward_s + share) / share
