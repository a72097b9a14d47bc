"""Files users own (adapters, ControlNets, template directories), read safely while users may
rewrite them.

A file is read whole into memory with plain reads, never mapped: a mapped file that another
process truncates (`cp new.safetensors loras/x.safetensors` rewrites in place) kills the
reader with SIGBUS. What was read is identified by its content (`Snapshot.digest`), not by a
timestamp. The file's status (`signature`) is only the cue to look again: it changes with any
write, rename or replacement (ctime cannot be set back by a user), and a read during which it
changed is retried, then refused (`FileChanging`). A writer that rewrites a file in place
without changing its size, within one tick of the file system's clock, can still be read half
old and half new: replace files atomically (write elsewhere, then rename) to rule that out.

A safetensors file's header (names, dtypes, shapes; `read_header`) is read the same way, so
checking a file against a model does not read its weights.

What gouache writes for a server to read (cost models, predictors, profiles, trained weights,
adapters it makes) is written with `write_atomic`: a kill at any moment leaves the old file or
the new one whole, never a part.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

READ_ATTEMPTS = 3  # reads of a file that changes under them before it is refused
_RETRY_S = 0.05  # pause between them: a copy in progress usually ends meanwhile
_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on a header


class FileChanging(OSError):
    """A file kept changing while it was read."""


Signature = tuple[int, int, int, int]  # (inode, size, mtime ns, ctime ns): changes with any write


def signature(path: Path) -> Signature:
    """The file's status; OSError (FileNotFoundError) if it is gone."""
    status = os.stat(path)
    return status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns


@dataclass(frozen=True)
class Snapshot:
    """A file's bytes as read at one moment, and what identifies them."""

    data: bytes
    digest: str  # blake2b of `data`, hex: equal digests, equal contents
    signature: Signature  # the file's status while it was read

    @classmethod
    def of(cls, data: bytes, status: Signature) -> Snapshot:
        return cls(data, digest(data), status)


def digest(*parts: bytes) -> str:
    hasher = hashlib.blake2b(digest_size=16)
    for part in parts:
        hasher.update(part)
    return hasher.hexdigest()


def read_file(path: Path) -> Snapshot:
    """The whole file, read while it did not change (FileChanging if it kept changing)."""
    data, status = _stable(path, lambda handle, size: handle.read())
    return Snapshot.of(data, status)


@dataclass(frozen=True)
class Header:
    """A safetensors file's table of contents."""

    tensors: dict[str, dict]  # name -> {"dtype", "shape", "data_offsets": [begin, end]} (offsets in the data)
    metadata: dict[str, str]  # the file's `__metadata__`
    scalars: dict[str, tuple[str, list[int], bytes]]  # tensors of one element: (dtype, shape, raw bytes)
    signature: Signature = (0, 0, 0, 0)  # the file's status while it was read


def read_header(path: Path) -> Header:
    """A safetensors file's header and its one-element tensors (a LoRA's alphas), not its
    weights; ValueError if it is not a safetensors file."""
    header, status = _stable(path, _header)
    return Header(header.tensors, header.metadata, header.scalars, status)


def header_of(data: bytes) -> Header:
    """The header of a safetensors file already in memory."""
    return _header(io.BytesIO(data), len(data))


def _header(handle, size: int) -> Header:
    start = handle.read(8)
    if len(start) < 8:
        raise ValueError("not a safetensors file: shorter than its 8-byte header length")
    (length,) = struct.unpack("<Q", start)
    if length > min(_MAX_HEADER_BYTES, size - 8):
        raise ValueError(f"not a safetensors file: a header of {length} bytes in a file of {size}")
    try:
        table = json.loads(handle.read(length))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"not a safetensors file: its header is not JSON ({error})") from None
    if not isinstance(table, dict):
        raise ValueError("not a safetensors file: its header is not a JSON object")
    metadata = table.pop("__metadata__", None) or {}
    scalars = {}
    for name, info in table.items():
        try:
            shape, (begin, end), dtype = list(info["shape"]), info["data_offsets"], info["dtype"]
        except (TypeError, KeyError, ValueError):
            raise ValueError(f"not a safetensors file: tensor {name!r} has no dtype, shape and offsets") from None
        if not 0 <= begin <= end or 8 + length + end > size:
            raise ValueError(f"not a safetensors file: tensor {name!r} lies outside the file")
        if all(n == 1 for n in shape):
            handle.seek(8 + length + begin)
            scalars[name] = (dtype, shape, handle.read(end - begin))
    return Header(table, dict(metadata), scalars)


def write_atomic(path: str | Path, data: bytes | str) -> None:
    """Write `data` to `path` through a temporary file beside it, flushed to disk and renamed
    into place: readers (and a later start after a kill) see the old file or the new one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data.encode() if isinstance(data, str) else data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _stable(path: Path, read):
    """(`read(handle, size)` of the file, the file's signature), read while the file did not
    change; what fails to parse while the file changes is read again."""
    for attempt in range(READ_ATTEMPTS):
        before = signature(path)
        try:
            with open(path, "rb") as handle:
                value = read(handle, before[1])
        except ValueError:
            if signature(path) == before:
                raise  # the file as it stands is wrong, not one caught mid-write
        else:
            if signature(path) == before:
                return value, before
        if attempt + 1 < READ_ATTEMPTS:
            time.sleep(_RETRY_S)
    raise FileChanging(f"{path.name} changed while it was read ({READ_ATTEMPTS} tries); replace it atomically "
                       "(write it elsewhere, then rename it into place)")
