"""CFG (latent) parallelism (KATZ §7): the unconditional and conditional rows of a step on two
devices, their predictions exchanged, so that both end the step with every row's prediction
and step their samplers alike.

While inside `cfg_parallel`, a call of the denoiser made on both ranks of a group with the same
full inputs, over requests that all use guidance (rows [uncond, cond] each), runs only this
rank's rows: the unconditional ones on rank 0, the conditional ones on rank 1. Every argument
whose leading size is the forward's rows is cut to them (latents, timesteps, text, SDXL's added
conditioning, ControlNet residuals); the two halves are gathered and put back in row order. A
UNet's rows are independent, so the result equals one device's run of all of them. A batch
with a request without guidance (one row) is not split: both ranks run every row. Under
--compile the compiled denoiser's calls are split the same way, each half through the row
graph of its rows (the gather outside the graph).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

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
    """This rank's half of a CFG-parallel step's rows, and what it spent exchanging them."""

    def __init__(self, group: dist.ProcessGroup):
        self.group, self.rank = group, dist.get_rank(group)
        self.collective_s = 0.0

    def run(self, forward: Callable[..., torch.Tensor], rows: int, *args, **kwargs) -> torch.Tensor:
        """forward(*args, **kwargs) on this rank's rows of `rows` (every argument whose leading
        size is `rows` cut to them): every row's output, the other rank's gathered."""
        local = forward(*_cut(args, self.rank, rows), **_cut(kwargs, self.rank, rows)).contiguous()
        halves = [torch.empty_like(local) for _ in range(2)]
        start = time.perf_counter()
        dist.all_gather(halves, local, group=self.group)
        self.collective_s += time.perf_counter() - start
        out = local.new_empty((rows, *local.shape[1:]))
        out[0::2], out[1::2] = halves
        return out


@contextlib.contextmanager
def cfg_parallel(denoiser: nn.Module, group: dist.ProcessGroup, compiled=None) -> Iterator[Halves]:
    """Within: a call of `denoiser(sample, ...)` whose rows are [uncond, cond] pairs runs this
    rank's half and returns every row's output (the first output, as diffusers' tuple). Under
    --compile (`compiled`, the model's `CompiledDenoiser`) its calls are split instead, so that
    each half runs the row graph of its rows."""
    if dist.get_world_size(group) != 2:
        raise ValueError(f"CFG parallelism splits a step in two halves, on 2 devices, not {dist.get_world_size(group)}")
    halves = Halves(group)
    if compiled is not None:
        compiled.split = halves
        try:
            yield halves
        finally:
            compiled.split = None
        return
    original = denoiser.forward

    def first(*args, **kwargs) -> torch.Tensor:
        out = original(*args, **kwargs)
        return out[0] if isinstance(out, tuple) else out.sample

    def forward(sample: torch.Tensor, *args, **kwargs):
        return (halves.run(first, sample.shape[0], sample, *args, **kwargs),)

    previous = denoiser.__dict__.get("forward")  # another wrapper's, kept
    denoiser.forward = forward
    try:
        yield halves
    finally:
        if previous is None:
            del denoiser.forward  # the class's forward again
        else:
            denoiser.forward = previous
