"""ControlNets in a model runner: what a request asked (`ControlUse`, on its denoising state),
and the residuals of a forward's rows.

A forward of one latent shape takes every row's residuals at once: rows without ControlNets
get zeros (which add nothing, exactly), and each ControlNet runs once over the rows of all the
requests that use it, whatever their conditioning images and scales (a residual is scaled per
row afterwards, as diffusers scales it last). Several ControlNets of a request are summed in
the order the request names them, as diffusers' MultiControlNetModel does.

Where they run is the runner's `ControlNetConfig`:

- in this process, before the forward: the sequential way of diffusers' pipelines;
- on the ControlNet service (`gouache.controlnet.service`), sent when the forward starts. In `sync` mode
  the UNet gets zero-filled residual tensors and runs its encoder meanwhile; a hook after its
  last down block waits for the service and fills them in place before the UNet adds them, as
  KATZ overlaps the ControlNets with the UNet's encoder (exact). A compiled UNet (`--compile`)
  runs whole in its graph, which holds no hook: it waits for the residuals first (`overlap`).
  In `async` mode a request's step t uses the residuals the service computed from step t - 1
  (its first step waits), read at the start of the next step: the ControlNet runs beside the
  whole step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from gouache.adapter_names import ControlNetError
from gouache.config import ControlNetConfig
from gouache.controlnet.cache import ControlNetCache
from gouache.controlnet.model import (
    Base,
    Embeddings,
    residual_shapes,
    residuals,
    skipping_embedding,
    supports_controlnets,
)
from gouache.outputs import ControlNetReport

log = logging.getLogger(__name__)


@dataclass
class ControlUse:
    """A request's ControlNets: (name, conditioning [1, 3, H, W] in [0, 1], scale) each, and
    whether their residuals of step t join step t ("sync") or step t + 1 ("async")."""

    nets: tuple[tuple[str, torch.Tensor, float], ...]
    mode: str = "sync"
    previous: list[torch.Tensor] | None = None  # async: its rows' residuals from its last step
    failure: str | None = None  # async: why its last step's residuals never came


@dataclass
class ControlJob:
    """One ControlNet over some rows of a forward."""

    name: str
    rows: torch.Tensor  # [n] indices into the forward's rows
    conds: list[str]  # [n] each row's conditioning id ("<request id>/<k>": its k-th ControlNet's image)
    scale: torch.Tensor  # [n] each row's scale


@dataclass
class _Run:
    """ControlNet runs of one forward on the service, their residuals not yet read."""

    jobs: list[tuple[list[ControlJob], object]]  # each worker's, with the Pending of their residuals
    shapes: list[tuple[int, ...]]  # of the forward's residuals
    states: list  # the forward's states
    keep: dict[int, int]  # index of an async state in `states` -> its first row: residuals kept for its next step


class ControlRuntime:
    """The ControlNets of one runner's model."""

    def __init__(self, config: ControlNetConfig, pipe):
        self.config = config
        self.pipe = pipe
        self.unsupported = supports_controlnets(pipe)
        self.base = Base.of(pipe)
        self.cache = ControlNetCache(config.directory, self.base, config.model_bytes)
        self.client = None
        if config.service is not None and not self.unsupported:
            from gouache.controlnet.service import ControlClient

            self.client = ControlClient(config.service, config.reply_timeout_s)
        self.embeddings = Embeddings()  # in-process runs: each request's conditioning, embedded once
        self._runs: dict[str, int] = {}  # ControlNet runs by mode since the last report
        self._wait_s = 0.0  # seconds forwards waited for residuals since the last report
        self._inflight: _Run | None = None  # async runs of the last forward
        self._armed = None  # the sync wait hook of the forward running now
        # whether sync residuals from the service are waited for inside the UNet (after its
        # encoder, which runs meanwhile) or before it: a compiled UNet (`--compile`) takes them
        # as inputs and holds no hook, so it waits first
        self.overlap = True
        self._compiled_run = None  # how an in-process ControlNet runs under --compile (`compile`)
        self._released: list[str] = []  # requests gone since the last forward (`release`)
        self._lock = threading.Lock()
        # the parallel split of the forward running now (`predict`): its ranks agree on whether
        # every one got its residuals (all raise, or none, or their collectives would part ways),
        # and where it cuts the rows before the UNet runs, sync residuals come first
        self._split = None

    def compile(self, run: Callable) -> None:
        """Under --compile: sync residuals from the service are waited for before the UNet runs
        (its graph holds no hook), and in-process ControlNets run by `run(model, inputs)` (the
        compiled denoiser's: `CompiledDenoiser.controlnet`)."""
        self.overlap = False
        self._compiled_run = run

    def _run(self, model, inputs: dict) -> list[torch.Tensor]:
        return (self._compiled_run or skipping_embedding)(model, inputs)

    def first(self):
        """The first ControlNet of the directory that loads (the warm-up compiles its graphs,
        which every ControlNet of its architecture shares), or None; in process only."""
        for name in self.cache.names() if self.served and self.client is None else []:
            try:
                return self.cache.get(name)
            except ControlNetError as error:  # a request naming it gets the same error
                log.warning("ControlNet %r is not compiled at start: %s", name, error)
        return None

    @property
    def served(self) -> bool:
        """Whether this model takes ControlNets from a directory."""
        return self.base is not None and self.config.directory is not None

    def zeros(self, sample: torch.Tensor) -> dict:
        """The UNet's residual arguments for rows of `sample`, all zero (they add nothing): a
        forward with ControlNets as the compile warm-up runs it."""
        total = [sample.new_zeros(shape) for shape in residual_shapes(self.base.unet_config, *sample.shape[:1],
                                                                       *sample.shape[2:])]
        return {"down_block_additional_residuals": tuple(total[:-1]), "mid_block_additional_residual": total[-1]}

    # -- requests ------------------------------------------------------------------------------

    def check(self, name: str) -> None:
        """Raise ControlNetError unless this model can run ControlNet `name`."""
        if self.unsupported:
            raise ControlNetError(self.unsupported)
        self.cache.check(name)

    def check_request(self, names: list[str], mode: str | None) -> None:
        """Raise ControlNetError unless a request may run these ControlNets in this mode."""
        for name in names:
            self.check(name)
        if (mode or self.config.mode) == "async" and not self.config.workers:
            raise ControlNetError("async ControlNet residuals need the ControlNet service (--controlnet-workers)")

    def use(self, nets: tuple[tuple[str, float], ...], images: list[np.ndarray], mode: str | None,
            device: torch.device, dtype: torch.dtype) -> ControlUse | None:
        """A request's ControlNets with their decoded conditioning images (uint8 [H, W, 3])."""
        if not nets:
            return None
        self.check_request([name for name, _ in nets], mode)
        conds = [torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1)[None].to(device, torch.float32) / 255.0
                 for image in images]
        return ControlUse(tuple((name, cond.to(dtype), scale) for (name, scale), cond in zip(nets, conds)),
                          mode or self.config.mode)

    def release(self, request_id: str) -> None:
        """The request left this runner: its conditioning images may go (here and on the service).
        Called from the stages' threads: applied by the engine thread before its next forward."""
        with self._lock:
            self._released.append(request_id)

    def _forget_released(self) -> None:
        with self._lock:
            released, self._released = self._released, []
        for request_id in released:
            self.embeddings.forget_request(request_id)
            if self.client is not None:
                self.client.forget(request_id)

    # -- the directory -------------------------------------------------------------------------

    def describe_all(self) -> list[dict]:
        return [self.cache.describe(name) for name in self.cache.names()]

    def load(self, name: str) -> dict:
        """Load ControlNet `name` where it runs (POST /v1/controlnets); what is held of it."""
        self.check(name)
        return self.client.load(name) if self.client is not None else self.cache.load(name)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()

    def take_report(self) -> ControlNetReport:
        """What ran since the last call."""
        loads, load_s = self.cache.counts.take()
        if self.client is not None:
            loads, load_s = self.client.counts, self.client.load_s
            self.client.counts, self.client.load_s = {}, []
        runs, wait_s, self._runs, self._wait_s = self._runs, self._wait_s, {}, 0.0
        return ControlNetReport(runs, wait_s, loads, load_s)

    # -- forwards --------------------------------------------------------------------------------

    @torch.no_grad()
    def predict(self, states: list, forward: Callable, rest: Callable, split=None) -> list[torch.Tensor]:
        """Per state, its rows' predictions: each latent shape that has ControlNet requests in one
        forward with their residuals (`forward(group, control)`), the other states by `rest(group)`.
        `split`: the step's parallel split (`gouache.forward_layers.Split`), or None on one device."""
        shapes = {tuple(s.latents.shape) for s in states if s.control is not None}
        out: dict[int, torch.Tensor] = {}
        for shape in shapes:
            members = [i for i, s in enumerate(states) if tuple(s.latents.shape) == shape]
            group = [states[i] for i in members]
            control = self.residuals if split is None else self._agreed_residuals
            self._split = split
            try:
                out.update(zip(members, forward(group, control).split([s.rows for s in group])))
            finally:
                self._split = None
                self._disarm()
        others = [i for i in range(len(states)) if i not in out]
        if others:
            out.update(zip(others, rest([states[i] for i in others])))
        return [out[i] for i in range(len(states))]

    def collect(self) -> None:
        """Read the last forward's async residuals (computed meanwhile) into their requests, and
        forget the requests released since (engine thread, before a step)."""
        self._forget_released()
        run, self._inflight = self._inflight, None
        if run is None:
            return
        start = time.perf_counter()
        fresh, lost = self._gather(run)
        self._wait_s += time.perf_counter() - start
        self._keep(run, fresh, lost)

    def _agreed_residuals(self, *args) -> dict:
        """`residuals`, raising on every rank if it failed on any."""
        failure = out = None
        try:
            out = self.residuals(*args)
        except ControlNetError as error:
            failure = error
        if not self._split.agree(failure is None):
            raise failure or ControlNetError("a ControlNet run failed on the other device of this step")
        return out

    def residuals(self, states: list, sample: torch.Tensor, timesteps: torch.Tensor, kwargs: dict) -> dict:
        """The UNet's residual arguments for a forward of `states` (rows in order)."""
        if self.client is None:
            return self._local(states, sample, timesteps, kwargs)
        self.collect()
        failed = next((s.control.failure for s in states if s.control is not None and s.control.failure), None)
        if failed:
            raise ControlNetError(failed)
        shapes = residual_shapes(self.base.unet_config, len(sample), *sample.shape[2:])
        total = [torch.zeros(shape, device=sample.device, dtype=sample.dtype) for shape in shapes]
        starts = np.cumsum([0] + [s.rows for s in states])
        waits, keep = False, {}  # whether this forward waits for the service; async states to keep for
        for i, state in enumerate(states):
            use = state.control
            if use is None:
                continue
            if use.mode == "sync" or use.previous is None:
                waits = True
            else:
                for acc, part in zip(total, use.previous):
                    acc[starts[i]:starts[i + 1]] = part
            if use.mode == "async" and state.step + 1 < len(state.timesteps):
                keep[i] = int(starts[i])
        run = _Run(self._send(states, sample, timesteps, kwargs, keep, "sync" if waits else "async"),
                   shapes, states, keep)
        if waits and self.overlap and (self._split is None or not self._split.residuals_first):
            down = self.pipe.unet.down_blocks[-1]
            handle = down.register_forward_hook(lambda *_: self._fill(run, total))
            self._armed = (handle, run)
        elif waits:
            self._fill(run, total)
        else:
            self._inflight = run
        return {"down_block_additional_residuals": tuple(total[:-1]), "mid_block_additional_residual": total[-1]}

    def _send(self, states: list, sample, timesteps, kwargs: dict, keep: dict[int, int], mode: str) -> list:
        """Every ControlNet of the forward on the service, over the rows that need this step's
        residuals: sync requests', async ones' without residuals yet, and async ones' for their
        next step. `mode`: whether the forward waits for them (sync) or not (async)."""
        wanted = [s if s.control is not None and (s.control.mode == "sync" or s.control.previous is None or i in keep)
                  else None for i, s in enumerate(states)]
        conds = {f"{s.request.request_id}/{k}": cond for s in states if s.control is not None
                 for k, (_, cond, _) in enumerate(s.control.nets)}
        added = kwargs.get("added_cond_kwargs")
        by_worker: dict[int, list[ControlJob]] = {}
        for job in jobs(states, wanted):
            by_worker.setdefault(self.client.address.worker_of(job.name), []).append(job)
        sent = []
        try:
            for worker, own in by_worker.items():  # one message each: the rows any of its runs needs, once
                union = sorted({int(r) for job in own for r in job.rows})
                local = {row: i for i, row in enumerate(union)}
                rows = torch.tensor(union, device=sample.device)
                specs = [(job.name, [local[int(r)] for r in job.rows], job.conds) for job in own]
                pending = self.client.send(worker, specs, sample[rows], timesteps[rows],
                                           kwargs["encoder_hidden_states"][rows],
                                           {k: v[rows] for k, v in added.items()} if added else None, conds)
                sent.append((own, pending))
                self._runs[mode] = self._runs.get(mode, 0) + len(own)
        except ControlNetError:
            self._drain(sent)  # the runs already sent are read, so the next forward finds the connections clear
            raise
        return sent

    def _fill(self, run: _Run, total: list[torch.Tensor]) -> None:
        """The hook after the UNet's last down block: wait for the service and fill the residuals
        of the rows that take this step's (before the UNet adds them, right after this hook)."""
        if self._armed is not None:
            self._armed[0].remove()
            self._armed = None
        start = time.perf_counter()
        fresh, lost = self._gather(run)
        self._wait_s += time.perf_counter() - start
        if lost:  # the forward fails; its requests are retried one by one, each needing its own workers
            raise next(iter(lost.values()))
        starts = np.cumsum([0] + [s.rows for s in run.states])
        for i, state in enumerate(run.states):
            use = state.control
            if use is not None and (use.mode == "sync" or use.previous is None):
                for acc, part in zip(total, fresh):
                    acc[starts[i]:starts[i + 1]] = part[starts[i]:starts[i + 1]]
        self._keep(run, fresh, lost)

    def _gather(self, run: _Run) -> tuple[list[torch.Tensor], dict[str, ControlNetError]]:
        """Every run's residuals, scaled per row and summed, and why each ControlNet whose worker
        failed gave none (every reply is read, whatever failed). A row's residuals are whole when
        none of its ControlNets failed: a worker's failure is only its own ControlNets' requests'."""
        fresh = [torch.zeros(shape, dtype=self.base.dtype, device=self.base.device) for shape in run.shapes]
        lost: dict[str, ControlNetError] = {}
        for own, pending in run.jobs:
            try:
                each, _ = pending.result()
            except ControlNetError as failure:
                lost.update((job.name, failure) for job in own)
                continue
            for job, parts in zip(own, each):
                rows = job.rows.to(fresh[0].device)
                scale = job.scale.to(fresh[0].device, fresh[0].dtype).view(-1, 1, 1, 1)
                for acc, part in zip(fresh, parts):
                    acc.index_add_(0, rows, part.to(acc.device) * scale)
        return fresh, lost

    def _keep(self, run: _Run, fresh: list[torch.Tensor], lost: dict[str, ControlNetError]) -> None:
        """Each async request's residuals for its next step, or why it has none."""
        for i, first in run.keep.items():
            use = run.states[i].control
            failure = next((lost[name] for name, _, _ in use.nets if name in lost), None)
            if failure is not None:
                use.failure = str(failure)
            else:
                use.previous = [part[first:first + run.states[i].rows].clone() for part in fresh]

    def _disarm(self) -> None:
        """After a forward: a wait hook that never fired (the forward raised) is removed, and its
        replies read, so the next run finds the connections clear."""
        if self._armed is not None:
            handle, run = self._armed
            handle.remove()
            self._armed = None
            self._drain(run.jobs)

    def _drain(self, jobs: list) -> None:
        for _, pending in jobs:
            try:
                pending.result()
            except ControlNetError:
                pass

    def _local(self, states: list, sample: torch.Tensor, timesteps: torch.Tensor, kwargs: dict) -> dict:
        start, total = time.perf_counter(), None
        added = kwargs.get("added_cond_kwargs")
        conds = {f"{s.request.request_id}/{k}": cond for s in states if s.control is not None
                 for k, (_, cond, _) in enumerate(s.control.nets)}
        for job in jobs(states, states):
            rows = job.rows.to(sample.device)
            model = self.cache.get(job.name)
            parts = residuals(model, sample[rows], timesteps[rows], kwargs["encoder_hidden_states"][rows],
                              self.embeddings.rows(job.name, model, job.conds, conds),
                              {k: v[rows] for k, v in added.items()} if added else None, self._run)
            if total is None:
                total = [torch.zeros(len(sample), *p.shape[1:], device=p.device, dtype=p.dtype) for p in parts]
            scale = job.scale.to(sample.device, sample.dtype).view(-1, 1, 1, 1)
            for acc, part in zip(total, parts):
                acc.index_add_(0, rows, part * scale)
            self._runs["local"] = self._runs.get("local", 0) + 1
        self._wait_s += time.perf_counter() - start
        return {"down_block_additional_residuals": tuple(total[:-1]), "mid_block_additional_residual": total[-1]}


def jobs(states: list, wanted: list) -> list[ControlJob]:
    """The forward's ControlNet runs: one per ControlNet, over the rows of every state that
    names it (and is in `wanted`, by position), in the order they are first named (a request's
    residuals sum in its own order unless another request named them the other way round:
    equal for two, rounding for more)."""
    order: dict[str, list[tuple[int, str, float]]] = {}
    start = 0
    for state, want in zip(states, wanted):
        if want is not None and state.control is not None:
            for k, (name, _, scale) in enumerate(state.control.nets):
                for row in range(start, start + state.rows):
                    order.setdefault(name, []).append((row, f"{state.request.request_id}/{k}", scale))
        start += state.rows
    return [ControlJob(name, torch.tensor([r for r, _, _ in rows]), [c for _, c, _ in rows],
                       torch.tensor([s for _, _, s in rows])) for name, rows in order.items()]
