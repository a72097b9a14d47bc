"""Ulysses sequence parallelism for the DiTs (SD3's MMDiT, Flux, Wan) over a torch.distributed group.

DeepSpeed Ulysses (Jacobs et al., 2023, arXiv:2309.14509, §3): each of the group's k ranks holds
a contiguous 1/k of the sequence. Everything between attentions (AdaLN, FFN, projections) is per
token and runs on the shard unchanged; around attention an all-to-all trades (sequence shard,
all heads) for (whole sequence, heads/k), each rank attends over every token for its own heads,
and a second all-to-all trades back. The model runs unchanged: a forward hook cuts the embedded
image tokens, the attention processors do the exchanges, a hook on `proj_out` gathers the output.

Where this departs from the paper, and why:
- Both streams of a joint block are sharded: each rank holds its shard of the image tokens and
  its contiguous shard of the text tokens (sizes differing by at most one: the text length need
  not divide by k), and one all-to-all per direction carries both (`all_to_all_single` with
  uneven splits). Keeping the text whole on every rank instead (as this module first did) runs
  the text stream k times: SD3's 333 text tokens are a quarter of a 512 px step's sequence, which
  capped degree 2 at 1.6x before any collective (docs/fullsize.md).
- Wan's text enters by cross-attention only: each query token attends to the whole text, which
  every rank holds, so cross-attention runs on the shard as it is and only self-attention
  exchanges; the text is not cut. Its patch embedding is a Conv3d whose output the model
  flattens into tokens, so the hook cuts the flattened tokens (`split_grid`); its RoPE is made
  for the whole clip before the embedding and applies after the first all-to-all, as Flux's.
- The degree is not fixed at load time: `ulysses(transformer, group)` installs everything for
  one forward (or one step) and removes it on exit. Every rank ends each forward with the full,
  identical output, which is all the next step needs, so a request's degree can change between
  denoising steps (TetriServe's step-level parallelism).

Collectives per attention call: one all-to-all of the shard's stacked q/k/v (image and text
tokens), one all-to-all of the attention output back (the text's skipped where the model drops
it: SD3's last block). Per forward: one all-gather of the output tokens. Only
`all_to_all_single` and `all_gather_single` are used; gloo and NCCL implement both. Inference
only: the collectives carry no gradients.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from diffusers import FluxTransformer2DModel, SD3Transformer2DModel
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.attention_processor import JointAttnProcessor2_0
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor
from diffusers.models.transformers.transformer_wan import WanAttnProcessor, WanTransformer3DModel
from torch import nn

from gouache.attention import QKV, project, split_heads

# Keyword arguments through which the transformers take ControlNet residuals: lists of
# [B, image tokens, D] added to the image stream, so they are cut like it.
CONTROLNET_RESIDUALS = ("block_controlnet_hidden_states", "controlnet_block_samples", "controlnet_single_block_samples")


class SequenceShards:
    """A process group seen by one rank: its shard of the image tokens and the collectives that
    move tokens and heads between the ranks."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.rank = dist.get_rank(group)
        self.degree = dist.get_world_size(group)
        if self.rank < 0:
            raise ValueError("this process is not in the Ulysses group; enter ulysses() on the group's ranks only")
        self.tokens = 0  # image tokens in this rank's shard, set by `split` at the start of each forward
        self.text_sizes: list[int] = []  # text tokens in each rank's shard, set by `split_text`
        self.collective_s = 0.0  # wall time spent in this group's collectives so far

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """[B, N, ...] image tokens -> [B, N/k, ...]: this rank's contiguous shard."""
        return x.narrow(1, *self.image_span(x.shape[1]))

    def split_grid(self, x: torch.Tensor) -> torch.Tensor:
        """A patch embedding's [B, D, *grid] output -> [B, D, N/k]: this rank's contiguous shard of
        its tokens in the order the model flattens them (the model's flatten(2) then keeps it)."""
        tokens = x.flatten(2)
        return tokens.narrow(2, *self.image_span(tokens.shape[2]))

    def image_span(self, tokens: int) -> tuple[int, int]:
        """Where this rank's shard of an image's `tokens` starts and how many it holds (kept
        for the forward)."""
        if tokens % self.degree:
            raise ValueError(
                f"Ulysses degree {self.degree} must divide the image token count, but this forward has "
                f"{tokens} image tokens; use a latent size whose token count divides by {self.degree}, "
                "or a degree that divides it"
            )
        self.tokens = tokens // self.degree
        return self.rank * self.tokens, self.tokens

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's x, concatenated along `dim` in rank order."""
        out = x.new_empty(self.degree * x.shape[0], *x.shape[1:])  # gloo takes only the concatenated form
        start = time.perf_counter()
        dist.all_gather_single(out, x.contiguous(), group=self.group)
        self.collective_s += time.perf_counter() - start
        return out.unflatten(0, (self.degree, -1)).movedim(0, dim).flatten(dim, dim + 1)

    def split_text(self, x: torch.Tensor) -> torch.Tensor:
        """[B, L, ...] text tokens -> this rank's contiguous shard; the first L % k ranks hold one more."""
        return x.narrow(1, *self.text_span(x.shape[1]))

    def text_span(self, length: int) -> tuple[int, int]:
        """Where this rank's shard of a text of `length` tokens starts and how many it holds
        (every rank's sizes kept for the forward)."""
        self.text_sizes = [length // self.degree + (j < length % self.degree) for j in range(self.degree)]
        return sum(self.text_sizes[:self.rank]), self.text_sizes[self.rank]

    def exchange(self, pieces: list[torch.Tensor], sizes: list[int]) -> tuple[torch.Tensor, ...]:
        """All-to-all along dim 0: send pieces[j] to rank j; the pieces received, sizes[j] rows
        from rank j."""
        send = torch.cat(pieces).contiguous()
        received = send.new_empty(sum(sizes), *send.shape[1:])
        start = time.perf_counter()
        dist.all_to_all_single(received, send, output_split_sizes=sizes,
                               input_split_sizes=[len(piece) for piece in pieces], group=self.group)
        self.collective_s += time.perf_counter() - start
        return received.split(sizes)

    def attend(
        self, image: QKV, text: QKV | None, text_first: bool, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        keep_text: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Joint attention of the whole image sequence and the whole text, this rank's shards out.

        image: q, k, v of this rank's image shard [B, N/k, H, d]; text: of its text shard
        [B, L_rank, H, d], or None for image-only attention (projected in all heads: a LoRA or
        quantised layer is a module, not one weight); rope: Flux's (cos, sin) [L + N, d] of the
        joint sequence. Returns the image output [B, N/k, H*d] and the text output
        [B, L_rank, H*d] (None without text or unless `keep_text`), both in all heads.
        """
        n = image[0].shape[1]
        texts = self.text_sizes if text is not None else [0] * self.degree
        tokens = torch.stack(image) if text is None else torch.cat([torch.stack(image), torch.stack(text)], dim=2)
        by_heads = tokens.permute(2, 0, 1, 3, 4).chunk(self.degree, dim=3)  # k x [n + L_rank, 3, B, H/k, d]
        received = self.exchange(list(by_heads), [n + length for length in texts])
        images, words = [piece[:n] for piece in received], [piece[n:] for piece in received]
        joint = torch.cat(words + images if text_first else images + words)  # [L + N, 3, B, H/k, d]
        qkv = list(joint.permute(1, 2, 0, 3, 4))  # 3 x [B, L + N, H/k, d], in the model's token order
        if rope is not None:  # the whole sequence is here, so the model's RoPE applies as it is
            qkv[:2] = [apply_rotary_emb(x, rope, sequence_dim=1) for x in qkv[:2]]
        out = dispatch_attention_fn(*qkv).transpose(0, 1)  # [L + N, B, H/k, d]
        text_len = sum(texts)
        text_part, image_part = ((out[:text_len], out[text_len:]) if text_first
                                 else (out[n * self.degree:], out[:n * self.degree]))
        back = keep_text and text is not None
        starts = [sum(texts[:j]) for j in range(self.degree)]
        pieces = [torch.cat([image_part[j * n:(j + 1) * n], text_part[starts[j]:starts[j] + texts[j]]]) if back
                  else image_part[j * n:(j + 1) * n] for j in range(self.degree)]
        mine = n + (texts[self.rank] if back else 0)
        heads = self.exchange(pieces, [mine] * self.degree)  # k x [mine, B, H/k, d], heads in rank order
        out = torch.cat(heads, dim=2).transpose(0, 1).flatten(2)  # [B, mine, H*d]
        return out[:, :n], (out[:, n:] if back else None)

    def split_residuals(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Forward pre-hook of the transformer: ControlNet residuals cut like the image stream."""
        for name in CONTROLNET_RESIDUALS:
            if kwargs.get(name) is not None:
                kwargs[name] = [self.split(residual) for residual in kwargs[name]]
        return args, kwargs


class Rehearsal(SequenceShards):
    """Rank `rank` of a group of `degree` without the group: the warm-up's stand-in, whose
    exchanges receive zeros of the shapes a real step's would, so that compiled pieces around
    them (`gouache.runner.pieces.Shard`) are traced at a step's shapes before any step runs."""

    def __init__(self, degree: int, rank: int):  # not super().__init__: it asks the group
        self.group, self.rank, self.degree = None, rank, degree
        self.tokens, self.text_sizes, self.collective_s = 0, [], 0.0

    def exchange(self, pieces: list[torch.Tensor], sizes: list[int]) -> tuple[torch.Tensor, ...]:
        return tuple(pieces[0].new_zeros(size, *pieces[0].shape[1:]) for size in sizes)


def refuse_mask(attention_mask: torch.Tensor | None) -> None:
    if attention_mask is not None:  # the pipelines pass none; a mask would need cutting like the tokens
        raise NotImplementedError("Ulysses attention takes no attention mask")


class UlyssesJointAttnProcessor:
    """JointAttnProcessor2_0 (SD3) over sequence shards; also serves SD3.5's image-only `attn2`."""

    def __init__(self, shards: SequenceShards):
        self.shards = shards

    def __call__(
        self, attn: nn.Module, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        refuse_mask(attention_mask)
        image = project(hidden_states, attn.heads, (attn.to_q, attn.to_k, attn.to_v), (attn.norm_q, attn.norm_k))
        if encoder_hidden_states is None:
            image_out, _ = self.shards.attend(image, None, text_first=False)
            return attn.to_out[1](attn.to_out[0](image_out))
        added = (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
        text = project(encoder_hidden_states, attn.heads, added, (attn.norm_added_q, attn.norm_added_k))
        # SD3's last block (context_pre_only) drops the text stream: its output is never gathered
        image_out, text_out = self.shards.attend(image, text, text_first=False, keep_text=not attn.context_pre_only)
        image_out = attn.to_out[1](attn.to_out[0](image_out))
        return image_out, (None if text_out is None else attn.to_add_out(text_out))


class UlyssesFluxAttnProcessor:
    """FluxAttnProcessor over sequence shards, in both block kinds."""

    def __init__(self, shards: SequenceShards):
        self.shards = shards

    def __call__(
        self, attn: nn.Module, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None, image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        refuse_mask(attention_mask)
        own, norms = (attn.to_q, attn.to_k, attn.to_v), (attn.norm_q, attn.norm_k)
        single = encoder_hidden_states is None
        if single:  # single-stream block: it passes [text shard; image shard] as one sequence
            text_len = hidden_states.shape[1] - self.shards.tokens
            text = project(hidden_states[:, :text_len], attn.heads, own, norms)
            hidden_states = hidden_states[:, text_len:]
        else:
            added = (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
            text = project(encoder_hidden_states, attn.heads, added, (attn.norm_added_q, attn.norm_added_k))
        image = project(hidden_states, attn.heads, own, norms)
        image_out, text_out = self.shards.attend(image, text, text_first=True, rope=image_rotary_emb)
        if single:  # no output projection here: the block's proj_out takes attention and MLP together
            return torch.cat([text_out, image_out], dim=1)
        return attn.to_out[1](attn.to_out[0](image_out)), attn.to_add_out(text_out)


class UlyssesWanAttnProcessor:
    """WanAttnProcessor over sequence shards: self-attention through the all-to-alls (the clip's
    RoPE, made for its whole sequence, applies there); cross-attention on the shard as it is."""

    def __init__(self, shards: SequenceShards):
        self.shards = shards
        self.own = WanAttnProcessor()

    def __call__(
        self, attn: nn.Module, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None, rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        refuse_mask(attention_mask)
        if encoder_hidden_states is not None:  # each token attends to the whole text, on every rank
            return self.own(attn, hidden_states, encoder_hidden_states, None, None)
        if attn.fused_projections:
            raise NotImplementedError("Ulysses Wan attention takes no fused projections")
        q = split_heads(attn, attn.norm_q(attn.to_q(hidden_states)))
        k = split_heads(attn, attn.norm_k(attn.to_k(hidden_states)))
        v = split_heads(attn, attn.to_v(hidden_states))
        rope = None if rotary_emb is None else tuple(x[0, :, 0] for x in rotary_emb)  # [1, N, 1, d] -> [N, d]
        out, _ = self.shards.attend((q, k, v), None, text_first=False, rope=rope)
        return attn.to_out[1](attn.to_out[0](out.type_as(q)))


@dataclass(frozen=True)
class Spec:
    """How Ulysses goes into one transformer class."""

    embedder: str  # the module whose output is the embedded image tokens (SD3's carries its positions)
    expected: type  # the attention processor the model ships with
    processor: type  # the Ulysses processor that replaces it
    grid: bool = False  # the embedder's output is [B, D, *grid] (a conv's), which the model flattens after it
    text: str | None = "context_embedder"  # the module whose output is the text stream, cut like the image's
    # (None: the text enters by cross-attention only, and every rank keeps it whole)


SUPPORTED: dict[type, Spec] = {
    SD3Transformer2DModel: Spec("pos_embed", JointAttnProcessor2_0, UlyssesJointAttnProcessor),
    FluxTransformer2DModel: Spec("x_embedder", FluxAttnProcessor, UlyssesFluxAttnProcessor),
    WanTransformer3DModel: Spec("patch_embedding", WanAttnProcessor, UlyssesWanAttnProcessor, grid=True, text=None),
}


def spec_of(transformer: nn.Module, degree: int) -> Spec:
    """How Ulysses goes into the transformer, after refusing what it cannot run."""
    found = [spec for cls, spec in SUPPORTED.items() if isinstance(transformer, cls)]
    if not found:
        supported = ", ".join(cls.__name__ for cls in SUPPORTED)
        raise ValueError(f"Ulysses supports {supported}, not {type(transformer).__name__}")
    spec = found[0]
    heads = transformer.config.num_attention_heads
    if heads % degree:
        raise ValueError(
            f"Ulysses gives each rank heads/degree attention heads, but the model's {heads} heads do not divide "
            f"by degree {degree}; use a degree that divides {heads}"
        )
    for name, original in transformer.attn_processors.items():
        # any other processor (IP-Adapter, fused qkv, PAG) does work the Ulysses one would drop
        if type(original) is not spec.expected:
            raise ValueError(f"Ulysses supports {spec.expected.__name__} only; {name} is {type(original).__name__}")
        if getattr(original, "_parallel_config", None) is not None:
            raise ValueError("diffusers' own context parallelism is enabled on this model; disable it for Ulysses")
    return spec


def check_degree(pipe, degree: int) -> None:
    """Refuse a degree above 1 that `pipe` cannot run in parallel, with the reason: DiTs run
    sequence parallel, UNets CFG parallel (degree 2: a request's two guidance rows apart)."""
    if degree == 1:
        return
    transformer = getattr(pipe, "transformer", None)
    if transformer is None:
        if degree == 2:
            return
        raise ValueError(f"{type(pipe).__name__} denoises with a UNet, which runs at degree 1, or 2 with CFG "
                         f"parallelism (its guidance rows on two devices), not {degree}; sequence parallelism is for "
                         "the DiTs")
    spec_of(transformer, degree)


@contextlib.contextmanager
def ulysses(transformer: nn.Module, group: dist.ProcessGroup | None, compiled=None) \
        -> Iterator[SequenceShards | None]:
    """While inside, a call of `transformer` made on every rank of `group`, each with the same
    full inputs, runs sequence parallel and returns the full output on every rank, identical
    across them; it yields the group's `SequenceShards` (None when there is nothing to shard).
    A group of one rank, or None, changes nothing. On exit the processors and hooks are gone,
    so the next call may use another group. Under --compile, where the model's compiled pieces
    shard a forward (`compiled`, its `CompiledDenoiser`, holds `parallel`), nothing is installed:
    the shards go to `compiled.shards`, and the family runs its steps in pieces
    (`gouache.runner.pieces.Shard`) or, where they cannot, eagerly inside `installed`."""
    if group is None or dist.get_world_size(group) == 1:
        yield None
        return
    shards = SequenceShards(group)
    spec_of(transformer, shards.degree)
    if compiled is not None and "parallel" in compiled.holds:
        compiled.shards = shards
        try:
            yield shards
        finally:
            compiled.shards = None
        return
    with installed(transformer, shards):
        yield shards


@contextlib.contextmanager
def installed(transformer: nn.Module, shards: SequenceShards) -> Iterator[None]:
    """The Ulysses processors and hooks on `transformer` while inside (the eager forward)."""
    spec = spec_of(transformer, shards.degree)
    split = shards.split_grid if spec.grid else shards.split
    with contextlib.ExitStack() as stack:
        saved = dict(transformer.attn_processors)  # a copy: diffusers pops from it
        stack.callback(transformer.set_attn_processor, saved)
        transformer.set_attn_processor(spec.processor(shards))
        hooks = [
            transformer.register_forward_pre_hook(shards.split_residuals, with_kwargs=True),
            getattr(transformer, spec.embedder).register_forward_hook(lambda module, args, tokens: split(tokens)),
            transformer.proj_out.register_forward_hook(lambda module, args, tokens: shards.gather(tokens, dim=1)),
        ]
        if spec.text is not None:
            hooks.append(getattr(transformer, spec.text).register_forward_hook(
                lambda module, args, tokens: shards.split_text(tokens)))
        for hook in hooks:
            stack.callback(hook.remove)
        yield
