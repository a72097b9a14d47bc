"""CFG (latent) parallelism (KATZ §7): the unconditional and conditional rows of a step on two
devices, their predictions exchanged, so that both end the step with every row's prediction
and step their samplers alike.

While inside `cfg_parallel`, a call of the denoiser made on both ranks of a group with the same
full inputs, over requests that all use guidance (rows [uncond, cond] each), runs only this
rank's rows: the unconditional ones on rank 0, the conditional ones on rank 1. Every argument
whose leading size is the forward's rows is cut to them (latents, timesteps, text, SDXL's added
conditioning, ControlNet residuals); the two halves are gathered and put back in row order. A
UNet's rows are independent, so the result equals one device's run of all of them. A batch
with a request without guidance (one row) is not split: both ranks run every row.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn


def _cut(value, rank: int, rows: int):
    """`value` with its leading dimension cut to this rank's rows where that dimension is the rows."""
    if isinstance(value, torch.Tensor):
        return value[rank::2] if value.ndim and value.shape[0] == rows else value
    if isinstance(value, dict):
        return {k: _cut(v, rank, rows) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_cut(v, rank, rows) for v in value)
    return value


class Halves:
    """What a CFG-parallel step spent exchanging its halves."""

    collective_s: float = 0.0


@contextlib.contextmanager
def cfg_parallel(denoiser: nn.Module, group: dist.ProcessGroup) -> Iterator[Halves]:
    """Within: a call of `denoiser(sample, ...)` whose rows are [uncond, cond] pairs runs this
    rank's half and returns every row's output (the first output, as diffusers' tuple)."""
    if dist.get_world_size(group) != 2:
        raise ValueError(f"CFG parallelism splits a step in two halves, on 2 devices, not {dist.get_world_size(group)}")
    rank = dist.get_rank(group)
    original = denoiser.forward
    halves_of = Halves()

    def forward(sample: torch.Tensor, *args, **kwargs):
        rows = sample.shape[0]
        local = original(*_cut((sample, *args), rank, rows), **_cut(kwargs, rank, rows))
        local = (local[0] if isinstance(local, tuple) else local.sample).contiguous()
        halves = [torch.empty_like(local) for _ in range(2)]
        start = time.perf_counter()
        dist.all_gather(halves, local, group=group)
        halves_of.collective_s += time.perf_counter() - start
        out = local.new_empty((rows, *local.shape[1:]))
        out[0::2], out[1::2] = halves
        return (out,)

    previous = denoiser.__dict__.get("forward")  # another wrapper's, kept
    denoiser.forward = forward
    try:
        yield halves_of
    finally:
        if previous is None:
            del denoiser.forward  # the class's forward again
        else:
            denoiser.forward = previous
