"""Holds the denoising states of running requests and executes step plans on the model."""

from __future__ import annotations

import time

import numpy as np

from gouache.outputs import StepOutput
from gouache.request import ImageRequest, RequestState
from gouache.sched.output import StepPlan
from gouache.runner.families import Family, make_family
from gouache.runner.families.base import DEFAULT_PATCH_PIXELS
from gouache.runner.sampler import DenoiseState


class ModelRunner:
    """One model on one device. `prepare` and `decode` are called from the stage threads,
    `execute` from the engine thread; the only shared structure is `states`, whose entries
    are added before the scheduler learns of a request and removed after it finishes."""

    def __init__(self, pipe, patch_pixels: int = DEFAULT_PATCH_PIXELS):
        self.pipe = pipe
        self.family: Family = make_family(pipe, patch_pixels)
        self.states: dict[str, DenoiseState] = {}

    def prepare(self, request: ImageRequest, image: np.ndarray | None = None, mask: np.ndarray | None = None) -> RequestState:
        """Text encoding and initial latents; returns the scheduler's view of the request."""
        state = self.family.prepare(request, image, mask)
        self.states[request.request_id] = state
        scale = self.family.vae_scale
        shape = (request.height // scale, request.width // scale)
        deadline = request.arrival_time + request.slo_ms / 1000 if request.slo_ms else None
        return RequestState(
            request_id=request.request_id,
            shape=shape,
            num_steps=len(state.timesteps),
            arrival_time=request.arrival_time,
            deadline=deadline,
        )

    def execute(self, plan: StepPlan) -> StepOutput:
        """One denoising step: one batched forward per group of the plan (patched if it says so)."""
        start = time.perf_counter()
        for group in plan.groups:
            self.family.step([self.states[rid] for rid in group], patched=plan.patched)
        return StepOutput(
            request_ids=plan.request_ids,
            forward_s=time.perf_counter() - start,
        )

    def decode(self, request_id: str, latents=None) -> np.ndarray:
        """The request's image, uint8 [H, W, 3]: of its final latents, or of a preview snapshot."""
        state = self.states[request_id]
        return self.family.decode(state, state.latents if latents is None else latents)

    def release(self, request_id: str) -> None:
        self.states.pop(request_id, None)
