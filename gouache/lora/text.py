"""Text-encoder adapters (SD / SDXL LoRA files with `lora_te*` / `text_encoder.*` layers): on
while one request's prompt is encoded, then off.

Each layer runs as peft runs it unmerged when diffusers loads the file: the module's output plus
up(down(x)) times the layer's scale and the request's, adapters added in the request's order
(`tests/engine/test_text_loras.py` compares with `load_lora_weights`). Preparation encodes one
request at a time, so hooks on the shared encoders see only that request's prompts; the
conditioning cache keys each encoding by the adapters that shaped it (`Family.encode_prompt`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch.nn import functional

from gouache.lora.files import Lora, LoraLayer

TextAdapters = Sequence[tuple[Lora, float]]  # adapters with text-encoder layers, each with its request scale


def text_key(adapters: TextAdapters) -> tuple[tuple[str, float, str], ...]:
    """What the encodings depend on: each adapter's name, scale and file digest, in order."""
    return tuple((lora.name, scale, lora.digest) for lora, scale in adapters)


@contextmanager
def text_adapters(pipe, adapters: TextAdapters) -> Iterator[None]:
    """The adapters' text-encoder layers on `pipe`'s encoders for the block's duration."""
    handles = []
    try:
        for lora, scale in adapters:
            for encoder_name, layers in lora.text_layers.items():
                encoder = getattr(pipe, encoder_name)
                modules = dict(encoder.named_modules())
                for path, layer in layers.items():
                    handles.append(
                        modules[path].register_forward_hook(_hook(layer, scale, encoder.device, encoder.dtype)))
        yield
    finally:
        for handle in handles:
            handle.remove()


def _hook(layer: LoraLayer, scale: float, device: torch.device, dtype: torch.dtype):
    down, up = layer.down.to(device, dtype), layer.up.to(device, dtype)  # as diffusers casts the adapter
    factor = layer.scale * scale

    def hook(module, args, output: torch.Tensor) -> torch.Tensor:
        x = args[0]
        update = functional.linear(functional.linear(x.to(dtype), down), up) * factor
        return (output + update).to(output.dtype)

    return hook
