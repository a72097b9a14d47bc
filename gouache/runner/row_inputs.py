"""A forward's row inputs (`Inputs`: the keyword arguments of one forward whose tensors have a
row per forward row) as compiled graphs take them: counted, padded, cut, marked dynamic, and
named by their shapes (`gouache.runner.compiled`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

# keyword arguments of the denoiser: tensors with one row per forward row, alone, in dicts or in
# tuples (ControlNet residuals), and lists of one item per row
Inputs = dict


def count_rows(rows: Inputs) -> int:
    for value in rows.values():
        if isinstance(value, torch.Tensor):
            return value.shape[0]
        if isinstance(value, dict | tuple) and value:
            return count_rows(value if isinstance(value, dict) else dict(enumerate(value)))
    raise ValueError("a forward's row inputs hold no tensor")


def per_row(value, tensor: Callable, listed: Callable):
    """`value` (a row input) with `tensor` applied to each of its tensors, alone, in dicts or in
    tuples (ControlNet residuals: one tensor a block, each with a row per forward row), and
    `listed` to each list (one item per row: Qwen-Image's img_shapes); other values as they are."""
    if isinstance(value, torch.Tensor):
        return tensor(value)
    if isinstance(value, dict):
        return {name: per_row(v, tensor, listed) for name, v in value.items()}
    if isinstance(value, tuple):
        return tuple(per_row(v, tensor, listed) for v in value)
    if isinstance(value, list):
        return listed(value)
    return value


def pad_rows(rows: Inputs, extra: int) -> Inputs:
    """`rows` with `extra` copies of their last row appended (rows are independent)."""
    if extra == 0:
        return rows
    return per_row(rows, lambda t: torch.cat([t, t[-1:].expand(extra, *t.shape[1:])]),
                    lambda items: items + items[-1:] * extra)


def resize_rows(rows: Inputs, n: int) -> Inputs:
    """`rows` padded or cut to `n` rows."""
    have = count_rows(rows)
    if n >= have:
        return pad_rows(rows, n - have)
    return per_row(rows, lambda t: t[:n], lambda items: items[:n])


def cut_rows(out, n: int):
    """A forward's output (a tensor, or tuples or a list of them) cut to its first `n` rows."""
    return per_row(out, lambda t: t[:n], lambda items: [t[:n] for t in items])


def has_list(rows: Inputs) -> bool:
    found = []
    per_row(rows, lambda t: t, found.append)
    return bool(found)


def mark_rows(rows: Inputs) -> Inputs:
    """`rows` (views of them) with their row dimension dynamic in the graph compiled for them."""
    from torch._dynamo import mark_dynamic

    def marked(tensor: torch.Tensor) -> torch.Tensor:
        view = tensor.view_as(tensor)
        mark_dynamic(view, 0)
        return view

    return per_row(rows, marked, lambda items: items)


def graph_key(rows: Inputs, shared: Inputs, bucket: int | None = None) -> tuple:
    """What a graph is compiled for: the shapes, dtypes and devices of its inputs, the rows'
    leading dimension counted as their `bucket` (a graph of dynamic rows serves every row count
    of it)."""
    return _shapes(rows, bucket) + _shapes(shared, None)


def _shapes(inputs: Inputs, rows: int | None) -> tuple:
    def shape(tensor: torch.Tensor) -> tuple:
        return (tuple(tensor.shape) if rows is None else (rows, *tensor.shape[1:])), tensor.dtype, tensor.device

    return tuple((name, _frozen(per_row(value, shape, _frozen))) for name, value in sorted(inputs.items()))


def _frozen(value):
    """A plain input as a key: lists (Qwen-Image's `img_shapes`, Z-Image's images) as tuples all
    the way down, dicts as their sorted items, tensors in them as what a graph is compiled for."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), value.dtype, value.device
    if isinstance(value, dict):
        return tuple((name, _frozen(v)) for name, v in sorted(value.items()))
    return tuple(map(_frozen, value)) if isinstance(value, list | tuple) else value


def describe(inputs: Inputs, bucket: int | None) -> str:
    """A graph's name in logs: its first input's shape, and the inputs that are tuples of row
    tensors (ControlNet residuals)."""
    first = next(v for v in inputs.values() if isinstance(v, torch.Tensor))
    shape = "x".join(map(str, (first.shape[0] if bucket is None else bucket, *first.shape[1:])))
    tuples = [name for name, value in inputs.items() if isinstance(value, tuple)]
    return f"{shape} with {', '.join(tuples)}" if tuples else shape
