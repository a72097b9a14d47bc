"""The compile cache (`--compile-cache DIR`, or inductor's own directory): a damaged kernel is
moved aside before it can be loaded, so a process killed while it compiled never stops a start.

Inductor builds each kernel (a `.so`) while holding a file lock named after the kernel's key
(`DIR/locks/<key>.lock`), lets the compiler write straight to the final name, and later loads
any kernel whose file exists without looking at it. A process killed while the compiler writes
(a pod killed by its start-up probe, an OOM kill, a node drain) leaves a truncated file, and
every later process that needs that kernel fails to load it ("file too short"). gouache writes
none of these files and does not patch inductor; it checks them:

- **Under the build lock.** A kernel is judged only while its key's lock is held, so a file that
  another process is compiling now (it holds the lock) is skipped, never judged half-written.
  Inductor's own locks already make concurrent compiles on one directory safe; the check keeps
  to them.
- **Whole or damaged.** An ELF file is whole when its header, its program and section header
  tables, and every segment's and section's bytes lie inside the file; a killed compiler or
  linker leaves a file that is empty, has no header yet, or ends before its tables.
- **Moved aside, never loaded twice.** A damaged kernel goes to `DIR/damaged/` (kept for a
  post-mortem); the next compile that needs it builds it anew. `CompiledDenoiser` sweeps at
  start and again after any forward fails to compile, and retries once if the sweep moved
  something; a forward that still fails runs eagerly (`gouache.runner.compiled`).
"""

from __future__ import annotations

import logging
import os
import struct
import time
from pathlib import Path

from filelock import FileLock, Timeout

log = logging.getLogger(__name__)

# What inductor's C++ builds load: `<key>.so` and `<key>.main.so`, each built under `locks/<key>.lock`.
# Object files (`.o`, linked into a `.so` in inductor's two-part builds) are left alone: their
# names do not give the lock they are built under, so a sweep could not tell a half-written one
# from a damaged one; a damaged one fails its link, and that forward runs eagerly.
KERNEL_SUFFIXES = (".so",)
DAMAGED = "damaged"  # the folder under the cache where damaged kernels are moved
GRAPHS = "gouache-graphs.txt"  # the keys of the graphs compiled into the cache, one a line (`remember`)


def cache_dir(directory: str | None) -> Path:
    """The directory compiled kernels are kept in: `directory`, or inductor's own (which reads
    TORCHINDUCTOR_CACHE_DIR, else a folder per user under the system's temp directory)."""
    if directory:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(directory)
    from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

    return Path(inductor_cache_dir())


def remember(directory: Path, key: str) -> None:
    """Note that a graph of `key` (its repr) was compiled into the cache at `directory`: a later
    start loads it before it says it is healthy (`known`), where it would have left it to the
    background compiler. Appended in one write (servers and their children share the file); a
    line lost to a full disk only makes that graph compile in the background again."""
    try:
        with open(directory / GRAPHS, "a") as f:
            f.write(key + "\n")
    except OSError as e:
        log.warning("could not note a compiled graph in %s: %s", directory / GRAPHS, e)


def known(directory: Path) -> set[str]:
    """The keys `remember` noted in the cache at `directory` (its kernels may since have been
    swept or deleted: such a graph compiles anew)."""
    try:
        return set((directory / GRAPHS).read_text(errors="replace").splitlines())
    except OSError:
        return set()


def sweep(directory: Path) -> list[Path]:
    """Move every damaged kernel under `directory` aside (to `directory/damaged/`); the paths
    moved. Kernels whose build lock another process holds are being written and are skipped."""
    moved = []
    (directory / "locks").mkdir(exist_ok=True)
    for path in sorted(_kernels(directory)):
        lock = FileLock(directory / "locks" / f"{path.name.split('.')[0]}.lock", timeout=0)
        try:
            with lock:
                why = damaged(path)
                if why is not None:
                    moved.append(_move_aside(directory, path, why))
        except Timeout:
            continue  # another process is building it now
        except FileNotFoundError:
            continue  # another process moved it first
    return moved


def damaged(path: Path) -> str | None:
    """Why the ELF file at `path` is not whole (None: it is)."""
    try:
        return _damaged(path)
    except struct.error:
        return "its tables point past their entries"


def _damaged(path: Path) -> str | None:
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(64)
        if len(head) < 52 or head[:4] != b"\x7fELF":
            return f"no ELF header ({size} bytes)"
        wide = head[4] == 2  # ELFCLASS64
        order = "<" if head[5] == 1 else ">"
        if wide:
            phoff, shoff = struct.unpack_from(order + "QQ", head, 32)
            phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "HHHH", head, 54)
        else:
            phoff, shoff = struct.unpack_from(order + "II", head, 28)
            phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "HHHH", head, 42)
        for name, offset, count, entry in (("program", phoff, phnum, phentsize), ("section", shoff, shnum, shentsize)):
            if count and offset + count * entry > size:
                return f"ends before its {name} header table ({size} bytes, the table ends at {offset + count * entry})"
        for extent in _extents(f, order, wide, phoff, phnum, phentsize, shoff, shnum, shentsize):
            if extent > size:
                return f"ends before its contents ({size} bytes, a segment or section ends at {extent})"
    return None


def _extents(f, order: str, wide: bool, phoff: int, phnum: int, phentsize: int, shoff: int, shnum: int,
             shentsize: int):
    """Where each loaded segment and each section with contents ends in the file."""
    for i in range(phnum):
        f.seek(phoff + i * phentsize)
        entry = f.read(phentsize)
        kind = struct.unpack_from(order + "I", entry, 0)[0]
        offset, filesz = (struct.unpack_from(order + "Q", entry, 8)[0], struct.unpack_from(order + "Q", entry, 32)[0]) \
            if wide else (struct.unpack_from(order + "I", entry, 4)[0], struct.unpack_from(order + "I", entry, 16)[0])
        if kind == 1:  # PT_LOAD
            yield offset + filesz
    for i in range(shnum):
        f.seek(shoff + i * shentsize)
        entry = f.read(shentsize)
        kind = struct.unpack_from(order + "I", entry, 4)[0]
        offset, length = struct.unpack_from(order + ("QQ" if wide else "II"), entry, 24 if wide else 16)
        if kind != 8:  # SHT_NOBITS takes no bytes in the file
            yield offset + length


def _kernels(directory: Path):
    for root, dirs, files in os.walk(directory):
        dirs[:] = [d for d in dirs if d != DAMAGED]
        for name in files:
            if name.endswith(KERNEL_SUFFIXES):
                yield Path(root) / name


def _move_aside(directory: Path, path: Path, why: str) -> Path:
    aside = directory / DAMAGED / f"{path.name}.{time.time_ns()}"
    aside.parent.mkdir(exist_ok=True)
    os.replace(path, aside)
    log.warning("compile cache: moved a damaged kernel aside (%s): %s -> %s; it is compiled anew", why, path, aside)
    return path
