"""A runner's LoRAs at each step: which requests' adapters have arrived (KATZ's bounded
asynchronous loading), and how one forward applies them.

- **Bounded asynchronous loading.** A request's adapters start loading when it is prepared. Until
  they arrive it denoises without them, for at most `bound` steps: at step `bound` it waits
  (it is left out of the forward, the others go on) and takes them at the first step after they
  arrive. `bound` 0 is synchronous loading. A worker of a sequence-parallel block always waits
  for the load: its ranks must not decide apart.
- **Merged, segmented or split.** A forward whose requests share one adapter set runs with it
  merged into the weights, or segmented (each request's update on its own rows, relative to the
  merged set) when switching the merged set costs more than segmenting the steps the batch has
  left, on costs measured as the server runs (`choose`). A forward of several sets is
  segmented where the forward can tell its rows apart (`Family.row_maps`), and otherwise runs
  one forward per set ("split"), each applied as a shared set is. `LoraConfig.batching`
  "per-adapter" always splits: the baseline of servers that batch only requests of one adapter.
"""

from __future__ import annotations

import time
import weakref
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

import torch

from gouache.config import LoraConfig
from gouache.lora.apply import Adapters, Factors, Merged, RowSlots, adapters_key, segmented
from gouache.lora.files import Lora, LoraError
from gouache.lora.store import LoraStore
from gouache.outputs import LoraReport

Key = tuple[tuple[str, float, str], ...]  # an adapter set: (name, scale, file digest) each
_EMA = 0.3  # weight of a new measurement in a running cost


@dataclass(frozen=True)
class LoraUse:
    """A request's adapters (plain data: it travels with the denoising state to workers)."""

    adapters: tuple[tuple[str, float], ...]  # (name, scale) pairs
    bound: int  # the step by which they must have joined


@dataclass
class Costs:
    """Running costs: seconds to merge a byte of adapter weights (in or out), and seconds a
    segmented step spends per forward row and byte of the updates it applies."""

    merge_s_per_byte: float | None = None
    segment_s_per_row_byte: float | None = None

    def observe(self, name: str, seconds: float, work: float) -> None:
        if work <= 0:
            return
        value, old = seconds / work, getattr(self, name)
        setattr(self, name, value if old is None else (1 - _EMA) * old + _EMA * value)


def choose(keys: list[Key], rows: list[int], merged: Key, nbytes: dict[str, int], steps_left: int, costs: Costs,
           can_segment: bool) -> str:
    """merged | segmented | split, for a forward whose state i carries adapter set keys[i]
    (rows[i] forward rows) while `merged` is merged. Pure: no torch, no state."""
    distinct = set(keys)
    if len(distinct) > 1:
        return "segmented" if can_segment else "split"
    (key,) = distinct
    if key == merged or not can_segment:
        return "merged"
    if costs.merge_s_per_byte is None or costs.segment_s_per_row_byte is None:
        return "merged"  # until segmenting has been measured
    moved = sum(nbytes[name] for name, _, _ in (*key, *merged))
    switch = costs.merge_s_per_byte * moved
    segmenting = costs.segment_s_per_row_byte * sum(rows) * moved * steps_left
    return "merged" if switch <= segmenting else "segmented"


class LoraRuntime:
    """One denoiser's adapters: their loads per request, what is merged, what things cost."""

    def __init__(self, config: LoraConfig, pipe, denoiser: torch.nn.Module, merges: bool = True):
        """`merges`: whether adapters may merge into the denoiser's weights (not quantized ones:
        every set then runs segmented beside them)."""
        self.config = config
        self.merges = merges
        self.store = LoraStore(config.directory, pipe, config.host_bytes)
        self.merged = Merged.of(denoiser)
        self.denoiser = denoiser
        self.costs = Costs()
        self._loads: dict[str, list[Future]] = {}
        self._ready: dict[str, Adapters] = {}  # request id -> its adapters once they arrived, on the device
        # adapters on the device, shared by the requests that hold them (freed with the last)
        self._placed: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._device = next(denoiser.parameters()).device
        self._factors = Factors()  # the running batch's adapter groups, stacked per module

    def use(self, adapters: tuple[tuple[str, float], ...]) -> LoraUse | None:
        """A request's adapters (its `loras` field), loaded within the server's bound; None without any."""
        return LoraUse(tuple(adapters), self.config.bound) if adapters else None

    def key(self, use: LoraUse | None) -> Key:
        """What identifies a request's adapters now: (name, scale, file digest) each."""
        return tuple((name, scale, self.store.digest(name)) for name, scale in (use.adapters if use else ()))

    def text_adapters(self, use: LoraUse | None) -> list[tuple[Lora, float]]:
        """The request's adapters that have text-encoder layers, read now: its prompt is encoded
        while it is prepared (the others load while it waits and runs). A file that cannot be
        read now is left out here: its load fails the request at its first step, as the
        request's own input (`arrived`)."""
        out = []
        for name, scale in use.adapters if use else ():
            try:
                if self.store.check(name):
                    out.append((self.store.load(name).result(), scale))
            except LoraError:
                continue
        return out

    def start(self, request_id: str, use: LoraUse) -> None:
        """Begin reading a request's adapters (unknown names raise here)."""
        if request_id not in self._loads:
            self._loads[request_id] = [self.store.load(name) for name, _ in use.adapters]

    def take_report(self, report: LoraReport) -> LoraReport:
        """`report` (what the step's forwards did) with the loads since the last call and what the
        store holds."""
        report.loads, report.load_s = self.store.take_counts()
        report.held_bytes = self.store.nbytes
        return report

    def release(self, request_id: str) -> None:
        self._loads.pop(request_id, None)
        self._ready.pop(request_id, None)

    def arrived(self, states: list, hold: bool, failed: dict[str, str], step: LoraReport) -> dict[str, Adapters]:
        """Each state's adapters this step (empty: none, or not arrived before its bound). A
        state at its bound whose adapters are still loading is left out (`step.waiting`); with
        `hold`, every load is waited for. A load that failed fails its request."""
        out, pending = {}, []
        for state in states:
            rid, use = state.request.request_id, state.lora
            if use is None or rid in self._ready:
                out[rid] = self._ready.get(rid, ())
                continue
            try:
                self.start(rid, use)
            except LoraError as error:
                failed[rid] = str(error)
                continue
            loads = self._loads[rid]
            if hold:
                wait(loads)
            if all(f.done() for f in loads):
                self._take(state, out, failed)
            elif state.step < use.bound:
                step.without += 1
                out[rid] = ()
            else:
                pending.append(state)
        if pending and not out:  # everyone waits for a load: wait for one here rather than spin
            wait([f for s in pending for f in self._loads[s.request.request_id]], timeout=0.05,
                 return_when=FIRST_COMPLETED)
        for state in pending:
            if all(f.done() for f in self._loads[state.request.request_id]):
                self._take(state, out, failed)
            else:
                step.waiting += 1
        return out

    def _take(self, state, out: dict[str, Adapters], failed: dict[str, str]) -> None:
        rid, loads = state.request.request_id, self._loads[state.request.request_id]
        errors = [f.exception() for f in loads if f.exception() is not None]
        if errors:
            failed[rid] = str(errors[0])
        else:
            out[rid] = self._ready[rid] = tuple((self._place(f.result()), scale)
                                                for f, (_, scale) in zip(loads, state.lora.adapters))

    def _place(self, lora: Lora) -> Lora:
        """The adapter on the denoiser's device, copied there once while requests hold it rather
        than at every layer of every step."""
        if self._device.type == "cpu":
            return lora
        key = (lora.name, lora.digest)
        placed = self._placed.get(key)
        if placed is None:
            placed = self._placed[key] = lora.to(self._device)
        return placed

    def run(self, states: list, adapters: list[Adapters], predict, row_maps, step: LoraReport,
            slots: RowSlots | None = None) -> list[torch.Tensor]:
        """predict(states) with each state's adapters applied; row_maps(states): a forward's rows
        by leading size, or None where it cannot segment. Several sets share the forward unless
        it cannot segment, or the server batches per adapter set (`LoraConfig.batching`).
        `slots`: the compiled forward's, where a step that may compile segments (else hooks)."""
        keys = [adapters_key(a) for a in adapters]
        if not any(keys) and not self.merged.adapters:
            return predict(states)
        if len(set(keys)) > 1 and (self.config.batching == "per-adapter" or row_maps(states) is None):
            step.mode = "split"
            out: dict[int, torch.Tensor] = {}
            for key in dict.fromkeys(keys):
                group = [i for i, k in enumerate(keys) if k == key]
                parts = self._apply([states[i] for i in group], [adapters[i] for i in group], predict, row_maps, step,
                                    slots)
                out.update(zip(group, parts))
            return [out[i] for i in range(len(states))]
        return self._apply(states, adapters, predict, row_maps, step, slots)

    def _apply(self, states: list, adapters: list[Adapters], predict, row_maps, step: LoraReport,
               slots: RowSlots | None) -> list[torch.Tensor]:
        """One forward: its adapters merged, or segmented (`choose`)."""
        keys = [adapters_key(a) for a in adapters]
        maps = row_maps(states)
        nbytes = {lora.name: lora.nbytes for a in (*adapters, self.merged.adapters) for lora, _ in a}
        steps_left = min(len(s.timesteps) - s.step for s in states)
        if not self.merges:  # no update merges into a quantized weight: every set runs beside it
            mode = "segmented"
        else:
            mode = choose(keys, [s.rows for s in states], self.merged.key, nbytes, steps_left, self.costs,
                          maps is not None)
        step.mode = step.mode or mode
        if mode == "merged":
            self._merge(adapters[0], step)
            return predict(states)
        row_adapters = [a for a, s in zip(adapters, states) for _ in range(s.rows)]
        if slots is not None and slots.covers(row_adapters):  # in the graph: not timed apart
            with slots.use(row_adapters, self.merged.adapters, self._factors, maps):
                return predict(states)
        spent = [0.0]
        with segmented(self.denoiser, row_adapters, self.merged.adapters, maps, spent, self._factors):
            out = predict(states)
        merged = adapters_key(self.merged.adapters)
        work = sum(s.rows * sum(nbytes[name] for name, _, _ in (*key, *merged))
                   for s, key in zip(states, keys) if key != merged)
        self.costs.observe("segment_s_per_row_byte", spent[0], work)
        return out

    def _merge(self, adapters: Adapters, step: LoraReport) -> None:
        start = time.perf_counter()
        moved = sum(lora.nbytes for lora, _ in (*adapters, *self.merged.adapters))
        if self.merged.set(adapters):
            seconds = time.perf_counter() - start
            step.merge_s += seconds
            self.costs.observe("merge_s_per_byte", seconds, moved)

