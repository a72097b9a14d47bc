"""Adapters on a denoiser's weights: merged in place, or applied per row of one forward.

- **Merged** (`Merged`): W += s * B @ A on the base weights themselves, no layer created or
  replaced (KATZ §6). A host copy of each weight an adapter touches is kept while it is
  touched, and unmerging copies it back: the base weights come back bit for bit. Subtracting
  the update instead would leave a rounding error with every merge, which a long-running server
  would accumulate into its base model (docs/lora.md).
- **Segmented** (`segmented`): forward hooks on the adapted modules add each row's own update
  x_rows @ A^T @ B^T * s to the base output, so requests with different adapter sets share one
  forward. Updates are relative to whatever is merged: a row whose set is the merged one gets
  nothing, another row its own set's update minus the merged set's.

A hook sees a module's input, not whose rows it holds: the caller gives, for every leading
size the forward's tensors can have, the forward row (request row) of each index of that
dimension (`row_maps`). A forward whose tensors take sizes outside that map raises.

- **Slots** (`RowSlots`, under --compile): segments as a compiled graph holds them. A hook on
  every Linear and Conv2d, installed before the denoiser is compiled, adds the update of the
  pairs its slot holds (none: the output as it is), which the graph reads as inputs: the same
  graph serves any adapters of the same ranks on the same modules. A forward of whole rows
  binds each slot to its rows' pairs, padded as its rows are (`gouache.runner.compiled`); any
  other forward (a DiT's packed pieces, by their padded layout; an eager forward, by the row
  maps) takes every set's pairs side by side, each index keeping its own set's columns: one
  low-rank product of a few sets' ranks, with no shape that depends on who is whose. Ranks
  and columns are padded with zeros to a power of two, so that few graphs serve many.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gouache.lora.files import Lora, LoraError

Adapters = tuple[tuple[Lora, float], ...]  # a request's adapters with their scales


def adapters_key(adapters: Adapters) -> tuple[tuple[str, float, int], ...]:
    """What tells adapter sets apart: names, scales and file contents."""
    return tuple(sorted((lora.name, scale, lora.digest) for lora, scale in adapters))


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
                weight.copy_((original.to(weight.device).float() + _update(self.adapters, path, weight))
                             .to(weight.dtype))
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


class Factors:
    """Each group's adapters on one module as a single low-rank pair (their downs stacked, their
    ups scaled and joined), stacked over the groups with a zero group last and padded to one rank.
    Kept while a forward's groups stay the same (a running batch's, for several steps), so that
    a step pays one gather and two matmuls per module rather than a few per group."""

    def __init__(self):
        self._key: tuple = ()
        self._pairs: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def pair(self, key: tuple, groups: list[Adapters], path: str,
             like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(downs [G + 1, R, in, ...], ups [G + 1, out, R]) of `path` in `like`'s device and dtype."""
        if key != self._key:
            self._key, self._pairs = key, {}
        slot = (path, like.device, like.dtype)
        if slot not in self._pairs:
            self._pairs[slot] = _stack(groups, path, like)
        return self._pairs[slot]


def _stack(groups: list[Adapters], path: str, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    layers = [[(lora.layers[path], scale) for lora, scale in adapters if path in lora.layers] for adapters in groups]
    first = next(layer for group in layers for layer, _ in group)
    rank = max(sum(layer.down.shape[0] for layer, _ in group) for group in layers)
    downs = first.down.new_zeros((len(groups) + 1, rank, *first.down.shape[1:]))
    ups = first.up.new_zeros((len(groups) + 1, first.up.shape[0], rank))
    for g, group in enumerate(layers):
        r = 0
        for layer, scale in group:
            k = layer.down.shape[0]
            downs[g, r:r + k] = layer.down
            ups[g, :, r:r + k] = scale * layer.scale * layer.up.flatten(1)
            r += k
    return downs.to(like.device, like.dtype), ups.to(like.device, like.dtype)


def _rows_update(module: nn.Module, x: torch.Tensor, downs: torch.Tensor, ups: torch.Tensor) -> torch.Tensor:
    """Row i of x through its own pair (downs[i], ups[i]): batched matmuls, or grouped convs."""
    n = x.shape[0]
    if isinstance(module, nn.Conv2d):
        hidden = F.conv2d(x.reshape(1, -1, *x.shape[2:]), downs.flatten(0, 1), None, module.stride, module.padding,
                          module.dilation, groups=n)
        update = F.conv2d(hidden, ups.flatten(0, 1)[..., None, None], groups=n)
        return update.view(n, -1, *update.shape[2:])
    hidden = torch.matmul(x.reshape(n, -1, x.shape[-1]), downs.transpose(1, 2))
    return torch.matmul(hidden, ups.transpose(1, 2)).view(*x.shape[:-1], ups.shape[1])


def _add_rows_update(module: nn.Module, x: torch.Tensor, downs: torch.Tensor, ups: torch.Tensor,
                     output: torch.Tensor) -> None:
    """`output += _rows_update(...)`, a Linear's up-projection and sum in one batched GEMM
    (`baddbmm_`): no update tensor is written and read back."""
    if isinstance(module, nn.Conv2d) or output.dtype != x.dtype or not output.is_contiguous():
        output += _rows_update(module, x, downs, ups).to(output.dtype)
        return
    n = x.shape[0]
    hidden = torch.matmul(x.reshape(n, -1, x.shape[-1]), downs.transpose(1, 2))
    output.view(n, -1, output.shape[-1]).baddbmm_(hidden, ups.transpose(1, 2))


def _pair_update(module: nn.Module, x: torch.Tensor, down: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """x through one pair."""
    if isinstance(module, nn.Conv2d):
        hidden = F.conv2d(x, down, None, module.stride, module.padding, module.dilation)
        return F.conv2d(hidden, up[..., None, None])
    return F.linear(F.linear(x, down), up)


def _columns_update(module: nn.Module, x: torch.Tensor, downs: torch.Tensor, ups: torch.Tensor,
                   own: dict[int, torch.Tensor] | None) -> torch.Tensor:
    """x through every group's pair at once (C columns), each index keeping its own group's
    columns (`own` by the size of x's leading dimension, or of its second in a packed
    forward's [1, S, ...] views; None: all): one low-rank product beside the module's own,
    rather than a gather per group, so that a graph's shapes do not depend on who is whose."""
    conv = isinstance(module, nn.Conv2d)
    hidden = F.conv2d(x, downs, None, module.stride, module.padding, module.dilation) if conv else F.linear(x, downs)
    if own is not None:
        dim = 0 if x.shape[0] in own or conv else 1
        if x.shape[dim] not in own or (dim == 1 and (x.ndim < 3 or x.shape[0] != 1)):
            raise LoraError(f"a tensor of shape {tuple(x.shape)} has no known owner rows; "
                            "this forward cannot mix adapters")
        keep = own[x.shape[dim]]
        shape = [1] * hidden.ndim
        shape[dim], shape[1 if conv else -1] = keep.shape
        hidden = hidden * keep.view(shape)
    return F.conv2d(hidden, ups[..., None, None]) if conv else F.linear(hidden, ups)


def _pad_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(n - len(x), *x.shape[1:])]) if n > len(x) else x


def _groups(row_adapters: Sequence[Adapters],
            merged: Adapters) -> tuple[dict[tuple, Adapters], torch.Tensor, list[str]]:
    """The adapter groups of a forward's rows (each set with the merged one taken away; the merged
    set itself needs no group), each row's group (the merged set's rows: the zero group after the
    last), and the modules the groups adapt."""
    merged_key = adapters_key(merged)
    groups: dict[tuple, Adapters] = {}
    row_group = []
    for adapters in row_adapters:
        key = adapters_key(adapters)
        if key != merged_key:
            groups.setdefault(key, tuple(adapters) + tuple((lora, -scale) for lora, scale in merged))
        row_group.append(list(groups).index(key) if key != merged_key else -1)
    tags = torch.tensor([len(groups) if g < 0 else g for g in row_group])
    paths = sorted({path for adapters in groups.values() for lora, _ in adapters for path in lora.layers})
    return groups, tags, paths


@contextlib.contextmanager
def segmented(denoiser: nn.Module, row_adapters: Sequence[Adapters], merged: Adapters,
              row_maps: dict[int, torch.Tensor] | None, spent: list[float] | None = None,
              factors: Factors | None = None) -> Iterator[None]:
    """Within: each forward row r gets `row_adapters[r]`'s update (relative to `merged`) on
    every module they adapt. `row_maps[n]`: [n] forward row of each index of a leading
    dimension of size n; None where every row has the same update (a set beside quantized
    weights, which cannot take it merged). `spent[0]` accumulates the seconds the updates
    took; `factors` keeps the groups' stacked pairs between forwards of the same groups."""
    groups, tags, paths = _groups(row_adapters, merged)
    if not groups:
        yield
        return
    if row_maps is None and len(set(tags.tolist())) > 1:
        raise LoraError("this forward cannot tell its rows apart: its rows must share one adapter set")
    factors = factors or Factors()
    composition, group_list = (tuple(groups), adapters_key(merged)), list(groups.values())
    tags_of: dict[tuple, torch.Tensor] = {}  # (leading size, device) -> group of each index

    def owners(x: torch.Tensor) -> tuple[int, torch.Tensor]:
        """The dimension of x that holds rows (0; 1 in a packed forward's [1, S, D] views) and
        the group of each index along it."""
        if row_maps is None:  # one set on every index
            return 0, torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
        dim = 1 if x.shape[0] not in row_maps and x.ndim > 2 and x.shape[0] == 1 else 0
        n = x.shape[dim]
        if n not in row_maps:
            raise LoraError(f"a tensor of shape {tuple(x.shape)} has no known owner rows; "
                            "this forward cannot mix adapters")
        if (n, x.device) not in tags_of:
            tags_of[n, x.device] = tags[row_maps[n].cpu()].to(x.device)
        return dim, tags_of[n, x.device]

    members_of: dict[int, list[torch.Tensor]] = {}

    def members(owner: torch.Tensor) -> list[torch.Tensor]:
        """The indices of each group in `owner`, found once per forward."""
        if id(owner) not in members_of:
            members_of[id(owner)] = [(owner == g).nonzero().squeeze(1) for g in range(len(group_list))]
        return members_of[id(owner)]

    def hook(path: str, module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        start, x = time.perf_counter(), args[0]
        dim, owner = owners(x)
        downs, ups = factors.pair(composition, group_list, path, x)
        if dim == 0:
            _add_rows_update(module, x, downs.index_select(0, owner), ups.index_select(0, owner), output)
        else:  # packed tokens of many images: a gather per group rather than a pair per token
            for g, index in enumerate(members(owner)):
                if len(index):
                    update = _pair_update(module, x.index_select(dim, index), downs[g], ups[g])
                    output.index_add_(dim, index, update.to(output.dtype))
        if spent is not None:
            spent[0] += time.perf_counter() - start
        return output

    handles = [denoiser.get_submodule(path).register_forward_hook(
        lambda module, args, output, path=path: hook(path, module, args, output)) for path in paths]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class _Slot:
    """One module's update while a forward is bound (`RowSlots`): per row, or per index of its
    input's leading dimension."""

    def __init__(self):
        self.per_row = False
        self.downs: torch.Tensor | None = None  # per row [rows, R, in, ...]; per index [C, in, ...]
        self.ups: torch.Tensor | None = None  # per row [rows, out, R]; per index [out, C]
        # per index: each index's own columns of C, by the size of the leading dimension [n, C];
        # None where every index takes every column (one adapter set)
        self.own: dict[int, torch.Tensor] | None = None

    def hook(self, module: nn.Module, args, output: torch.Tensor) -> torch.Tensor | None:
        if self.downs is None:
            return None
        if self.per_row:
            return output + _rows_update(module, args[0], self.downs, self.ups).to(output.dtype)
        return output + _columns_update(module, args[0], self.downs, self.ups, self.own).to(output.dtype)


@dataclass(frozen=True)
class _Pending:
    """A step's adapters while its forwards run (`RowSlots.use`)."""

    tags: torch.Tensor  # [forward rows] each row's group (the merged set's rows: len(groups))
    composition: tuple
    groups: list[Adapters]
    paths: list[str]
    factors: Factors
    maps: dict[int, torch.Tensor] | None  # `segmented`'s row maps; None: one set on every index


class RowSlots:
    """Segmented adapters as a compiled graph holds them (see the module's docstring): `use`
    says which rows get which adapters in a step's forwards; a forward of whole rows `bind`s
    them per row (its rows padded), a packed forward's pieces by their layout (`tokens`), and
    any other forward takes them by index, as `segmented` would apply them."""

    def __init__(self, denoiser: nn.Module):
        self.slots: dict[str, _Slot] = {}
        self._modules: dict[str, nn.Module] = {}
        for path, module in denoiser.named_modules():
            if isinstance(module, nn.Linear | nn.Conv2d):
                self.slots[path] = slot = _Slot()
                self._modules[path] = module
                module.register_forward_hook(slot.hook)
        self._pending: _Pending | None = None
        self._bound: dict[tuple, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}  # the last rows' pairs
        self._columns: dict[tuple, tuple[dict, dict]] = {}  # the last step's pairs side by side

    def covers(self, row_adapters: Sequence[Adapters]) -> bool:
        """Whether every module these adapters adapt has a slot."""
        return all(path in self.slots for adapters in row_adapters for lora, _ in adapters for path in lora.layers)

    @contextlib.contextmanager
    def use(self, row_adapters: Sequence[Adapters], merged: Adapters, factors: Factors,
            maps: dict[int, torch.Tensor] | None) -> Iterator[None]:
        """Within: forward row r of the next forwards gets `row_adapters[r]`'s update (relative
        to `merged`); `maps`: the forward's row maps (`segmented`), None where every row has
        the same set. Every adapted module applies them by index of its input's leading
        dimension until a forward binds them otherwise (`bind`, `tokens`)."""
        groups, tags, paths = _groups(row_adapters, merged)
        if not groups:
            yield
            return
        if maps is None and len(set(tags.tolist())) > 1:
            raise LoraError("this forward cannot tell its rows apart: its rows must share one adapter set")
        self._pending = _Pending(tags, (tuple(groups), adapters_key(merged)), list(groups.values()), paths, factors,
                                 maps)
        try:
            with self._by_index(maps):
                yield
        finally:
            self._pending = None

    @property
    def active(self) -> bool:
        """Whether the step running segments adapters."""
        return self._pending is not None

    @property
    def uniform(self) -> bool:
        """Whether the step's forward has one adapter set on every row: any forward takes it, of
        whatever shape (a patched UNet's, a template replay's), its update one pair."""
        return self._pending is not None and self._pending.maps is None

    @contextlib.contextmanager
    def bind(self, rows: int, padded: int) -> Iterator[None]:
        """Within: each adapted module's slot holds the pairs of a forward of `rows` whole rows
        padded (its last row repeated) to `padded` (one set on every row: as it is)."""
        if self._pending is None or self._pending.maps is None:
            yield
            return
        pending = self._pending
        whole = whole_rows(pending.maps)
        if whole is None or len(whole) != rows:
            raise LoraError(f"a forward of {rows} whole rows cannot take adapters given for a forward of leading "
                            f"sizes {sorted(pending.maps)}")
        tags = pending.tags[whole]
        owner = torch.cat([tags, tags[-1:].expand(padded - rows)])
        key = (pending.composition, tuple(owner.tolist()))
        if key not in self._bound:
            self._bound = {key: {path: self._rows(pending.factors.pair(pending.composition, pending.groups, path,
                                                                        self._modules[path].weight), owner)
                                 for path in pending.paths}}
        with self._holding(True, self._bound[key]):
            yield

    @contextlib.contextmanager
    def tokens(self, owners: dict[int, torch.Tensor]) -> Iterator[None]:
        """Within: each adapted module applies the step's adapters by index of its input's leading
        dimension, `owners[n]` the forward row of each index where it has size n (a packed
        forward's pieces: their slots, image and text rows, padded)."""
        if self._pending is None or self._pending.maps is None:
            yield
            return
        with self._by_index(owners):
            yield

    @contextlib.contextmanager
    def _by_index(self, owners: dict[int, torch.Tensor] | None) -> Iterator[None]:
        """Every group's pairs side by side (`_side_by_side`), each index keeping its own
        group's columns (`_columns_update`); with no `owners`, the one group's pair."""
        pending = self._pending
        key = (pending.composition, owners is None)
        if key not in self._columns:
            self._columns = {key: self._side_by_side(pending, single=owners is None)}
        layouts, pairs = self._columns[key]
        own: dict[int, dict[int, torch.Tensor] | None] = dict.fromkeys(layouts)
        if owners is not None:
            for stride, column_group in layouts.items():
                tags = pending.tags.to(column_group.device)
                own[stride] = {n: (tags[owner.to(column_group.device)][:, None] == column_group[None, :])
                                 .to(next(iter(pairs.values()))[0].dtype) for n, owner in owners.items()}
        with self._holding(False, {path: (downs, ups, own[stride]) for path, (downs, ups, stride) in pairs.items()}):
            yield

    def _side_by_side(self, pending: _Pending, single: bool) -> tuple[dict[int, torch.Tensor], dict]:
        """({a rank stride: the group of each column [C] (-1: padding)}, {path: (downs [C, in,
        ...], ups [out, C], its stride)}): each path's groups' pairs (the first only, `single`)
        side by side, each group's rank padded with zeros to a power of two (the stride) and the
        columns to a power of two, so that few graphs serve many sets of ranks."""
        groups = 1 if single else len(pending.groups)
        pairs, layouts = {}, {}
        for path in pending.paths:
            downs, ups = pending.factors.pair(pending.composition, pending.groups, path, self._modules[path].weight)
            rank = downs.shape[1]
            stride = 1 << (rank - 1).bit_length()
            columns = 1 << (groups * stride - 1).bit_length()
            down = downs.new_zeros((groups, stride, *downs.shape[2:]))
            down[:, :rank] = downs[:groups]
            up = ups.new_zeros((groups, ups.shape[1], stride))
            up[..., :rank] = ups[:groups]
            pairs[path] = (_pad_rows(down.flatten(0, 1), columns),
                           _pad_rows(up.permute(1, 0, 2).flatten(1).T, columns).T.contiguous(), stride)
            if stride not in layouts:
                column_group = torch.arange(columns, device=downs.device) // stride
                layouts[stride] = column_group.where(column_group < groups, -1)
        return layouts, pairs

    @contextlib.contextmanager
    def _holding(self, per_row: bool, pairs: dict[str, tuple]) -> Iterator[None]:
        """Within: the slots of `pairs`' paths hold them ((downs, ups), and per index the
        columns each index keeps); after, what they held before."""
        before = {path: (self.slots[path].per_row, self.slots[path].downs, self.slots[path].ups,
                         self.slots[path].own) for path in pairs}
        for path, (downs, ups, *own) in pairs.items():
            slot = self.slots[path]
            slot.per_row, slot.downs, slot.ups, slot.own = per_row, downs, ups, own[0] if own else None
        try:
            yield
        finally:
            for path, held in before.items():
                slot = self.slots[path]
                slot.per_row, slot.downs, slot.ups, slot.own = held

    @staticmethod
    def _rows(pair: tuple[torch.Tensor, torch.Tensor], owner: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's pair, the rank padded with zeros to a power of two."""
        downs, ups = pair
        rank = downs.shape[1]
        extra = (1 << (rank - 1).bit_length()) - rank
        owner = owner.to(downs.device)
        downs, ups = downs.index_select(0, owner), ups.index_select(0, owner)
        if extra:
            downs = torch.cat([downs, downs.new_zeros((downs.shape[0], extra, *downs.shape[2:]))], 1)
            ups = torch.cat([ups, ups.new_zeros((*ups.shape[:2], extra))], 2)
        return downs.contiguous(), ups.contiguous()


def whole_rows(maps: dict[int, torch.Tensor] | None) -> list[int] | None:
    """Where a forward's row maps are those of one batch of whole rows (every layer's leading
    dimension is the rows, each once, in order: all of them, or a CFG-parallel rank's half),
    which rows; else None."""
    if maps is None or len(maps) != 1:
        return None
    rows = next(iter(maps.values()))
    return rows.tolist() if len(rows) < 2 or bool((rows[1:] > rows[:-1]).all()) else None
