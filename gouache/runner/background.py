"""Forwards first met while serving, compiled off the serving path (`--compile`, on by default
with it; `--no-compile-background` compiles them in their step instead).

After the warm-up, a forward whose shape has no graph yet runs eagerly, counted with reason
`compiling`, while a child process builds the same compiled denoiser (`Recipe`: the server's
model, dtype, device, quantization and adapter hooks) and compiles that shape into the server's
compile cache, at the lowest CPU priority: the server's steps come first. Once the child has
ended, the server compiles the shape in its next step from the cache: dynamo traces the module
again and inductor loads the child's kernels (3-5 s a graph of shapes-unet on 2 cores, against
40-50 s cold). The child hands the server no graph: kernels are keyed by their content, so a
child that built anything else makes a cache miss, never a wrong graph.

One child runs at a time, on every shape queued when it starts; shapes met meanwhile wait for
the next. It holds a second copy of the model while it runs and exits when its shapes are
compiled (or when the server is gone: `gouache.children`); its output is in a log file that a
failed child's warning quotes.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from gouache.children import become_child

log = logging.getLogger(__name__)

NICE = 19  # the child's CPU priority where SCHED_IDLE is not there


@dataclass(frozen=True)
class Recipe:
    """How a child process builds the server's compiled denoiser: `function` ("module:name", a
    `CompiledDenoiser` from `argument`)."""

    function: str
    argument: object

    def build(self):
        module, name = self.function.split(":")
        return getattr(importlib.import_module(module), name)(self.argument)


# (rows, shared) inputs of one padded forward, and its layout where it has one, as `CompiledDenoiser.graph` takes them
Forward = tuple


class BackgroundCompiler:
    """Compiles the forwards a server first meets while serving in a child process that fills
    the compile cache `cache`."""

    def __init__(self, recipe: Recipe, cache: Path):
        self.recipe = recipe
        self.cache = cache
        self._queued: dict[tuple, Forward] = {}  # keys waiting for the next child
        self._running: set[tuple] = set()  # keys the running child compiles
        self._done: set[tuple] = set()  # keys a child ended: their kernels are in the cache (or it failed)
        self._child: subprocess.Popen | None = None
        self._files: Path | None = None  # the children's job and log, made with the first child

    def ready(self, key: tuple, forward: Forward) -> bool:
        """Whether a child has compiled `key`'s forward (the server then compiles it from the
        cache); a key asked for the first time is queued."""
        self._poll()
        if key in self._done:
            return True
        if key not in self._queued and key not in self._running:
            self._queued[key] = forward
            self._poll()
        return False

    def submit(self, forwards: dict[tuple, Forward]) -> None:
        """Queue `forwards` (by key) at once, so that one child takes them all."""
        for key, forward in forwards.items():
            if key not in self._done and key not in self._running:
                self._queued.setdefault(key, forward)
        self._poll()

    @property
    def pending(self) -> int:
        """Forwards queued or compiling."""
        self._poll()
        return len(self._queued) + len(self._running)

    def _poll(self) -> None:
        """End a child that has exited and start one on what is queued."""
        if self._child is not None:
            if self._child.poll() is None:
                return
            if self._child.returncode != 0:
                tail = (self._files / "log").read_text(errors="replace").strip().splitlines()[-1:]
                log.warning("the background compile of %d forwards ended with exit code %s (%s): they compile in "
                            "their next step", len(self._running), self._child.returncode, " ".join(tail))
            else:
                log.info("compiled %d forwards in the background: each loads in its next step", len(self._running))
            self._done.update(self._running)
            self._running, self._child = set(), None
        if self._queued:
            self._files = self._files or Path(tempfile.mkdtemp(prefix="gouache-compile-"))
            job = self._files / "job.pickle"
            try:
                job.write_bytes(pickle.dumps({"recipe": self.recipe,
                                              "forwards": [_move(f, "cpu") for f in self._queued.values()],
                                              "devices": [str(_device(f)) for f in self._queued.values()]}))
                with open(self._files / "log", "w") as out:
                    self._child = subprocess.Popen([*_niced(), sys.executable, "-m", __name__, str(job)],
                                                   stdout=out, stderr=out, stdin=subprocess.DEVNULL,
                                                   env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(self.cache)})
            except OSError as e:  # a full disk, no processes left: the shapes compile in their step
                log.warning("could not start a background compile (%s): %d forwards compile in their next step",
                            e, len(self._queued))
                self._done.update(self._queued)
            else:
                self._running = set(self._queued)
            self._queued = {}

    def close(self) -> None:
        """Stop a running child (what it compiled so far stays in the cache) and remove its files."""
        if self._child is not None and self._child.poll() is None:
            self._child.kill()
            self._child.wait()
        self._child = None
        if self._files is not None:
            shutil.rmtree(self._files, ignore_errors=True)


def main(job: str) -> None:
    """A child's work: the server's compiled denoiser built again from the job's recipe, and each
    of its forwards compiled into the cache (TORCHINDUCTOR_CACHE_DIR). A fresh interpreter, not a
    fork of the server's fork server: inductor's cache keys pickle `torch.contiguous_format` under
    the first module that reaches it, which in a forked child is the server's main script
    (`__mp_main__`), so a forked child's kernels never matched the server's."""
    become_child("gouache-compile")
    _yield_cpu()
    work = pickle.loads(Path(job).read_bytes())  # written by the server that started this child
    compiled = work["recipe"].build()
    graphs = [compiled.graph(*_move(f, d)) for f, d in zip(work["forwards"], work["devices"], strict=True)]
    compiled.warm_up(graphs, progress=print)


def _niced() -> list[str]:
    """The command prefix that starts the child at the lowest nice level already: its interpreter
    and imports (seconds of CPU, before `_yield_cpu` runs) would otherwise take the server's
    cores at its own priority."""
    nice = shutil.which("nice")
    return [nice, "-n", str(NICE)] if nice else []


def _yield_cpu() -> None:
    """Run (and let the compiler processes this child starts run) only on CPU time the server
    leaves: Linux's SCHED_IDLE, else the lowest nice level."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(NICE)


def _map(value, fn: Callable[[torch.Tensor], object]):
    if isinstance(value, torch.Tensor):
        return fn(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # a forward's layout
        return dataclasses.replace(value, **{f.name: _map(getattr(value, f.name), fn)
                                             for f in dataclasses.fields(value) if f.init})
    if isinstance(value, dict):
        return {k: _map(v, fn) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_map(v, fn) for v in value)
    return value


def _move(forward: Forward, device: str) -> Forward:
    return _map(forward, lambda t: t.to(device))


def _device(forward: Forward) -> torch.device:
    found = []
    _map(forward, found.append)
    return found[0].device


if __name__ == "__main__":
    main(sys.argv[1])
