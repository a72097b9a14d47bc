"""The adapters of `gouache bench soak`: random LoRAs and ControlNets of the served model in a
scratch directory the server is pointed at, and a thread that rewrites one LoRA in place while
the load runs (as `cp new.safetensors loras/l0.safetensors` does), so requests meet a file
being replaced under them."""

from __future__ import annotations

import threading
import time
from pathlib import Path

LORAS = 3  # the soak's LoRAs, l0..l2; requests of kind `lora` name l<seed % LORAS>
CONTROLNETS = 2  # c0, c1; requests of kind `controlnet` name c<seed % CONTROLNETS>
REWRITTEN = "l0"  # the LoRA the rewriter rewrites


def make_adapters(model: str, directory: Path, flags: set[str]) -> dict[str, Path]:
    """The LoRA and ControlNet directories `flags` names (`lora_dir`, `controlnet_dir`) for
    `model`, by flag name, and the two versions of the rewritten LoRA beside them. A model
    that takes no ControlNets (a transformer's) refuses them, saying why."""
    from safetensors.torch import save

    from gouache.controlnet.model import random_controlnet, supports_controlnets
    from gouache.lora.files import random_lora
    from gouache.models.zoo import load_pipeline

    pipe = load_pipeline(model)
    if "controlnet_dir" in flags and (why := supports_controlnets(pipe)):
        raise ValueError(f"--mix asks for controlnet requests, which {model} does not serve: {why}")
    made = {}
    if "lora_dir" in flags:
        made["lora_dir"] = loras = directory / "loras"
        loras.mkdir(parents=True, exist_ok=True)
        for i in range(LORAS):
            (loras / f"l{i}.safetensors").write_bytes(save(random_lora(pipe, rank=8, seed=i)))
        (directory / f"{REWRITTEN}.other").write_bytes(save(random_lora(pipe, rank=8, seed=LORAS)))
    if "controlnet_dir" in flags:
        made["controlnet_dir"] = controlnets = directory / "controlnets"
        for i in range(CONTROLNETS):
            random_controlnet(pipe, seed=i).save_pretrained(str(controlnets / f"c{i}"))
    return made


class Rewriter:
    """Rewrites LoRA l0 in place every `every_s` seconds, alternating two versions, in 64 KiB
    writes; counts the rewrites."""

    def __init__(self, directory: Path, every_s: float):
        """`directory`: where `make_adapters` wrote; `every_s` 0: it never rewrites."""
        self.directory = directory
        self.every_s = every_s
        self.rewrites = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-rewriter", daemon=True)

    def start(self) -> None:
        if self.every_s > 0:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        path = self.directory / "loras" / f"{REWRITTEN}.safetensors"
        versions = [path.read_bytes(), (self.directory / f"{REWRITTEN}.other").read_bytes()]
        while not self._stop.wait(self.every_s):
            data = versions[(self.rewrites + 1) % 2]
            with open(path, "wb") as handle:
                for start in range(0, len(data), 1 << 16):
                    handle.write(data[start:start + (1 << 16)])
                    handle.flush()
                    time.sleep(0.001)  # a copy takes a while: requests meet the file half-written
            self.rewrites += 1
