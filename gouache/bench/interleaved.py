"""Steps of the same requests on several in-process runners (variants of one model: eager,
compiled, quantized), interleaved repetition by repetition, and of the rows a ratio compares
(`together`), so a noisy neighbour slows all of them alike: what `gouache bench speed` and
`gouache bench fullsize` time."""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable

from gouache.uploads import Upload

STEPS = 30  # a request's schedule, unless the bench asks for another


def request(rid: str, size: int, seed: int, steps: int = STEPS, prompt: str | None = None, **fields):
    """A square text-to-image (or, with `fields`, edit or adapter) request of `size` pixels; its
    prompt one of five by its seed unless given."""
    from gouache.request import ImageRequest

    return ImageRequest(rid, prompt or f"a red circle {seed % 5}", size, size, steps, 4.0, seed=seed, **fields)


class Interleaved:
    """`runners` by variant; `steps[label][variant]` the median ms and compile paths of each row.
    A step's time is the wall time of `runner.execute` and of `sync` after it (a GPU's queue
    drained: `torch.cuda.synchronize`), so work queued by one step is not charged to the next."""

    def __init__(self, runners: dict, repeats: int, steps: int = STEPS, sync: Callable[[], None] = lambda: None):
        self.runners, self.repeats, self.schedule, self.sync = runners, repeats, steps, sync
        self.steps: dict[str, dict] = {}
        self._ids = itertools.count()

    @property
    def variants(self) -> list[str]:
        return list(self.runners)

    def prepare(self, specs: list[tuple[int, dict]], upload: Upload | None = None, controls: list = ()
                ) -> tuple[str, ...]:
        """Requests of (size, fields) prepared in every runner under the same ids; `upload`: an
        edit's; `controls`: the conditioning image of each of a request's ControlNets."""
        ids = tuple(f"r{next(self._ids)}" for _ in specs)
        for runner in self.runners.values():
            for rid, (size, fields) in zip(ids, specs):
                runner.prepare(request(rid, size, int(rid[1:]), self.schedule, **fields), upload, controls)
        return ids

    def release(self, *groups: tuple[str, ...]) -> None:
        for runner in self.runners.values():
            for ids in groups:
                for rid in ids:
                    runner.release(rid)

    def timed(self, label: str, batches: list[tuple[str, ...]], patched: bool = False, settle: int = 1,
              observe: Callable[[str, object], None] | None = None) -> dict:
        """Median ms of one step of `batches` (one or several batches of ids, summed) per
        variant, after `settle` untimed steps, and each variant's compile paths in those steps;
        `observe(variant, output)` sees every timed batch's output."""
        return self.together({label: (batches, patched)}, settle, observe)[label]

    def together(self, rows: dict[str, tuple[list[tuple[str, ...]], bool]], settle: int = 1,
                 observe: Callable[[str, object], None] | None = None) -> dict:
        """`timed` for several rows (label: (batches, patched)) at once, one repetition of each
        after the other, so that drift between them does not enter their ratio."""
        from gouache.sched.plan import Batch

        times = {label: {v: [] for v in self.runners} for label in rows}
        paths = {label: {v: {} for v in self.runners} for label in rows}
        for rep in range(settle + self.repeats):
            for label, (batches, patched) in rows.items():
                for variant, runner in self.runners.items():
                    total = 0.0
                    for ids in batches:
                        start = time.perf_counter()
                        out = runner.execute(Batch(tuple(ids), patched=patched))
                        self.sync()
                        total += time.perf_counter() - start
                        if out.failed:
                            raise RuntimeError(f"{label} ({variant}): {out.failed}")
                        if rep >= settle:
                            seen = paths[label][variant]
                            for why, n in out.compile.eager.items():
                                seen[f"eager: {why}"] = seen.get(f"eager: {why}", 0) + n
                            if out.compile.compiled:
                                seen["compiled"] = seen.get("compiled", 0) + out.compile.compiled
                            if observe is not None:
                                observe(variant, out)
                    if rep >= settle:
                        times[label][variant].append(total)
        for label in rows:
            self.steps[label] = {v: {"ms": 1e3 * statistics.median(times[label][v]), "paths": paths[label][v]}
                                 for v in self.runners}
        return {label: self.steps[label] for label in rows}

    def ratio(self, variant: str, over: str, under: str) -> float:
        return self.steps[over][variant]["ms"] / self.steps[under][variant]["ms"]
