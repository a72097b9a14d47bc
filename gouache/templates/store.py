"""InstGenIE's tiered activation store (§4.2): a template's cached activations in device memory,
host memory or on disk, each tier with a byte budget.

An entry is a named set of tensors (say, one step's block outputs of one template). `put`
places it in the top tier; a tier over its budget moves its least recently used entries down
one tier (device -> host -> disk); the disk tier over its budget deletes them. `get` looks
from the top tier down and moves a hit to the top. Disk entries are safetensors files; one
that is missing or does not read back as written (truncated, corrupt, other tensors) is a miss
and is forgotten: the caller recomputes, never uses a wrong activation. `prefetch` starts the
disk -> host read in a thread, so that it overlaps whatever the request waits for.

A tier with a budget of 0 is skipped (on a CPU, device and host memory are the same).

The store owns its directory: one store per directory (a lock file says so; replicas and device
workers each have their own subdirectory), and whatever its files hold counts against its disk
budget; closing it writes what memory holds to disk. A store that starts in a directory an
earlier run left adopts that run's files, oldest first, when they were recorded for the same
model (`owner`: its weights' digest) and their names and headers agree; it deletes its own files
that do not (another model's, half-written ones), so a restart reuses the templates it can and
the directory never grows past the budget. Each file's name carries the digest of its bytes,
which a read checks, so an adopted file is as safe as a fresh one. Files of other names are left
alone.
"""

from __future__ import annotations

import fcntl
import hashlib
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load, save

from gouache.files import read_header
from gouache.threads import single

TIERS = ("device", "host", "disk")
Entry = dict[str, torch.Tensor]
LOCK = ".lock"  # held (flock) by the store that owns the directory
# <key hash>-<digest>.safetensors, or a write in progress
_NAME = re.compile(r"([0-9a-f]{32})(?:-([0-9a-f]{32})\.safetensors|\.tmp)")


@dataclass(frozen=True)
class _File:
    """A disk entry."""

    path: Path
    size: int  # bytes
    digest: str  # of its bytes (also in its name): a read that finds other bytes is a miss


class TemplateStore:
    def __init__(self, directory: str | Path, budgets: dict[str, int], device: str | torch.device = "cpu",
                 owner: str = ""):
        unknown = set(budgets) - set(TIERS)
        if unknown:
            raise ValueError(f"unknown tier(s) {sorted(unknown)}; tiers are {', '.join(TIERS)}")
        self.directory = Path(directory)
        self.budgets = {tier: budgets.get(tier, 0) for tier in TIERS}
        self.device = torch.device(device)
        self.owner = owner  # what its entries were recorded with (the model's digest): others' files are not its
        self._claim = _claim(self.directory)
        self._memory: dict[str, OrderedDict[str, Entry]] = {"device": OrderedDict(), "host": OrderedDict()}
        self._disk: OrderedDict[str, _File] = OrderedDict()
        self._lock = threading.RLock()
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="gouache-store", initializer=single)
        self._reads: dict[str, Future] = {}
        self._bytes = dict.fromkeys(TIERS, 0)  # what each tier holds
        self.hits = dict.fromkeys(TIERS, 0)
        self.misses = 0
        self.corrupt = 0  # disk entries that did not read back
        self.adopted = self._adopt()  # entries an earlier run left here

    # -- what is held ---------------------------------------------------------------------

    def nbytes(self, tier: str) -> int:
        with self._lock:
            return self._bytes[tier]

    def held(self) -> dict[str, int]:
        """Bytes held per tier."""
        with self._lock:
            return dict(self._bytes)

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
        """Write what memory holds to disk (within its budget: the least recently used go first),
        for the next store of this directory to adopt, and let go of the directory."""
        self._reader.shutdown(wait=True)
        with self._lock:
            if self.budgets["disk"] > 0:
                for tier in ("host", "device"):  # least recently used first
                    for key, entry in self._memory[tier].items():
                        self._write(key, entry)
                self._spill("disk")
        self._claim.close()

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

    def _write(self, key: str, entry: Entry) -> None:
        data = save({name: t.detach().cpu().contiguous() for name, t in entry.items()},
                    metadata={"key": key, "owner": self.owner})
        digest = hashlib.blake2b(data, digest_size=16).hexdigest()
        self._drop_file(key)
        tmp = self.directory / f"{_key_hash(key)}.tmp"
        tmp.write_bytes(data)
        path = self.directory / f"{_key_hash(key)}-{digest}.safetensors"
        tmp.replace(path)  # a reader never sees half a file
        self._disk[key] = _File(path, len(data), digest)
        self._bytes["disk"] += len(data)

    def _read(self, key: str) -> Entry | None:
        """The entry's tensors on the host, or None if its file is gone or not what was written
        (its digest differs: truncated, overwritten, flipped bits)."""
        with self._lock:
            held = self._disk.get(key)
        if held is None:
            return None
        try:
            data = held.path.read_bytes()
            if hashlib.blake2b(data, digest_size=16).hexdigest() != held.digest:
                return None
            return load(data)
        except Exception:  # missing, unreadable: the caller recomputes
            return None

    def _adopt(self) -> int:
        """Index the files an earlier run left (oldest first, within the disk budget); delete
        this store's files that cannot be used. How many were adopted."""
        found = []
        for path in self.directory.iterdir():
            match = _NAME.fullmatch(path.name)
            if match is None:
                continue  # not a file of a store
            key = _own_key(path, self.owner) if match[2] else None
            if key is None or _key_hash(key) != match[1]:
                path.unlink(missing_ok=True)
                continue
            status = path.stat()
            found.append((status.st_mtime_ns, key, _File(path, status.st_size, match[2])))
        for _, key, held in sorted(found, key=lambda item: item[0]):
            if key in self._disk:  # two files of one key: the newer stands
                self._drop_file(key)
            self._disk[key] = held
            self._bytes["disk"] += held.size
        self._spill("disk")
        return len(self._disk)

    def _drop_file(self, key: str) -> None:
        held = self._disk.pop(key, None)
        if held is not None:
            self._bytes["disk"] -= held.size
            held.path.unlink(missing_ok=True)

    def _take(self, tier: str, key: str) -> Entry | None:
        """Remove a memory tier's entry (None if it has none)."""
        entry = self._memory[tier].pop(key, None)
        if entry is not None:
            self._bytes[tier] -= _size(entry)
        return entry


def _size(entry: Entry) -> int:
    return sum(t.nbytes for t in entry.values())


def _key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def _own_key(path: Path, owner: str) -> str | None:
    """The key a file of this store holds, from its header; None if it is not readable as one
    or was recorded for another owner."""
    try:
        metadata = read_header(path).metadata
    except (OSError, ValueError):
        return None
    return metadata.get("key") if metadata.get("owner") == owner else None


def _claim(directory: Path):
    """The directory's lock, held while the store lives (ValueError if another process's store holds it)."""
    directory.mkdir(parents=True, exist_ok=True)
    handle = open(directory / LOCK, "a")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise ValueError(f"the template directory {directory} is in use by another template store; give each "
                         "server its own --template-dir") from None
    return handle
