"""What identifies a model's weights, for files that hold what one model computed (a
template's recorded activations, a reuse predictor trained on its runs)."""

from __future__ import annotations

import hashlib
import json

import torch
from torch import nn


def model_digest(pipe) -> str:
    """What tells one model's recorded activations from another's, cheaply: each module's config
    and the first values of every tensor of its weights (a fine-tune changes nearly all of
    them). Taken before any LoRA is merged into the weights."""
    digest = hashlib.blake2b(digest_size=16)
    for name, module in sorted(pipe.components.items()):
        if isinstance(module, nn.Module):
            config = getattr(module, "config", None) or {}
            config = config.to_dict() if hasattr(config, "to_dict") else dict(config)  # transformers' / diffusers'
            config = {k: v for k, v in config.items() if not k.startswith("_")}  # private keys vary run to run
            digest.update(f"{name}:{json.dumps(config, sort_keys=True, default=str)}".encode())
            for key, tensor in module.state_dict().items():
                if type(tensor) is not torch.Tensor and hasattr(tensor, "dequantize"):  # quantized (torchao)
                    tensor = tensor.dequantize()  # its own values: a quantized model's activations differ
                digest.update(key.encode())
                digest.update(tensor.detach().flatten()[:16].float().cpu().numpy().tobytes())
    return digest.hexdigest()
