"""Adapters on a denoiser's weights: merged in place, or applied per row of one forward.

- **Merged** (`Merged`): W += s * B @ A on the base weights themselves, no layer created or
  replaced (KATZ §6). A host copy of each weight an adapter touches is kept while it is
  touched, and unmerging copies it back: the base weights come back bit for bit. Subtracting
  the update instead would leave a rounding error with every merge, which a long-running server
  would accumulate into its base model (docs/adapters.md).
- **Segmented** (`segmented`): forward hooks on the adapted modules add each row's own update
  x_rows @ A^T @ B^T * s to the base output, so requests with different adapter sets share one
  forward. Updates are relative to whatever is merged: a row whose set is the merged one gets
  nothing, another row its own set's update minus the merged set's.

A hook sees a module's input, not whose rows it holds: the caller gives, for every leading
size the forward's tensors can have, the forward row (request row) of each index of that
dimension (`row_maps`). A forward whose tensors take sizes outside that map raises.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from gouache.adapters.lora import Lora, LoraError

Adapters = tuple[tuple[Lora, float], ...]  # a request's adapters with their scales


def adapters_key(adapters: Adapters) -> tuple[tuple[str, float, int], ...]:
    """What tells adapter sets apart: names, scales and file versions."""
    return tuple(sorted((lora.name, scale, lora.version) for lora, scale in adapters))


class Merged:
    """The adapter set merged into one denoiser's weights now: one per denoiser (`of`), which
    every runner of that model shares."""

    @classmethod
    def of(cls, denoiser: nn.Module) -> Merged:
        if "_gouache_merged" not in denoiser.__dict__:
            denoiser.__dict__["_gouache_merged"] = cls(denoiser)
        return denoiser.__dict__["_gouache_merged"]

    def __init__(self, denoiser: nn.Module):
        self.denoiser = denoiser
        self.adapters: Adapters = ()
        self._originals: dict[str, torch.Tensor] = {}  # touched weights as they were before any merge (host)

    @property
    def key(self) -> tuple[tuple[str, float, int], ...]:
        return adapters_key(self.adapters)

    @torch.no_grad()
    def set(self, adapters: Adapters) -> bool:
        """Merge `adapters` in place of what is merged; whether the weights changed."""
        if adapters_key(adapters) == self.key:
            return False
        old, self.adapters = self.adapters, tuple(adapters)
        for path in sorted(_paths(old) | _paths(self.adapters)):
            weight = self.denoiser.get_submodule(path).weight
            original = self._originals.setdefault(path, weight.detach().to("cpu", copy=True))
            if path in _paths(self.adapters):
                weight.copy_((original.to(weight.device).float() + _update(self.adapters, path, weight)).to(weight.dtype))
            else:
                weight.copy_(original.to(weight.device))
                del self._originals[path]
        return True


def _paths(adapters: Adapters) -> set[str]:
    return {path for lora, _ in adapters for path in lora.layers}


def _update(adapters: Adapters, path: str, weight: torch.Tensor) -> torch.Tensor:
    """The float32 sum of `adapters`' updates to the weight of `path` (zeros if none)."""
    total = torch.zeros(weight.shape, device=weight.device)
    for lora, scale in adapters:
        if path in lora.layers:
            total += scale * lora.layers[path].delta(weight)
    return total


@contextlib.contextmanager
def segmented(denoiser: nn.Module, row_adapters: Sequence[Adapters], merged: Adapters,
              row_maps: dict[int, torch.Tensor], spent: list[float] | None = None) -> Iterator[None]:
    """Within: each forward row r gets `row_adapters[r]`'s update (relative to `merged`) on
    every module they adapt. `row_maps[n]`: [n] forward row of each index of a leading
    dimension of size n. `spent[0]` accumulates the seconds the updates took."""
    merged_key = adapters_key(merged)
    groups: dict[tuple, Adapters] = {}
    row_group = []
    for adapters in row_adapters:
        key = adapters_key(adapters)
        if key == merged_key:
            row_group.append(-1)
            continue
        groups.setdefault(key, tuple(adapters) + tuple((lora, -scale) for lora, scale in merged))
        row_group.append(list(groups).index(key))
    if not groups:
        yield
        return
    tags = torch.tensor(row_group)
    rows_of: dict[int, list[torch.Tensor]] = {}  # leading size -> indices of each group

    def rows(x: torch.Tensor) -> tuple[int, list[torch.Tensor]]:
        """The dimension of x that holds rows (0; 1 in a packed forward's [1, S, D] views) and
        each group's indices along it."""
        dim = 1 if x.shape[0] not in row_maps and x.ndim > 2 and x.shape[0] == 1 else 0
        n = x.shape[dim]
        if n not in row_maps:
            raise LoraError(f"a tensor of shape {tuple(x.shape)} has no known owner rows; this forward cannot mix adapters")
        if n not in rows_of:
            owner = tags[row_maps[n].cpu()]
            rows_of[n] = [(owner == g).nonzero().squeeze(1).to(x.device) for g in range(len(groups))]
        return dim, rows_of[n]

    paths = {path for adapters in groups.values() for lora, _ in adapters for path in lora.layers}
    layers_of = {path: [[(lora.layers[path], scale) for lora, scale in adapters if path in lora.layers]
                        for adapters in groups.values()] for path in paths}  # per path, each group's layers

    def hook(path: str, module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        start, x = time.perf_counter(), args[0]
        dim, indices = rows(x)
        for index, layers in zip(indices, layers_of[path]):
            if not len(index) or not layers:
                continue
            part = x.index_select(dim, index)
            update = sum(scale * layer.forward(module, part) for layer, scale in layers)
            output.index_add_(dim, index, update.to(output.dtype))
        if spent is not None:
            spent[0] += time.perf_counter() - start
        return output

    handles = [denoiser.get_submodule(path).register_forward_hook(
        lambda module, args, output, path=path: hook(path, module, args, output)) for path in sorted(paths)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
