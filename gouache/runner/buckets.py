"""The shapes a compiled model's graphs are built for (issue 59, docs/speed.md "Techniques in the
graph"): a step's forward is padded up to the smallest bucket of its kind that holds it, so
its graph's shapes depend on the bucket only, never on which requests share the step.

A kind is what a step's size is counted in: `rows` (a plain forward: requests times their CFG
rows), `tokens` (a packed DiT forward: every row's image, reference and text tokens), `patches`
(a patched UNet forward at `--patch-size`), `replay` (a DiT's template replay in pieces: its
computed tokens, and its whole forward's for the output piece) and `units` (the block cache's
computed images, patches or tokens). Each kind's buckets run
from the smallest step of that kind to the largest the server admits, in a geometric series
whose ratio the graph budget sets: with `n` buckets over [lo, hi] no step pads by more than a
factor (hi / lo) ** (1 / (n - 1)); where a kind's sizes are known (a packed forward's token counts
of the compiled sizes), its buckets are those sizes. A step past the largest bucket runs eagerly.

Plain values only: the start-up code and the tests choose buckets without a model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

TOKEN_ALIGN = 64  # token buckets are multiples of this (vLLM-Omni pads packed sequences to 64-row buckets)


@dataclass(frozen=True)
class Range:
    """The sizes one kind of step takes on this server: from `lo` to `hi`, in multiples of `align`;
    where they are known (`steps`, sorted, aligned: a packed forward's token counts that the
    compiled sizes make), those only, and buckets go on them."""

    kind: str
    lo: int
    hi: int
    align: int = 1
    steps: tuple[int, ...] = ()

    def __post_init__(self):
        if not 1 <= self.lo <= self.hi or self.align < 1:
            raise ValueError(f"a {self.kind} range needs 1 <= lo <= hi and align >= 1, got {self}")

    @classmethod
    def of_steps(cls, kind: str, steps, align: int = 1) -> Range:
        """The range of exactly `steps` (rounded up to `align`)."""
        known = tuple(sorted({_up(step, align) for step in steps}))
        if not known:
            raise ValueError(f"a {kind} range needs at least one step")
        return cls(kind, known[0], known[-1], align, known)


@dataclass(frozen=True)
class Buckets:
    """The buckets of every kind a server compiles, smallest first."""

    by_kind: dict[str, tuple[int, ...]]

    def __len__(self) -> int:
        return sum(len(b) for b in self.by_kind.values())

    def bucket(self, kind: str, size: int) -> int | None:
        """The smallest bucket of `kind` that holds a step of `size`; None past the largest (or a
        kind without buckets): the step runs eagerly."""
        return next((b for b in self.by_kind.get(kind, ()) if b >= size), None)

    def describe(self) -> str:
        """One line for the start log: each kind's buckets."""
        return "; ".join(f"{kind} {', '.join(map(str, b))}" for kind, b in self.by_kind.items())


def series(r: Range, count: int) -> tuple[int, ...]:
    """At most `count` buckets covering [r.lo, r.hi], multiples of `align`, the last holding hi.
    Built by splitting: starting from hi alone, the bucket that pads its smallest step the most
    is split at the geometric mean of that step and itself (where the range knows its steps:
    at the step that leaves the least padding on either side), until `count` buckets or every
    size its own. So the series for count + 1 holds the one for count, and no step pads more
    when the budget grows."""
    if count < 1:
        raise ValueError(f"a {r.kind} range needs at least one bucket, got {count}")
    buckets = [_up(r.hi, r.align)]
    while len(buckets) < count:
        splits = {k: point for k, bucket in enumerate(buckets)
                  if (point := _split(r, _first(r, buckets, k), bucket)) is not None}
        if not splits:
            break
        k = max(splits, key=lambda i: buckets[i] / _first(r, buckets, i))
        buckets.insert(k, splits[k])
    return tuple(buckets)


def _first(r: Range, buckets: list[int] | tuple[int, ...], k: int) -> int:
    """The smallest step bucket k takes (the one after the bucket below, or lo)."""
    below = buckets[k - 1] if k else 0
    if r.steps:
        return next(step for step in r.steps if step > below)
    return max(r.lo, below + 1)


def _split(r: Range, first: int, bucket: int) -> int | None:
    """Where a bucket whose smallest step is `first` splits (None: it cannot)."""
    if r.steps:
        inside = [step for step in r.steps if first <= step < bucket]
        if not inside:
            return None
        after = {step: next(s for s in r.steps if s > step) for step in inside}
        return min(inside, key=lambda step: (max(step / first, bucket / after[step]), step))
    if _up(first, r.align) >= bucket:
        return None
    split = _up(math.isqrt(first * bucket - 1) + 1, r.align)  # ceil(sqrt(first * bucket))
    return min(max(split, _up(first, r.align)), bucket - r.align)


def choose(ranges: list[Range], graphs: int) -> Buckets:
    """Buckets for each range within `graphs` graphs in all: every kind gets at least one, and
    the rest go where they cut padding most (the kind whose series ratio is largest gets the
    next bucket), so a wide range gets more buckets than a narrow one."""
    if len({r.kind for r in ranges}) != len(ranges):
        raise ValueError(f"one range per kind, got {[r.kind for r in ranges]}")
    if graphs < len(ranges):
        raise ValueError(f"{graphs} graphs cannot give each of {len(ranges)} kinds of step a bucket; "
                         f"raise --compile-graphs to at least {len(ranges)}")
    counts = {r.kind: 1 for r in ranges}
    for _ in range(graphs - len(ranges)):
        # kinds that one more bucket would split further (an aligned range runs out of sizes)
        open_ = [r for r in ranges if len(series(r, counts[r.kind] + 1)) > counts[r.kind]]
        if not open_:
            break
        widest = max(open_, key=lambda r: (padding(r, series(r, counts[r.kind])), r.kind))
        counts[widest.kind] += 1
    return Buckets({r.kind: series(r, counts[r.kind]) for r in ranges})


def padding(r: Range, buckets: tuple[int, ...]) -> float:
    """The most a step of the range pads by (bucket / step) with `buckets`."""
    return max(bucket / _first(r, buckets, k) for k, bucket in enumerate(buckets))


def _up(n: int, align: int) -> int:
    return -(-n // align) * align
