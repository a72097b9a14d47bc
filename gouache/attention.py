"""Attention helpers shared by the packed layouts (`gouache.runner.pack_dit`), template replay
and Ulysses: q, k, v projections per head, attention of several (q, k, v) in few calls, and a
transformer's attention modules."""

from __future__ import annotations

import functools

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.attention_processor import AttnProcessor2_0
from torch import nn

QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # each [batch, tokens, heads, head_dim]


def project(x: torch.Tensor, heads: int, projections, norms) -> QKV:
    """q, k, v of tokens x [B, S, D] as [B, S, heads, d], with the model's optional qk norms."""
    out = []
    for proj, norm in zip(projections, (*norms, None)):  # v is never normed
        y = proj(x).unflatten(-1, (heads, -1))
        out.append(y if norm is None else norm(y))
    return tuple(out)


def split_heads(attn: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """[..., H * d] -> [..., H, d] (after Wan's q and k norms, which run across all heads)."""
    return x.unflatten(-1, (attn.heads, -1))


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


def check_plain(attn: nn.Module) -> None:
    """Raise ValueError unless `attn` (a UNet's diffusers Attention) computes plain attention
    with `AttnProcessor2_0`: projections, SDPA and the output projection, with no norm before
    and no residual inside, which the forwards that take its projections themselves (template
    replay, a patched UNet's attention as data) redo."""
    plain = attn.group_norm is None and attn.spatial_norm is None and attn.norm_cross is None
    if type(attn.processor) is not AttnProcessor2_0 or attn.residual_connection or not plain:
        raise ValueError(f"this forward supports plain AttnProcessor2_0 attention only, not "
                         f"{type(attn.processor).__name__}")


@functools.lru_cache(maxsize=16)
def attention_modules(transformer: nn.Module) -> tuple[tuple[str, nn.Module], ...]:
    """(name, module) of the transformer's attentions, found once: every forward sets their processors."""
    return tuple((name, m) for name, m in transformer.named_modules() if hasattr(m, "set_processor"))


@torch.library.custom_op("gouache::attend_segments", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def attend_segments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_cuts: torch.Tensor,
                    kv_cuts: torch.Tensor) -> torch.Tensor:
    """Attention of segments, each of its own queries over its own keys and values: q [Nq, H, d],
    k and v [Nkv, H, d]; segment s is queries `q_cuts[s]:q_cuts[s + 1]` and keys and values
    `kv_cuts[s]:kv_cuts[s + 1]`. Returns [Nq, H * d].

    One operator of a compiled graph whose segments are data (a batch of mixed sizes): dynamo
    does not trace it, so the graph around it serves every mix of its shapes, and inductor keeps
    it out of CUDA graphs (it reads the cuts on the host), running the spans between under them
    (graph partitions): attention over segments is the break between compiled pieces."""
    qs, kvs = q_cuts.tolist(), kv_cuts.tolist()
    calls = [(q[a:b], k[c:e], v[c:e]) for a, b, c, e in zip(qs, qs[1:], kvs, kvs[1:]) if b > a]
    return torch.cat(attend_each(calls)) if calls else q.new_empty(0, q.shape[1] * v.shape[2])


@attend_segments.register_fake
def _(q, k, v, q_cuts, kv_cuts):
    return q.new_empty(q.shape[0], q.shape[1] * v.shape[2])
