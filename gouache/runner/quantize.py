"""Quantized denoiser weights (`--quantize`), with torchao: the denoiser's linear layers.

- `int8`: int8 weights, dequantized in the matmul (torchao's `Int8WeightOnlyConfig`), on the
  CPU and on GPUs: a quarter of the linear layers' bytes. Quantizing the activations too
  (`Int8DynamicActivationInt8WeightConfig`) measured 2.4x slower than fp32 under --compile on the
  shapes UNet on this CPU, where its per-token scaling outweighs the small matmuls (docs/speed.md).
- `fp8`: float8 weights and activations (`Float8DynamicActivationFloat8WeightConfig`), on GPUs
  with float8 units (H100 and later) only.

Convolutions, norms and embeddings keep their dtype. A quantized weight cannot take an adapter
merged into it: LoRA adapters then run segmented, each request's update beside the quantized
layer (`gouache.lora.runtime`). Fidelity against fp32: `gouache bench fidelity
--candidate-quantize int8`.
"""

from __future__ import annotations

import torch


def quantize(pipe, kind: str | None):
    """`pipe` with its denoiser's linear layers quantized to `kind` in place (None: as it is)."""
    if kind is None:
        return pipe
    if kind == "fp8" and pipe.device.type != "cuda":  # ModelConfig refuses it first for a server
        raise ValueError("--quantize fp8 needs a GPU with float8 units (H100 or later); on the CPU use --quantize int8")
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        Int8WeightOnlyConfig,
        quantize_,
    )

    config = Int8WeightOnlyConfig() if kind == "int8" else Float8DynamicActivationFloat8WeightConfig()
    denoiser = pipe.unet if getattr(pipe, "unet", None) is not None else pipe.transformer
    quantize_(denoiser, config, filter_fn=lambda module, name: isinstance(module, torch.nn.Linear))
    denoiser.gouache_quantized = kind
    return pipe


def quantized(denoiser: torch.nn.Module) -> str | None:
    """The kind `denoiser`'s weights were quantized to (None: not quantized)."""
    return getattr(denoiser, "gouache_quantized", None)
