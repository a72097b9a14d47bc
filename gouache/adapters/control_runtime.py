"""ControlNets in a model runner: what a request asked (`ControlUse`, on its denoising state),
and the residuals of a forward's rows.

A forward of one latent shape takes every row's residuals at once: rows without ControlNets
get zeros (which add nothing, exactly), and each ControlNet runs once over the rows of all the
requests that use it, whatever their conditioning images and scales (a residual is scaled per
row afterwards, as diffusers scales it last). Several ControlNets of a request are summed in
the order the request names them, as diffusers' MultiControlNetModel does.

Where they run is the runner's `ControlNetConfig`: in this process before the forward (the
sequential way of diffusers' pipelines), or on the ControlNet service (`control_service`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from gouache.adapters.controlnet import ControlNetCache, residuals, supports_controlnets
from gouache.adapters.directory import ControlNetError
from gouache.config import ControlNetConfig


@dataclass
class ControlUse:
    """A request's ControlNets: (name, conditioning [1, 3, H, W] in [0, 1], scale) each, and
    whether their residuals of step t join step t ("sync") or step t + 1 ("async")."""

    nets: tuple[tuple[str, torch.Tensor, float], ...]
    mode: str = "sync"


@dataclass
class ControlJob:
    """One ControlNet over some rows of a forward."""

    name: str
    rows: torch.Tensor  # [n] indices into the forward's rows
    cond: torch.Tensor  # [n, 3, H, W] each row's conditioning
    scale: torch.Tensor  # [n] each row's scale


class ControlRuntime:
    """The ControlNets of one runner's model."""

    def __init__(self, config: ControlNetConfig, pipe):
        self.config = config
        self.pipe = pipe
        self.unsupported = supports_controlnets(pipe)
        self.cache = ControlNetCache(config.directory, getattr(pipe, "unet", None), config.model_bytes)
        self._runs: dict[str, int] = {}  # ControlNet runs by mode since the last report
        self._wait_s = 0.0  # seconds forwards waited for residuals since the last report

    def check(self, name: str) -> None:
        """Raise ControlNetError unless this model can run ControlNet `name`."""
        if self.unsupported:
            raise ControlNetError(self.unsupported)
        self.cache.check(name)

    def check_request(self, names: list[str], mode: str | None) -> None:
        """Raise ControlNetError unless a request may run these ControlNets in this mode."""
        for name in names:
            self.check(name)
        if (mode or self.config.mode) == "async" and not self.config.workers:
            raise ControlNetError("async ControlNet residuals need the ControlNet service (--controlnet-workers)")

    def describe_all(self) -> list[dict]:
        return [self.cache.describe(name) for name in self.cache.names()]

    def load(self, name: str) -> dict:
        """Load ControlNet `name` where it runs (POST /v1/controlnets); what is held of it."""
        self.check(name)
        self.cache.get(name)
        return self.cache.describe(name)

    def take_report(self) -> dict:
        """The StepOutput fields of what ran since the last call."""
        loads, load_s = self.cache.counts.take()
        runs, wait_s, self._runs, self._wait_s = self._runs, self._wait_s, {}, 0.0
        return {"controlnet_runs": runs, "controlnet_wait_s": wait_s, "controlnet_loads": loads,
                "controlnet_load_s": load_s}

    def use(self, nets: tuple[tuple[str, float], ...], images: list[np.ndarray], mode: str | None,
            device: torch.device, dtype: torch.dtype) -> ControlUse | None:
        """A request's ControlNets with their decoded conditioning images (uint8 [H, W, 3])."""
        if not nets:
            return None
        self.check_request([name for name, _ in nets], mode)
        conds = [torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1)[None].to(device, torch.float32) / 255.0
                 for image in images]
        return ControlUse(tuple((name, cond.to(dtype), scale) for (name, scale), cond in zip(nets, conds)),
                          mode or self.config.mode)

    @torch.no_grad()
    def predict(self, states: list, forward: Callable, rest: Callable) -> list[torch.Tensor]:
        """Per state, its rows' predictions: each latent shape that has ControlNet requests in one
        forward with their residuals (`forward(group, control)`), the other states by `rest(group)`."""
        shapes = {tuple(s.latents.shape) for s in states if s.control is not None}
        out: dict[int, torch.Tensor] = {}
        for shape in shapes:
            members = [i for i, s in enumerate(states) if tuple(s.latents.shape) == shape]
            group = [states[i] for i in members]
            out.update(zip(members, forward(group, self.residuals).split([s.rows for s in group])))
        others = [i for i in range(len(states)) if i not in out]
        if others:
            out.update(zip(others, rest([states[i] for i in others])))
        return [out[i] for i in range(len(states))]

    def residuals(self, states: list, sample: torch.Tensor, timesteps: torch.Tensor, kwargs: dict) -> dict:
        """The UNet's residual arguments for a forward of `states` (rows in order)."""
        start, total = time.perf_counter(), None
        for job in jobs(states):
            added = kwargs.get("added_cond_kwargs")
            rows = job.rows.to(sample.device)
            parts = residuals(self.cache.get(job.name), sample[rows], timesteps[rows],
                              kwargs["encoder_hidden_states"][rows], job.cond,
                              {k: v[rows] for k, v in added.items()} if added else None)
            if total is None:
                total = [torch.zeros(len(sample), *p.shape[1:], device=p.device, dtype=p.dtype) for p in parts]
            scale = job.scale.to(sample.device, sample.dtype).view(-1, 1, 1, 1)
            for acc, part in zip(total, parts):
                acc.index_add_(0, rows, part * scale)
            self._runs["local"] = self._runs.get("local", 0) + 1
        self._wait_s += time.perf_counter() - start
        return {"down_block_additional_residuals": tuple(total[:-1]), "mid_block_additional_residual": total[-1]}


def jobs(states: list) -> list[ControlJob]:
    """The forward's ControlNet runs: one per ControlNet, over the rows of every state that
    names it, in the order they are first named (a request's residuals sum in its own order
    unless another request named them the other way round: equal for two, rounding for more)."""
    order: dict[str, list[tuple[int, torch.Tensor, float]]] = {}
    start = 0
    for state in states:
        for name, cond, scale in state.control.nets if state.control is not None else ():
            for row in range(start, start + state.rows):
                order.setdefault(name, []).append((row, cond, scale))
        start += state.rows
    return [ControlJob(name, torch.tensor([r for r, _, _ in rows]), torch.cat([c for _, c, _ in rows]),
                       torch.tensor([s for _, _, s in rows])) for name, rows in order.items()]
