"""InstGenIE's tiered activation store (§4): a template's cached activations in device memory,
host memory or on disk, each tier with a byte budget.

An entry is a named set of tensors (say, one step's block outputs of one template). `put`
places it in the top tier; a tier over its budget moves its least recently used entries down
one tier (device -> host -> disk); the disk tier over its budget deletes them. `get` looks
from the top tier down and moves a hit to the top. Disk entries are safetensors files; one
that is missing or does not read back as written (truncated, corrupt, other tensors) is a miss
and is forgotten: the caller recomputes, never uses a wrong activation. `prefetch` starts the
disk -> host read in a thread, so that it overlaps whatever the request waits for.

A tier with a budget of 0 is skipped (on a CPU, device and host memory are the same).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import load, save

TIERS = ("device", "host", "disk")
Entry = dict[str, torch.Tensor]


class TemplateStore:
    def __init__(self, directory: str | Path, budgets: dict[str, int], device: str | torch.device = "cpu"):
        unknown = set(budgets) - set(TIERS)
        if unknown:
            raise ValueError(f"unknown tier(s) {sorted(unknown)}; tiers are {', '.join(TIERS)}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.budgets = {tier: budgets.get(tier, 0) for tier in TIERS}
        self.device = torch.device(device)
        self._memory: dict[str, OrderedDict[str, Entry]] = {"device": OrderedDict(), "host": OrderedDict()}
        self._disk: OrderedDict[str, tuple[int, bytes]] = OrderedDict()  # key -> (bytes, digest) of its file
        self._lock = threading.RLock()
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="gouache-store")
        self._reads: dict[str, Future] = {}
        self._bytes = dict.fromkeys(TIERS, 0)  # what each tier holds
        self.hits = dict.fromkeys(TIERS, 0)
        self.misses = 0
        self.corrupt = 0  # disk entries that did not read back

    # -- what is held ---------------------------------------------------------------------

    def nbytes(self, tier: str) -> int:
        with self._lock:
            return self._bytes[tier]

    def tier_of(self, key: str) -> str | None:
        with self._lock:
            for tier in ("device", "host"):
                if key in self._memory[tier]:
                    return tier
            return "disk" if key in self._disk else None

    # -- put / get ------------------------------------------------------------------------

    def put(self, key: str, tensors: Entry) -> None:
        """Store `tensors` under `key` in the highest tier with a budget (replacing any old entry)."""
        with self._lock:
            self._forget(key)
            self._place(self._top(), key, {name: t.detach() for name, t in tensors.items()})

    def get(self, key: str) -> Entry | None:
        """The entry, on the device, or None (a miss: never stored, evicted, or unreadable)."""
        with self._lock:
            for tier in ("device", "host"):
                entry = self._take(tier, key)
                if entry is not None:
                    self.hits[tier] += 1
                    return self._promote(key, entry)
            pending = self._reads.pop(key, None)
            on_disk = key in self._disk
        if not on_disk:
            self.misses += 1
            return None
        entry = pending.result() if pending is not None else self._read(key)
        with self._lock:
            if entry is None or key not in self._disk:
                self._drop_file(key)
                self.misses += 1
                self.corrupt += entry is None
                return None
            self.hits["disk"] += 1
            if self._top() == "disk":  # no memory tier to move it to: the file stays, most recently used
                self._disk.move_to_end(key)
                return {name: t.to(self.device) for name, t in entry.items()}
            self._drop_file(key)
            return self._promote(key, entry)

    def prefetch(self, key: str) -> None:
        """Start reading a disk entry in the background (no-op if it is not on disk)."""
        with self._lock:
            if key in self._disk and key not in self._reads:
                self._reads[key] = self._reader.submit(self._read, key)

    def drop_reads(self, prefix: str) -> None:
        """Forget the reads started for entries whose keys start with `prefix` (their reader
        left): what they read is not kept in memory."""
        with self._lock:
            for key in [k for k in self._reads if k.startswith(prefix)]:
                self._reads.pop(key).cancel()

    def close(self) -> None:
        self._reader.shutdown(wait=True)

    # -- tiers ----------------------------------------------------------------------------

    def _top(self) -> str:
        return next((tier for tier in TIERS if self.budgets[tier] > 0), "disk")

    def _below(self, tier: str) -> str | None:
        later = TIERS[TIERS.index(tier) + 1:]
        return next((t for t in later if self.budgets[t] > 0), None)

    def _promote(self, key: str, entry: Entry) -> Entry:
        top = self._top()
        self._place(top, key, entry)
        return self._memory[top][key] if top != "disk" else entry

    def _place(self, tier: str, key: str, entry: Entry) -> None:
        """Put an entry into `tier` (most recently used), then push what overflows one tier down."""
        if tier == "disk":
            self._write(key, entry)
        else:
            target = self.device if tier == "device" else torch.device("cpu")
            self._take(tier, key)
            self._memory[tier][key] = {name: t.to(target) for name, t in entry.items()}
            self._bytes[tier] += _size(entry)
        self._spill(tier)

    def _spill(self, tier: str) -> None:
        while self.nbytes(tier) > self.budgets[tier]:
            if tier == "disk":
                oldest = next(iter(self._disk))
                self._drop_file(oldest)
                continue
            oldest = next(iter(self._memory[tier]))
            entry = self._take(tier, oldest)
            below = self._below(tier)
            if below is not None:
                self._place(below, oldest, entry)

    def _forget(self, key: str) -> None:
        for tier in ("device", "host"):
            self._take(tier, key)
        self._reads.pop(key, None)
        self._drop_file(key)

    # -- disk -----------------------------------------------------------------------------

    def _path(self, key: str) -> Path:
        return self.directory / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.safetensors"

    def _write(self, key: str, entry: Entry) -> None:
        data = save({name: t.detach().cpu().contiguous() for name, t in entry.items()}, metadata={"key": key})
        path = self._path(key)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        tmp.replace(path)  # a reader never sees half a file
        self._drop_file_record(key)
        self._disk[key] = (len(data), hashlib.blake2b(data, digest_size=16).digest())
        self._bytes["disk"] += len(data)
        self._disk.move_to_end(key)

    def _read(self, key: str) -> Entry | None:
        """The entry's tensors on the host, or None if its file is gone or not what was written
        (its digest differs: truncated, overwritten, flipped bits)."""
        with self._lock:
            expected = self._disk.get(key)
        try:
            data = self._path(key).read_bytes()
            if expected is None or hashlib.blake2b(data, digest_size=16).digest() != expected[1]:
                return None
            return load(data)
        except Exception:  # missing, unreadable: the caller recomputes
            return None

    def _drop_file(self, key: str) -> None:
        if self._drop_file_record(key):
            self._path(key).unlink(missing_ok=True)

    def _drop_file_record(self, key: str) -> bool:
        held = self._disk.pop(key, None)
        if held is not None:
            self._bytes["disk"] -= held[0]
        return held is not None

    def _take(self, tier: str, key: str) -> Entry | None:
        """Remove a memory tier's entry (None if it has none)."""
        entry = self._memory[tier].pop(key, None)
        if entry is not None:
            self._bytes[tier] -= _size(entry)
        return entry


def _size(entry: Entry) -> int:
    return sum(t.nbytes for t in entry.values())
