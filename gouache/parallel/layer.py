"""The parallel layer of a step's forward (`gouache.forward_layers`): a step of degree > 1 runs
on the devices of a worker's process group, its split installed on the denoiser while the
layers inside run: Ulysses sequence shards (DiTs) or CFG halves (UNets)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from gouache.forward_layers import Inner, Predictions, RowMaps, Split, Step


class ParallelLayer:
    technique = "parallel"

    def __init__(self, pipe, degree: int, group, device, compiled=None):
        """`compiled`: the model's `CompiledDenoiser` under --compile (CFG halves split its calls;
        Ulysses shards go to it, for the family's pieces)."""
        self.pipe, self.degree, self.group, self.device, self.compiled = pipe, degree, group, device, compiled
        self.collective_s = 0.0  # seconds this rank spent in the splits' collectives

    def uses(self, step: Step, state) -> frozenset[str]:
        return frozenset({"parallel"}) if self.degree > 1 else frozenset()

    def __call__(self, step: Step, inner: Inner) -> Predictions:
        with split_step(self.pipe, step.states, self.degree, self.group, self.device, self.compiled) as split:
            try:
                return inner(step.of(step.states, split=split))
            finally:
                self.collective_s += split.collective_s if split is not None else 0.0

    def rows(self, step: Step, inner: Inner) -> RowMaps | None:
        return inner.rows(step)


class _Whole:
    """A step every rank runs whole, rows and tokens (a CFG batch with a request without
    guidance): residuals overlap the encoder as on one device; ranks agree on failures."""

    residuals_first = False
    collective_s = 0.0

    def __init__(self, group, device):
        self.group, self.device = group, device

    def rows(self, maps: RowMaps) -> RowMaps:
        return maps

    def agree(self, ok: bool) -> bool:
        return all_ok(ok, self.group, self.device)


class _Halves(_Whole):
    """CFG halves: this rank runs every other row, from its rank."""

    residuals_first = True  # the rows are cut before the UNet runs

    def __init__(self, group, device, halves):
        super().__init__(group, device)
        self.rank, self._halves = dist.get_rank(group), halves

    def rows(self, maps: RowMaps) -> RowMaps:
        return {n // 2: rows[self.rank::2] for n, rows in maps.items()}

    @property
    def collective_s(self) -> float:
        return self._halves.collective_s


class _Sequence(_Whole):
    """Ulysses: every rank holds every row and a shard of each image's tokens."""

    def __init__(self, group, device, shards):
        super().__init__(group, device)
        self._shards = shards

    @property
    def collective_s(self) -> float:
        return self._shards.collective_s if self._shards is not None else 0.0


@contextlib.contextmanager
def split_step(pipe, states: list, degree: int, group, device, compiled=None) -> Iterator[Split | None]:
    """The parallel split of a step of `degree` over `group` (None at degree 1), installed on
    the denoiser (or its `compiled` one's calls) while inside: a UNet's CFG halves (every
    request with guidance), a DiT's Ulysses sequence shards (under --compile, where its pieces
    take them, handed to the `compiled` one instead: `gouache.parallel.ulysses.ulysses`)."""
    if degree == 1:
        yield None
        return
    if group is None:
        raise ValueError(f"a batch of degree {degree} needs the process group of its devices")
    from gouache.parallel.ulysses import check_degree, ulysses

    check_degree(pipe, degree)
    if getattr(pipe, "unet", None) is None:
        with ulysses(pipe.transformer, group, compiled) as shards:
            yield _Sequence(group, device, shards)
        return
    if not all(s.rows == 2 for s in states):  # a request without guidance: both ranks run every row
        yield _Whole(group, device)
        return
    from gouache.parallel.cfg import cfg_parallel

    with cfg_parallel(pipe.unet, group, compiled) as halves:
        yield _Halves(group, device, halves)


def all_ok(ok: bool, group, device) -> bool:
    """Whether every rank of `group` is ok (each says for itself)."""
    flag = torch.tensor([1 if ok else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
