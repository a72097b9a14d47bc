"""Run as a process by test_user_files: read an adapter over and over while a thread rewrites
its file in place (open "wb", write in chunks, as `cp` does), alternating two versions. Prints
one JSON line: how many reads succeeded, with which versions' digests, and how many failed
with the adapter's own error. A process killed by SIGBUS prints nothing and exits -7."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

from gouache.adapter_names import ControlNetError, LoraError
from gouache.controlnet.cache import SAFETENSORS, ControlNetCache
from gouache.controlnet.model import Base, random_controlnet
from gouache.files import digest
from gouache.lora.files import random_lora
from gouache.lora.store import LoraStore
from gouache.models.zoo import load_pipeline


def rewrite(path: Path, versions: list[bytes], until: float) -> None:
    i = 0
    while time.monotonic() < until:
        data = versions[i % 2]
        i += 1
        with open(path, "wb") as handle:
            for start in range(0, len(data), 1 << 16):
                handle.write(data[start:start + (1 << 16)])
                handle.flush()
        time.sleep(0.002)


def versions_of(kind: str, pipe, directory: Path) -> tuple[Path, list[bytes], list[str]]:
    """The file rewritten, its two versions, and the digest of what a read of each gives."""
    from safetensors.torch import save

    if kind == "lora":
        versions = [save(random_lora(pipe, rank=64, seed=s)) for s in (1, 2)]
        return directory / "x.safetensors", versions, [digest(v) for v in versions]
    for seed in (1, 2):
        random_controlnet(pipe, seed=seed).save_pretrained(str(directory / f"v{seed}"))
    (directory / "x").mkdir()
    config = (directory / "v1" / "config.json").read_bytes()
    (directory / "x" / "config.json").write_bytes(config)
    versions = [(directory / f"v{s}" / SAFETENSORS).read_bytes() for s in (1, 2)]
    return directory / "x" / SAFETENSORS, versions, [digest(config, v) for v in versions]


def main(kind: str, directory: str, seconds: float) -> None:
    pipe = load_pipeline("tiny-sd")
    directory = Path(directory)
    path, versions, digests = versions_of(kind, pipe, directory)
    path.write_bytes(versions[0])
    if kind == "lora":
        store = LoraStore(directory, pipe)

        def read():
            store.check("x")
            return store.load("x").result().digest
    else:
        cache = ControlNetCache(directory, Base.of(pipe))

        def read():
            cache._models.clear()  # every read loads the files anew
            cache.get("x")
            return cache._models["x"].digest

    until = time.monotonic() + seconds
    threading.Thread(target=rewrite, args=(path, versions, until), daemon=True).start()
    read_ok, refused, seen = 0, 0, set()
    while time.monotonic() < until:
        try:
            seen.add(read())
            read_ok += 1
        except (LoraError, ControlNetError):
            refused += 1
    print(json.dumps({"ok": read_ok, "refused": refused, "seen": sorted(seen),
                      "versions": digests}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
