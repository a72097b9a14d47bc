"""The ControlNets of one model in one process: diffusers directories read whole (never
mapped: `gouache.files`), loaded on the base's device, the recently used ones kept within a byte budget.

A loaded ControlNet is the bytes it was built from (`_Held.digest`: its config and weights).
The files' status is the cue to look again: when it changed (a file rewritten or replaced,
whatever its timestamps say), the files are read again, and the model is rebuilt unless they
hold the same bytes. A directory caught half-written is a 400 (ControlNetError), never a crash.
"""

from __future__ import annotations

import io
import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from gouache.adapter_names import CONFIG, ControlNetError, UnknownControlNet, controlnet_names, controlnet_path
from gouache.controlnet.model import Base, check_config
from gouache.files import Signature, Snapshot, digest, read_file, signature

# the weight files diffusers' `save_pretrained` writes, in the order it looks for them
SAFETENSORS = "diffusion_pytorch_model.safetensors"
PICKLE = "diffusion_pytorch_model.bin"
SHARDS = "diffusion_pytorch_model.safetensors.index.json"
WEIGHTS = (SAFETENSORS, SHARDS, PICKLE)


def nbytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@dataclass
class ControlCounts:
    hits: int = 0
    misses: int = 0
    load_s: list[float] = field(default_factory=list)  # seconds of each load, since the last `take`
    reported: tuple[int, int] = (0, 0)

    def take(self) -> tuple[dict[str, int], list[float]]:
        """hit / miss counts and load times since the last call."""
        change = {"hit": self.hits - self.reported[0], "miss": self.misses - self.reported[1]}
        self.reported, loads, self.load_s = (self.hits, self.misses), self.load_s, []
        return {k: n for k, n in change.items() if n}, loads


@dataclass
class _Held:
    """A loaded ControlNet and what it was built from."""

    status: tuple[Signature, ...]  # its files' status when they were read (config, weights)
    digest: str  # of their bytes
    model: nn.Module


class ControlNetCache:
    """The ControlNets of `directory` for `base`; the one in use always stays loaded."""

    def __init__(self, directory: str | Path | None, base: Base | None, budget_bytes: int = 4 << 30):
        self.directory = Path(directory) if directory else None
        self.base = base
        self.budget_bytes = budget_bytes
        self.counts = ControlCounts()
        self._models: OrderedDict[str, _Held] = OrderedDict()
        self._checked: dict[str, Signature] = {}  # name -> status of the config.json `check` passed
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        return controlnet_names(self.directory)

    def check(self, name: str) -> None:
        """Raise ControlNetError unless `name` exists and fits the UNet (its config.json only)."""
        path = controlnet_path(self.directory, name)
        if self._checked.get(name) == _status(name, path / CONFIG):
            return
        config, status = _config(name, path)
        check_config(config, self.base.unet_config, name)
        self._checked[name] = status

    def get(self, name: str) -> nn.Module:
        """The loaded ControlNet (read from its directory when its files changed or it is not held)."""
        path = controlnet_path(self.directory, name)
        status = _statuses(name, path)
        with self._lock:
            held = self._models.get(name)
            if held is not None and held.status == status:
                self._models.move_to_end(name)
                self.counts.hits += 1
                return held.model
        self.check(name)
        start = time.perf_counter()
        kind, files = _read(name, path)
        content = digest(*(snapshot.data for snapshot in files))
        if held is not None and held.digest == content:  # rewritten with the same bytes
            model = held.model
        else:
            model = _build(name, kind, files, self.base)
        with self._lock:
            self.counts.misses += 1
            self.counts.load_s.append(time.perf_counter() - start)
            self._models[name] = _Held(tuple(snapshot.signature for snapshot in files[:2]), content, model)
            self._models.move_to_end(name)
            total = sum(nbytes(h.model) for h in self._models.values())
            while total > self.budget_bytes and len(self._models) > 1:
                _, old = self._models.popitem(last=False)
                total -= nbytes(old.model)
        return model

    def load(self, name: str) -> dict:
        """Check and load ControlNet `name` (POST /v1/controlnets); what is held of it."""
        self.check(name)
        self.get(name)
        return self.describe(name)

    def describe(self, name: str) -> dict:
        """What the listing says of one: whether it is loaded as its files are now."""
        path = controlnet_path(self.directory, name)
        with self._lock:
            held = self._models.get(name)
        try:
            loaded = held is not None and held.status == _statuses(name, path)
        except ControlNetError:  # its weights are gone meanwhile
            loaded = False
        out = {"id": name, "object": "controlnet", "loaded": loaded}
        if loaded:
            out["bytes"] = nbytes(held.model)
        return out

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(nbytes(h.model) for h in self._models.values())


def _status(name: str, path: Path) -> Signature:
    try:
        return signature(path)
    except OSError as error:
        raise UnknownControlNet(f"unknown ControlNet {name!r}: {path.name} is gone ({error})") from None


def _weights(name: str, path: Path) -> Path:
    for file in WEIGHTS:
        if (path / file).is_file():
            return path / file
    raise ControlNetError(f"ControlNet {name!r} has no weights: none of {', '.join(WEIGHTS)} in its directory")


def _statuses(name: str, path: Path) -> tuple[Signature, ...]:
    """The status of every file the ControlNet is read from (a sharded one's index, not its shards:
    diffusers writes an index anew with its shards)."""
    return _status(name, path / CONFIG), _status(name, _weights(name, path))


def _config(name: str, path: Path) -> tuple[dict, Signature]:
    try:
        snapshot = read_file(path / CONFIG)
        config = json.loads(snapshot.data)
    except (OSError, ValueError) as error:
        raise ControlNetError(f"ControlNet {name!r} has no readable {CONFIG} ({error})") from None
    if not isinstance(config, dict):
        raise ControlNetError(f"ControlNet {name!r}: {CONFIG} is not a JSON object")
    return config, snapshot.signature


def _read(name: str, path: Path) -> tuple[str, list[Snapshot]]:
    """Which weight file it has, and its config, that file and a sharded one's shards, each read whole."""
    weights = _weights(name, path)
    try:
        files = [read_file(path / CONFIG), read_file(weights)]
        if weights.name == SHARDS:
            shards = sorted(set(json.loads(files[1].data)["weight_map"].values()))
            files += [read_file(path / shard) for shard in shards]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ControlNetError(f"ControlNet {name!r} could not be read ({type(error).__name__}: {error})") from None
    return weights.name, files


def _build(name: str, kind: str, files: list[Snapshot], base: Base) -> nn.Module:
    """A diffusers ControlNetModel of the config's architecture with the tensors of weight files
    of `kind` (one of WEIGHTS)."""
    from diffusers import ControlNetModel
    from safetensors import SafetensorError
    from safetensors.torch import load

    config, weights, *shards = files
    try:
        if kind == SHARDS:
            state = {key: value for shard in shards for key, value in load(shard.data).items()}
        elif kind == SAFETENSORS:
            state = load(weights.data)
        else:  # a torch pickle: tensors only
            state = torch.load(io.BytesIO(weights.data), map_location="cpu", weights_only=True)
        with torch.device("meta"):  # no random initialisation of weights about to be replaced
            model = ControlNetModel.from_config(json.loads(config.data))
        model.load_state_dict(state, strict=True, assign=True)
    except (SafetensorError, RuntimeError, ValueError, OSError) as error:
        raise ControlNetError(f"ControlNet {name!r} could not be loaded ({type(error).__name__}: {error})") from None
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise ControlNetError(f"ControlNet {name!r}: its weights lack {', '.join(left[:3])}")
    return nn.Module.to(model, base.device, base.dtype).eval()  # (diffusers' own `to` warns of any cast)
