"""The engine's device pool: runs each batch on the devices its plan gives, moving denoising
states between device blocks as requests change devices (the hand-off).

Preparation (text encoding, initial latents) and decoding stay in the driver's `ModelRunner`,
which keeps every request's `DenoiseState` from `prepare` to `release`. A block of workers gets
a request's state with the first batch it runs there: from the driver if the request never ran,
else exported from the block that ran it last (and dropped there). After each step the block's
reply carries the members' step counts back into the driver's state, and the latents of those
the driver decodes next (finished, or at a preview step); the others' latents and the sampler
stay on the block and move only with a hand-off.

A paused request's state can be parked (`park`): moved into the host memory of the processes
holding it, under a budget the driver keeps, and brought back to the device by its next step
there (or moved on as it is by a hand-off).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from gouache.executor.base import Executor
from gouache.executor.worker import RunOutput
from gouache.outputs import CacheBytes, StepOutput
from gouache.runner.model_runner import ModelRunner
from gouache.runner.sampler import DenoiseState
from gouache.sched.plan import Batch

log = logging.getLogger(__name__)


class DevicePool:
    """`submit` from the engine thread; `release` from any thread."""

    def __init__(self, runner: ModelRunner, executor: Executor, on_handoff: Callable[[], None] = lambda: None,
                 park_bytes: int = 0):
        self.runner = runner
        self.executor = executor
        self.on_handoff = on_handoff  # called at each hand-off (the engine counts them in /metrics)
        self.park_bytes = park_bytes  # host memory for paused requests' states (0: they stay on their devices)
        self.held: dict[str, tuple[int, ...]] = {}  # request id -> the block whose workers hold its state
        # request id -> host bytes its parked state holds (the driver's estimate until its workers answer)
        self.parked: dict[str, int] = {}
        self.handoffs = 0  # states moved from one block to another
        self.parks = 0  # states parked
        # a request was released or a cache touched since the last `settle` (at start: adopted files)
        self._stale = True
        self._lock = threading.Lock()  # guards `held`

    @classmethod
    def in_process(cls, runner: ModelRunner, on_handoff: Callable[[], None] = lambda: None,
                   park_bytes: int = 0) -> DevicePool:
        """One device, the driver's own runner: the `uniproc` executor."""
        from gouache.executor.uniproc import UniprocExecutor

        return cls(runner, UniprocExecutor(runner), on_handoff, park_bytes)

    @property
    def num_devices(self) -> int:
        return self.executor.num_devices

    def dead(self) -> set[int]:
        return self.executor.dead()

    def shutdown(self) -> None:
        self.executor.shutdown()

    def submit(self, batch: Batch) -> Future[StepOutput]:
        """One step of `batch` on its devices; the future's `StepOutput` names the members
        that stepped and those that failed (one whose state could not be fetched included)."""
        failed: dict[str, str] = {}
        incoming = {}
        for rid in batch.request_ids:
            with self._lock:
                where = self.held.get(rid)
            if where == batch.devices:
                continue
            if rid not in self.runner.states:
                failed[rid] = "its denoising state is gone"
                continue
            try:
                incoming[rid] = self._fetch(rid, where)
            except Exception as error:
                failed[rid] = f"its denoising state could not be moved to devices {batch.devices}: {error}"
        members = tuple(rid for rid in batch.request_ids if rid not in failed)
        if not members:
            done: Future[StepOutput] = Future()
            done.set_result(StepOutput(request_ids=[], forward_s=0.0, failed=failed))
            return done
        with self._lock:
            self.held.update(dict.fromkeys(incoming, batch.devices))
            for rid in members:  # a parked state comes back to the device with this step
                self.parked.pop(rid, None)
        call = self.executor.submit("execute", (Batch(members, batch.devices, 1, batch.patched), incoming),
                                    ranks=batch.devices)
        result: Future[StepOutput] = Future()

        def finish(call: Future) -> None:
            try:
                output: RunOutput = call.result()[0]
            except BaseException as error:
                result.set_exception(error)
                return
            for rid in output.step.request_ids:
                state = self.runner.states.get(rid)
                if state is not None:
                    state.step = output.steps[rid]
                    if rid in output.latents:
                        state.latents = output.latents[rid]
            output.step.failed.update(failed)
            result.set_result(output.step)

        call.add_done_callback(finish)
        return result

    def release(self, request_id: str) -> None:
        """Forget a request everywhere (finished and decoded, failed, or aborted)."""
        self.runner.release(request_id)
        with self._lock:
            where = self.held.pop(request_id, None)
            self.parked.pop(request_id, None)
            self._stale = True
        if where is None:
            return
        live = [d for d in where if d not in self.executor.dead()]  # a dead block-mate's copy went with it
        if live:
            self.executor.submit("release", ([request_id],), ranks=live)

    @property
    def parked_bytes(self) -> int:
        with self._lock:
            return sum(self.parked.values())

    def park(self, request_ids: Sequence[str]) -> None:
        """Move paused requests' states into the host memory of the processes holding them, in
        the order given while they fit in `park_bytes` (a state held by a block of k workers
        counts k times); the others stay on their devices. From the engine thread."""
        if not self.park_bytes:
            return
        for rid in request_ids:
            with self._lock:
                where, state = self.held.get(rid), self.runner.states.get(rid)
                if where is None or rid in self.parked or not isinstance(state, DenoiseState):
                    continue
                size = state.nbytes() * len(where)
                if sum(self.parked.values()) + size > self.park_bytes:
                    continue
                self.parked[rid] = size
                self.parks += 1
            call = self.executor.submit("park", ([rid],), ranks=where)
            call.add_done_callback(lambda done, rid=rid: self._parked(rid, done))

    def _parked(self, rid: str, done: Future) -> None:
        """Its workers' answer: the bytes its state takes there, or why it stayed on the device."""
        with self._lock:
            if rid not in self.parked:  # resumed or released first
                return
            if done.exception() is not None:
                log.warning("request %s stays on its device while paused: %s", rid, done.exception())
                self.parked.pop(rid)
            else:  # 0: its workers held no state of it to park (released there meanwhile)
                self.parked[rid] = sum(sizes.get(rid, 0) for sizes in done.result())
                if not self.parked[rid]:
                    del self.parked[rid]

    def touch(self) -> None:
        """The caches changed outside a step (an adapter registered): `settle` reports them again."""
        with self._lock:
            self._stale = True

    def settle(self, report: Callable[[int, CacheBytes], None]) -> None:
        """Between steps (the engine thread), when a request was released or a cache touched since
        the last call: free what released requests still hold in each live device's block cache
        (released entries otherwise wait for the next forward), and `report(device, what its
        caches hold)` as each device answers."""
        with self._lock:
            if not self._stale:
                return
            self._stale = False
        for rank in sorted(set(range(self.num_devices)) - self.executor.dead()):
            call = self.executor.submit("held", ranks=[rank])
            call.add_done_callback(lambda done, rank=rank: done.exception() or report(rank, done.result()[0]))

    def stranded(self, dead: set[int]) -> list[str]:
        """The requests whose only state beyond the driver's sampler was on a dead device."""
        with self._lock:
            return [rid for rid, where in self.held.items() if dead & set(where)]

    def _fetch(self, rid: str, where: tuple[int, ...] | None):
        if where is None:
            return self.runner.states[rid]
        state = self.executor.collective_rpc("export", ([rid],), ranks=where)[0][rid]
        self.handoffs += 1
        self.on_handoff()
        return state
