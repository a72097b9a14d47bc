"""Attention helpers shared by the packed layouts (`gouache.runner.pack_dit`), template replay
and Ulysses: q, k, v projections per head, attention of several (q, k, v) in few calls, and a
transformer's attention modules."""

from __future__ import annotations

import functools

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from torch import nn

QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # each [batch, tokens, heads, head_dim]


def project(x: torch.Tensor, heads: int, projections, norms) -> QKV:
    """q, k, v of tokens x [B, S, D] as [B, S, heads, d], with the model's optional qk norms."""
    out = []
    for proj, norm in zip(projections, (*norms, None)):  # v is never normed
        y = proj(x).unflatten(-1, (heads, -1))
        out.append(y if norm is None else norm(y))
    return tuple(out)


def attend_each(calls: list[QKV]) -> list[torch.Tensor]:
    """Attention of each (q, k, v) [S, H, d] on its own, in as few calls as can be: consecutive
    ones of equal shapes (the CFG rows of one edit, say) are stacked into one batch. Returns
    each one's output [S_q, H * d]."""
    out, i = [], 0
    while i < len(calls):
        j = i + 1
        while j < len(calls) and all(a.shape == b.shape for a, b in zip(calls[i], calls[j])):
            j += 1
        batch = [torch.stack(parts) for parts in zip(*calls[i:j])]
        out.extend(dispatch_attention_fn(*batch).flatten(2).unbind(0))
        i = j
    return out


@functools.lru_cache(maxsize=16)
def attention_modules(transformer: nn.Module) -> tuple[tuple[str, nn.Module], ...]:
    """(name, module) of the transformer's attentions, found once: every forward sets their processors."""
    return tuple((name, m) for name, m in transformer.named_modules() if hasattr(m, "set_processor"))
