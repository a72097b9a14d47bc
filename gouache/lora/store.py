"""The LoRAs a server can apply: safetensors files in one directory (`--lora-dir`), named by
their file's stem, read on a loader thread into a host-memory LRU with a byte budget.

`load` returns a future at once: a request starts denoising while its adapters are read
(bounded asynchronous loading, `runtime`). `check` reads a file's header only (names and
shapes), so the API can refuse a file that does not fit the model without reading it.

Files are read whole, never mapped, and an adapter is its file's bytes (`Lora.digest`): a file
rewritten while the server runs is read again at its next use (its status changed), and a
request gets the old adapter, the new one, or a 400 (a file caught half-written), never a
crash (`gouache.files`).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from gouache.adapter_names import LoraError, UnknownLora, lora_names, lora_path
from gouache.files import Signature, read_file, read_header, signature
from gouache.lora.files import Lora, Target, header_tensors, lora_of_bytes, parse_lora
from gouache.threads import single


@dataclass
class LoraCounts:
    hits: int = 0  # loads answered from host memory
    misses: int = 0  # loads that read a file
    failures: int = 0  # files that could not be applied
    load_s: list[float] = field(default_factory=list)  # seconds of each file read, since the last `take_load_s`

    reported: dict[str, int] = field(default_factory=dict)  # the counts at the last `take`

    def take(self) -> dict[str, int]:
        """hit / miss / failed counts since the last call (loads happen between steps too)."""
        now = {"hit": self.hits, "miss": self.misses, "failed": self.failures}
        change = {name: n - self.reported.get(name, 0) for name, n in now.items() if n != self.reported.get(name, 0)}
        self.reported = now
        return change


class LoraStore:
    """The adapters of one model: files in `directory`, the popular ones in host memory."""

    def __init__(self, directory: str | Path | None, pipe, budget_bytes: int = 2 << 30):
        self.directory = Path(directory) if directory else None
        self.target = Target.of(pipe)  # before any forward has wrapped a block
        self.budget_bytes = budget_bytes
        self.counts = LoraCounts()
        self._memory: OrderedDict[str, tuple[Signature, Lora]] = OrderedDict()  # with its file's status when read
        self._loading: dict[str, Future] = {}
        # name -> (status of the file `check` passed, the text encoders it adapts)
        self._checked: dict[str, tuple[Signature, tuple[str, ...]]] = {}
        self._digests: dict[str, tuple[Signature, str]] = {}  # name -> (file status, digest) read by `digest`
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="gouache-lora", initializer=single)

    def path(self, name: str) -> Path:
        return lora_path(self.directory, name)

    def names(self) -> list[str]:
        return lora_names(self.directory)

    def check(self, name: str) -> tuple[str, ...]:
        """Raise LoraError unless adapter `name` exists and fits the model, from its file's
        header: keys and shapes (tensors on the meta device; scalars such as alphas read).
        Returns the text encoders it has layers for."""
        path = self.path(name)
        status = self._status(name, path)
        with self._lock:
            checked = self._checked.get(name)
            if checked is not None and checked[0] == status:
                return checked[1]
        try:
            header = read_header(path)
        except (OSError, ValueError) as error:
            raise LoraError(f"LoRA {name!r} is not a readable safetensors file ({error})") from None
        raw = header_tensors(header, name)
        if not raw:
            raise LoraError(f"LoRA {name!r} holds no tensors")
        encoders = tuple(parse_lora(raw, header.metadata, self.target, name).text_layers)
        with self._lock:
            self._checked[name] = (header.signature, encoders)
        return encoders

    def digest(self, name: str) -> str:
        """What identifies the adapter's file now (read whole when it changed since last asked)."""
        path = self.path(name)
        status = self._status(name, path)
        with self._lock:
            known = self._digests.get(name)
        if known is not None and known[0] == status:
            return known[1]
        try:
            snapshot = read_file(path)
        except OSError as error:
            raise LoraError(f"LoRA {name!r} could not be read ({error})") from None
        with self._lock:
            self._digests[name] = (snapshot.signature, snapshot.digest)
        return snapshot.digest

    def describe(self, name: str) -> dict:
        """What the listing says of one adapter (whether it sits in host memory, its size)."""
        path = self.path(name)
        status = self._status(name, path)
        with self._lock:
            held = self._memory.get(name)
        lora = held[1] if held is not None and held[0] == status else None
        out = {"id": name, "object": "lora", "file_bytes": status[1], "loaded": lora is not None}
        if lora is not None:
            every = [*lora.layers.values(),
                     *(layer for layers in lora.text_layers.values() for layer in layers.values())]
            out.update(layers=len(every), bytes=lora.nbytes, rank=max(layer.down.shape[0] for layer in every),
                       text_encoders=sorted(lora.text_layers))
        return out

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(lora.nbytes for _, lora in self._memory.values())

    def load(self, name: str) -> Future:
        """The adapter, now if it is in host memory and its file is unchanged, else once the
        loader thread has read it. An unknown name raises here; a file that cannot apply fails
        the future (LoraError)."""
        path = self.path(name)
        status = self._status(name, path)
        with self._lock:
            held = self._memory.get(name)
            if held is not None and held[0] == status:
                self._memory.move_to_end(name)
                self.counts.hits += 1
                done: Future = Future()
                done.set_result(held[1])
                return done
            if name not in self._loading:
                self.counts.misses += 1
                self._loading[name] = self._pool.submit(self._read, name, path)
            return self._loading[name]

    def _status(self, name: str, path: Path) -> Signature:
        try:
            return signature(path)
        except OSError as error:  # removed or replaced since `path` found it
            raise UnknownLora(f"unknown LoRA {name!r}: its file is gone ({error})") from None

    def _read(self, name: str, path: Path) -> Lora:
        start = time.perf_counter()
        try:
            try:
                snapshot = read_file(path)
            except OSError as error:
                raise LoraError(f"LoRA {name!r} could not be read ({error})") from None
            with self._lock:
                held = self._memory.get(name)
            same = held is not None and held[1].digest == snapshot.digest  # rewritten with the same bytes
            lora = held[1] if same else lora_of_bytes(snapshot.data, snapshot.digest, self.target, name)
        except LoraError:
            with self._lock:
                self.counts.failures += 1
                self._loading.pop(name, None)
            raise
        with self._lock:
            self.counts.load_s.append(time.perf_counter() - start)
            self._loading.pop(name, None)
            self._memory[name] = (snapshot.signature, lora)
            self._memory.move_to_end(name)
            self._evict()
        return lora

    def _evict(self) -> None:
        """Least recently used first, down to the budget (the newest always stays: it is in use)."""
        total = sum(lora.nbytes for _, lora in self._memory.values())
        while total > self.budget_bytes and len(self._memory) > 1:
            _, (_, lora) = self._memory.popitem(last=False)
            total -= lora.nbytes

    def take_counts(self) -> tuple[dict[str, int], list[float]]:
        """Load counts and file read times since the last call, for a step's report."""
        with self._lock:
            loads, self.counts.load_s = self.counts.load_s, []
            return self.counts.take(), loads

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
