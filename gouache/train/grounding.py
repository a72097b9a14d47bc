"""Token grounding for the shapes models' training (after TokenCompose, Wang et al., CVPR 2024): the
tokens of a caption's phrase ("red", "circle", "top", "left") should put their cross-attention
inside the shape that phrase describes. The dataset knows every shape's pixels, so this costs one
mask per shape; without it the UNet learnt colours from the prompt but took its layout from the
noise (position at chance after 58 000 images; docs/models.md).

The UNet's cross-attention records through `RecordingCrossAttention`, the DiT's joint attention
through `dit.CollapsedJointAttention(record=True)`; only training installs them, the served
models keep diffusers' processors."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models.attention_processor import Attention

from gouache.data.shapes import COLOURS, parse_caption

PHRASE_END = (",", "and", "on")  # the words that close a shape's phrase in a caption


class RecordingCrossAttention:
    """Plain scaled dot-product attention that keeps each call's attention probabilities,
    averaged over heads ([B, image tokens, text tokens]), for the grounding loss."""

    def __init__(self) -> None:
        self.maps: list[torch.Tensor] = []

    def __call__(
        self, attn: Attention, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None, **_: object,
    ) -> torch.Tensor:
        if encoder_hidden_states is None or attention_mask is not None or attn.residual_connection:
            raise ValueError("RecordingCrossAttention serves unmasked cross-attention (attn2) only")
        batch = hidden_states.shape[0]

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.view(batch, -1, attn.heads, x.shape[-1] // attn.heads).transpose(1, 2)

        query, key, value = (heads(attn.to_q(hidden_states)), heads(attn.to_k(encoder_hidden_states)),
                             heads(attn.to_v(encoder_hidden_states)))
        probs = (query @ key.transpose(-1, -2) * attn.scale).softmax(dim=-1)  # [B, heads, image, text]
        self.maps.append(probs.mean(dim=1))
        out = (probs @ value).transpose(1, 2).reshape(batch, -1, query.shape[1] * query.shape[-1])
        return attn.to_out[1](attn.to_out[0](out)) / attn.rescale_output_factor


def record_cross_attention(unet: torch.nn.Module) -> RecordingCrossAttention:
    """Install one recorder on every cross-attention of `unet` (self-attention keeps its processor)."""
    recorder = RecordingCrossAttention()
    unet.set_attn_processor(
        {name: recorder if name.endswith("attn2.processor") else p for name, p in unet.attn_processors.items()}
    )
    return recorder


def phrase_tokens(text: str) -> list[tuple[str, list[int]]]:
    """Per shape of a caption, (its colour, the token indices of its colour, kind and position
    words). Every caption word is one token after <bos> (`trained.tokenizer`), so word i is token
    i + 1."""
    words = text.replace(",", " ,").split()
    out = []
    for shape in parse_caption(text).shapes:
        first = words.index(shape.colour)  # colours are distinct within a scene and from backgrounds
        tokens = [first, first + 1]  # colour, kind
        i = first + 4  # past "at the" / "in the"
        while i < len(words) and words[i] not in PHRASE_END:
            tokens.append(i)
            i += 1
        out.append((shape.colour, [t + 1 for t in tokens]))
    return out


def grounding_loss(maps: list[torch.Tensor], pixels: torch.Tensor, captions: list[str]) -> torch.Tensor:
    """Mean over recorded attention maps, captioned images, shapes and their tokens of the share of
    the token's attention that falls outside the shape: 0 when every phrase attends only to its
    shape. `pixels` [B, 3, H, W] in [-1, 1] are the images of `maps`' rows; "" captions (dropped
    for classifier-free guidance) have no phrases. A shape's pixels are those of exactly its
    colour: renders are not anti-aliased and a scene's colours are distinct."""
    rows, colours, phrase_of, token_of = [], [], [], []
    for row, text in enumerate(captions):
        for colour, tokens in phrase_tokens(text) if text else []:
            phrase_of += [len(rows)] * len(tokens)
            token_of += tokens
            rows.append(row)
            colours.append(COLOURS[colour])
    if not rows:
        return pixels.new_zeros(())
    rgb = torch.tensor(colours, dtype=pixels.dtype, device=pixels.device).view(-1, 3, 1, 1)
    masks = ((pixels[rows] * 127.5 + 127.5).round() == rgb).all(dim=1, keepdim=True).to(pixels.dtype)  # [P, 1, H, W]
    rows, phrase, token = (torch.tensor(v, device=pixels.device) for v in (rows, phrase_of, token_of))
    height, width = pixels.shape[2:]
    outside = []
    for probs in maps:  # [B, h * w, text tokens]
        side = round((probs.shape[1] * width / height) ** 0.5)  # the map's width
        # [P, h * w]: touches the shape
        inside = F.adaptive_max_pool2d(masks, (probs.shape[1] // side, side)).flatten(1)
        attention = probs[rows[phrase], :, token]  # [phrase tokens, h * w]
        outside.append(1 - (inside[phrase] * attention).sum(1) / attention.sum(1).clamp_min(1e-8))
    return torch.cat(outside).mean()
