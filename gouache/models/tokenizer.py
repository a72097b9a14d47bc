"""A byte-level BPE tokenizer built entirely in code, for the tiny built-in models.

The built-ins must build offline, so no vocabulary file is read: the vocabulary is the 256
byte symbols of GPT-2's byte-level alphabet, a handful of merges and the special tokens. Every
string therefore tokenizes without an unknown token, and the result is a standard
`PreTrainedTokenizerFast` that diffusers pipelines call, save and load like CLIP's or T5's.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

# A few frequent English pairs, so that the tokenizer really is a BPE (and prompts are a bit
# shorter than their byte count). "Ġ" is the byte-level symbol for a space.
MERGES: list[tuple[str, str]] = [
    ("Ġ", "t"),
    ("h", "e"),
    ("Ġ", "a"),
    ("i", "n"),
    ("e", "r"),
    ("Ġt", "he"),
    ("o", "n"),
    ("Ġ", "s"),
]


@dataclass(frozen=True)
class SpecialTokens:
    """The special tokens of one tokenizer kind; `bos` is None where the model has none.
    `wraps`: encoding adds bos/eos around the text; `extra`: further special tokens (chat and
    vision markers) that the text itself spells."""

    bos: str | None
    eos: str
    pad: str
    unk: str
    wraps: bool = True
    extra: tuple[str, ...] = ()

    def in_order(self) -> list[str]:
        return [t for t in (self.bos, self.eos, self.pad, self.unk, *self.extra) if t is not None]


# CLIP wraps a prompt as <bos> ... <eos> and pools at the eos; T5 only appends </s>; Qwen's
# chat-template text spells its own markers, and encoding adds nothing.
KINDS: dict[str, SpecialTokens] = {
    "clip": SpecialTokens(bos="<|startoftext|>", eos="<|endoftext|>", pad="<|pad|>", unk="<|unk|>"),
    "t5": SpecialTokens(bos=None, eos="</s>", pad="<pad>", unk="<unk>"),
    "qwen": SpecialTokens(bos=None, eos="<|im_end|>", pad="<|endoftext|>", unk="<|unk|>", wraps=False,
                          extra=("<|im_start|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                                 "<|video_pad|>")),
}


def _bpe(symbols: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """Apply merges to a symbol list as BPE does: always the adjacent pair of lowest rank first."""
    while len(symbols) > 1:
        pairs = [(ranks.get(pair, len(ranks)), i) for i, pair in enumerate(zip(symbols, symbols[1:]))]
        rank, i = min(pairs)
        if rank == len(ranks):
            break
        symbols = symbols[:i] + [symbols[i] + symbols[i + 1]] + symbols[i + 2 :]
    return symbols


def word_merges(words: tuple[str, ...]) -> list[tuple[str, str]]:
    """MERGES plus the fewest merges after them that make each word (alone, and after a space) one
    token, so a model's text encoder sees whole words instead of bytes."""
    merges = list(MERGES)
    to_symbols = pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str
    for word in words:
        for spelled in (word, " " + word):
            symbols = list(to_symbols(spelled)[0][0])
            while len(tokens := _bpe(symbols, {m: r for r, m in enumerate(merges)})) > 1:
                merges.append((tokens[0], tokens[1]))  # joins the first two; the rest wait their turn
    return merges


def byte_vocab(merges: list[tuple[str, str]] = MERGES) -> dict[str, int]:
    """The 256 byte symbols first, then one token per merge; special tokens come after.

    Special tokens get ids >= 256 on purpose: CLIPTextModel treats `eos_token_id == 2` as a
    legacy config and pools at the argmax id instead of at the eos.
    """
    # alphabet() is an unordered list; sorting makes the ids the same in every process.
    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: i for i, symbol in enumerate(symbols)}
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    return vocab


def _post_processor(special: SpecialTokens, ids: dict[str, int]) -> processors.TemplateProcessing:
    prefix = f"{special.bos} " if special.bos is not None else ""
    single = f"{prefix}$A {special.eos}"
    used = [t for t in (special.bos, special.eos) if t is not None]
    return processors.TemplateProcessing(
        single=single,
        pair=f"{single} $B:1 {special.eos}:1",
        special_tokens=[(t, ids[t]) for t in used],
    )


def build_backend(kind: str, words: tuple[str, ...] = ()) -> Tokenizer:
    """The `tokenizers` object: byte-level BPE with the special tokens of `kind` (and `words` as
    single tokens)."""
    special = KINDS[kind]
    merges = word_merges(words)
    vocab = byte_vocab(merges)
    for token in special.in_order():
        vocab[token] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=special.unk))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(special.in_order())
    if special.wraps:
        backend.post_processor = _post_processor(special, vocab)
    return backend


def build_tokenizer(max_length: int, kind: str = "clip", words: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """A drop-in tokenizer for a diffusers pipeline's CLIP (`kind="clip"`), T5 (`"t5"`) or Qwen
    (`"qwen"`) slot.

    `max_length` becomes `model_max_length`, which the pipelines pad and truncate prompts to;
    each of `words` is one token (any other text still tokenizes, byte by byte at worst).
    """
    if kind not in KINDS:
        raise ValueError(f"unknown tokenizer kind {kind!r}; expected one of {sorted(KINDS)}")
    special = KINDS[kind]
    return PreTrainedTokenizerFast(
        tokenizer_object=build_backend(kind, words),
        bos_token=special.bos,
        eos_token=special.eos,
        additional_special_tokens=list(special.extra),
        pad_token=special.pad,
        unk_token=special.unk,
        model_max_length=max_length,
        padding_side="right",
        truncation_side="right",
    )
