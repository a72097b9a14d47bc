"""ControlNet-as-a-Service (KATZ §5): ControlNets in their own processes, beside the base model.

`ControlService` starts `workers` processes and restarts any that dies. Each listens on a Unix
socket of its own (any process of this machine with the service's key may connect: every
device's runner, every replica) and keeps its own `ControlNetCache`. A ControlNet always runs on
the same worker (rendezvous hashing of its name over the workers), so each worker's cache holds
the ControlNets it serves, and a request's several ControlNets run on several workers at once.

A client (`ControlClient`) talks to each worker over one connection: small messages pickled,
tensors through two shared-memory buffers per connection (inputs written by the client,
residuals by the worker), grown as needed, never pickled. A run sends the rows' latents,
timesteps, text embeddings and added conditioning, and a conditioning id per row; a
conditioning image crosses once, the first time its id is used on that worker, and is
forgotten when its request ends.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from multiprocessing import connection, shared_memory

import torch

from gouache.adapter_names import ControlNetError, ControlNetUnavailable
from gouache.config import ServiceAddress
from gouache.controlnet.cache import ControlNetCache
from gouache.controlnet.model import Base, Embeddings, residuals

log = logging.getLogger(__name__)


# -- tensors through shared memory ---------------------------------------------------------


class Buffer:
    """A shared-memory buffer of one connection's direction, grown (anew) when too small."""

    def __init__(self, owner: bool):
        self.owner = owner  # the creating side unlinks it
        self.shm: shared_memory.SharedMemory | None = None

    def write(self, tensors: list[torch.Tensor]) -> tuple[str, list[tuple]]:
        """Copy `tensors` in; their layout (shape, dtype, offset) and the buffer's name."""
        tensors = [t.detach().contiguous().cpu() for t in tensors]
        size = sum(t.numel() * t.element_size() for t in tensors)
        if self.shm is None or self.shm.size < size:
            self.close()
            self.shm = shared_memory.SharedMemory(create=True, size=max(size, 1 << 20) * 2)
        layout, offset = [], 0
        flat = torch.frombuffer(self.shm.buf, dtype=torch.uint8)
        for t in tensors:
            n = t.numel() * t.element_size()
            flat[offset:offset + n].copy_(t.view(-1).view(torch.uint8))
            layout.append((tuple(t.shape), str(t.dtype).removeprefix("torch."), offset))
            offset += n
        return self.shm.name, layout

    def read(self, name: str, layout: list[tuple]) -> list[torch.Tensor]:
        """Views of the tensors another process wrote into buffer `name` (valid until its next write)."""
        if self.shm is None or self.shm.name != name:
            self.close()
            self.shm = shared_memory.SharedMemory(name=name)  # its creator unlinks it
        flat = torch.frombuffer(self.shm.buf, dtype=torch.uint8)
        out = []
        for shape, dtype, offset in layout:
            dtype = getattr(torch, dtype)
            n = int(torch.Size(shape).numel()) * dtype.itemsize
            out.append(flat[offset:offset + n].view(dtype).view(shape))
        return out

    def close(self, unlink: bool = False) -> None:
        """Unmap it; the owner (or whoever is told to, the last to use it) also removes it."""
        if self.shm is not None:
            try:
                self.shm.close()
            except BufferError:  # a view is still alive somewhere: the mapping goes with it
                pass
            if self.owner or unlink:
                try:
                    self.shm.unlink()
                except FileNotFoundError:  # the other side removed it first
                    pass
            self.shm = None


# -- the worker processes --------------------------------------------------------------------


def _worker_main(index: int, socket: str, authkey: bytes, directory: str | None, base: Base, budget: int,
                 threads: int | None) -> None:
    from gouache.children import become_child

    become_child(f"gouache-cn-{index}")
    if threads:
        torch.set_num_threads(threads)
    cache = ControlNetCache(directory, base, budget)
    device_lock = threading.Lock()  # one ControlNet at a time on this worker's device
    with connection.Listener(socket, "AF_UNIX", authkey=authkey) as listener:
        while True:
            try:
                conn = listener.accept()
            except (OSError, EOFError):  # a client that failed the handshake
                continue
            threading.Thread(target=_serve, args=(conn, cache, device_lock, base), daemon=True).start()


def _serve(conn, cache: ControlNetCache, device_lock: threading.Lock, base: Base) -> None:
    """One client's calls, in order."""
    inputs, outputs = Buffer(owner=False), Buffer(owner=True)
    conds: dict[str, torch.Tensor] = {}  # conditioning images by id
    embedded = Embeddings()  # ... through each ControlNet's conditioning embedding, once
    try:
        while True:
            message = conn.recv()
            kind = message[0]
            try:
                if kind == "load":
                    conn.send(("ok", cache.load(message[1])))
                elif kind == "forget":
                    for cond_id in message[1]:
                        conds.pop(cond_id, None)
                    embedded.forget(set(message[1]))
                elif kind == "run":
                    _, jobs, buffer, layout, new_conds, has_added = message
                    tensors = inputs.read(buffer, layout)
                    for cond_id, cond in zip(new_conds, tensors[len(tensors) - len(new_conds):]):
                        conds[cond_id] = cond.to(base.device, copy=True)
                    sample, timesteps, embeds, *rest = (t.to(base.device)
                                                        for t in tensors[:len(tensors) - len(new_conds)])
                    added = {"text_embeds": rest[0], "time_ids": rest[1]} if has_added else None
                    parts, start = [], time.perf_counter()
                    with device_lock:
                        for name, rows, cond_ids in jobs:
                            index, model = torch.tensor(rows, device=sample.device), cache.get(name)
                            parts += residuals(model, sample[index], timesteps[index], embeds[index],
                                               embedded.rows(name, model, cond_ids, conds),
                                               {k: v[index] for k, v in added.items()} if added else None)
                    seconds = time.perf_counter() - start
                    out_name, out_layout = outputs.write(parts)
                    conn.send(("ok", (out_name, out_layout, cache.counts.take(), seconds)))
            except ControlNetError as error:
                if kind != "forget":  # a forget has no answer
                    conn.send(("error", str(error)))
            except Exception as error:  # the run's requests fail, the worker serves on
                log.exception("ControlNet call %s failed", kind)
                if kind != "forget":
                    conn.send(("error", f"{type(error).__name__}: {error}"))
    except (EOFError, OSError):
        pass
    finally:
        inputs.close()
        outputs.close()
        conn.close()


class ControlService:
    """The service's processes: started here, each restarted when it dies, stopped by `shutdown`."""

    def __init__(self, workers: int, directory: str | None, base: Base, budget: int, threads: int | None = None,
                 start_timeout_s: float = 120.0):
        from gouache.children import processes

        self._context = processes()
        self._dir = tempfile.mkdtemp(prefix="gouache-controlnets-")
        self.address = ServiceAddress(tuple(os.path.join(self._dir, f"worker-{i}.sock") for i in range(workers)),
                                      secrets.token_bytes(16))
        self._args = (directory, base, budget, threads)
        self._procs = [self._spawn(i) for i in range(workers)]
        self._closing = False
        self.restarts = 0
        deadline = time.monotonic() + start_timeout_s
        try:
            for i in range(workers):
                self._wait_ready(i, deadline)
        except BaseException:
            for process in self._procs:
                process.kill()
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        self._watcher = threading.Thread(target=self._watch, name="gouache-controlnet-watch", daemon=True)
        self._watcher.start()

    def _spawn(self, i: int):
        socket = self.address.sockets[i]
        if os.path.exists(socket):
            os.unlink(socket)
        process = self._context.Process(target=_worker_main, name=f"gouache-controlnet-{i}", daemon=True,
                                        args=(i, socket, self.address.authkey, *self._args))
        process.start()
        return process

    def _wait_ready(self, i: int, deadline: float) -> None:
        while not os.path.exists(self.address.sockets[i]):
            if not self._procs[i].is_alive():
                raise RuntimeError(f"ControlNet worker {i} exited at start (exit code {self._procs[i].exitcode})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"ControlNet worker {i} did not start in time")
            time.sleep(0.02)

    def _watch(self) -> None:
        while not self._closing:
            for i, process in enumerate(self._procs):
                if not process.is_alive() and not self._closing:
                    log.error("ControlNet worker %d died (exit code %s); restarting it", i, process.exitcode)
                    self._procs[i] = self._spawn(i)
                    self.restarts += 1
            time.sleep(0.1)

    def kill(self, i: int) -> None:
        """Kill one worker, as a crash would (for tests and fault drills)."""
        self._procs[i].kill()
        self._procs[i].join(timeout=5)

    def shutdown(self) -> None:
        self._closing = True
        self._watcher.join(timeout=5)  # no restart once the workers are being stopped
        for process in self._procs:
            process.kill()
            process.join(timeout=5)
        shutil.rmtree(self._dir, ignore_errors=True)


# -- the client ------------------------------------------------------------------------------


@dataclass
class _Link:
    conn: connection.Connection
    waiting: bool = False  # a run's reply is unread: the next run would overwrite its inputs
    inputs: Buffer = field(default_factory=lambda: Buffer(owner=True))
    outputs: Buffer = field(default_factory=lambda: Buffer(owner=False))
    conds: set[str] = field(default_factory=set)  # conditioning ids this worker holds


class Pending:
    """The runs of one forward sent to one worker, their residuals not read yet."""

    def __init__(self, client: ControlClient, worker: int, jobs: int):
        self.client, self.worker, self.jobs = client, worker, jobs

    def result(self) -> tuple[list[list[torch.Tensor]], float]:
        """Each run's residuals (views into shared memory, valid until this worker's next run),
        and the seconds the worker computed."""
        parts, seconds = self.client._reply(self.worker)
        each = len(parts) // self.jobs
        return [parts[i * each:(i + 1) * each] for i in range(self.jobs)], seconds


class ControlClient:
    """One runner's connections to the service (one per worker, made on first use)."""

    def __init__(self, address: ServiceAddress, reply_timeout_s: float):
        self.address = address
        self.reply_timeout_s = reply_timeout_s  # a worker silent this long over one forward is taken for hung
        self._links: dict[int, _Link] = {}
        self._forget: dict[int, list[str]] = {}
        self.counts: dict[str, int] = {}
        self.load_s: list[float] = []

    def _link(self, worker: int) -> _Link:
        link = self._links.get(worker)
        if link is None:
            try:
                conn = connection.Client(self.address.sockets[worker], "AF_UNIX", authkey=self.address.authkey)
            except OSError as error:
                raise ControlNetUnavailable(f"ControlNet service worker {worker} is unavailable ({error}); "
                                            "it is being restarted, retry shortly") from None
            link = self._links[worker] = _Link(conn)
        return link

    def send(self, worker: int, jobs: list[tuple[str, list[int], list[str]]], sample: torch.Tensor,
             timesteps: torch.Tensor, embeds: torch.Tensor, added: dict | None,
             conds: dict[str, torch.Tensor]) -> Pending:
        """Send `worker` its runs of one forward: (ControlNet name, rows of `sample` it runs over,
        each row's conditioning id in `conds`) each; the inputs cross once for all of them."""
        link = self._link(worker)
        if link.waiting:  # a forward that failed before reading it: read it now, so the replies stay in step
            try:
                self._reply(worker)
            except ControlNetError:
                pass
            link = self._link(worker)
        new = [c for c in dict.fromkeys(c for _, _, ids in jobs for c in ids) if c not in link.conds]
        tensors = [sample, timesteps, embeds, *([added["text_embeds"], added["time_ids"]] if added else []),
                   *(conds[c] for c in new)]
        buffer, layout = link.inputs.write(tensors)
        try:
            if self._forget.get(worker):
                link.conn.send(("forget", self._forget.pop(worker)))
            link.conn.send(("run", jobs, buffer, layout, new, added is not None))
        except (OSError, EOFError) as error:
            self._lost(worker, error)
        link.conds.update(new)
        link.waiting = True
        return Pending(self, worker, len(jobs))

    def _reply(self, worker: int) -> tuple[list[torch.Tensor], float]:
        link = self._links.get(worker)
        if link is None:
            raise ControlNetUnavailable(f"ControlNet service worker {worker} died; it is being restarted")
        try:
            if not link.conn.poll(self.reply_timeout_s):
                raise TimeoutError(f"no answer in {self.reply_timeout_s:g} s")
            status, value = link.conn.recv()
        except (OSError, EOFError) as error:  # TimeoutError is an OSError: a hung worker is dropped as a dead one
            self._lost(worker, error)
        link.waiting = False
        if status == "error":
            raise ControlNetError(value)
        name, layout, (counts, load_s), seconds = value
        for result, n in counts.items():
            self.counts[result] = self.counts.get(result, 0) + n
        self.load_s += load_s
        return link.outputs.read(name, layout), seconds

    def _lost(self, worker: int, error: BaseException):
        link = self._links.pop(worker)
        link.inputs.close()
        link.outputs.close(unlink=True)  # its worker is gone or about to be: nobody else removes it
        link.conn.close()
        raise ControlNetUnavailable(f"ControlNet service worker {worker} died ({type(error).__name__}); "
                                    "it is being restarted") from None

    def forget(self, request_id: str) -> None:
        """A request's conditioning images ("<request id>/<k>"), which no run will use again (the
        worker hears it with the next message this client sends it)."""
        for worker, link in self._links.items():
            gone = [c for c in link.conds if c.rsplit("/", 1)[0] == request_id]
            if gone:
                link.conds.difference_update(gone)
                self._forget.setdefault(worker, []).extend(gone)

    def load(self, name: str) -> dict:
        """Load ControlNet `name` on its worker (a connection of its own: runs may be in flight)."""
        worker = self.address.worker_of(name)
        try:
            with connection.Client(self.address.sockets[worker], "AF_UNIX", authkey=self.address.authkey) as conn:
                conn.send(("load", name))
                if not conn.poll(self.reply_timeout_s):
                    raise TimeoutError(f"no answer in {self.reply_timeout_s:g} s")
                status, value = conn.recv()
        except (OSError, EOFError) as error:  # TimeoutError is an OSError
            raise ControlNetUnavailable(f"ControlNet service worker {worker} is unavailable ({error})") from None
        if status == "error":
            raise ControlNetError(value)
        return value

    def close(self) -> None:
        """Close every connection; the workers' residual buffers of them go too (a service being
        stopped may be killed before its workers see the connection close)."""
        for worker in list(self._links):
            link = self._links.pop(worker)
            link.inputs.close()
            link.outputs.close(unlink=True)
            link.conn.close()

