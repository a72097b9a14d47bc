"""What every built model shares: its dtype names and its seeded construction (a component's
weights depend only on its own seed)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# Per-component seeds: a component's weights depend only on its own seed, never on what was
# built before it in the same process.
SEED_DENOISER, SEED_VAE, SEED_TEXT, SEED_TEXT_2, SEED_TEXT_3, SEED_IMAGE = 0, 1, 2, 3, 4, 5


def seeded(seed: int, build: Callable[[], T]) -> T:
    """Run `build` with the global RNG seeded to `seed`, leaving the caller's CPU RNG as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def torch_dtype(dtype: str) -> torch.dtype:
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPES)}")
    return DTYPES[dtype]
