"""The tiny Z-Image built-in: Z-Image's pipeline (a single-stream DiT over 2x2 latent patches that
takes a list of images and prompts of any sizes, a Qwen3 text encoder, FLUX.1's 16-channel VAE)
shrunk to toy size, seeded random weights, tokenizer and chat template built in code."""

from __future__ import annotations

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3Model

from gouache.models.seeds import SEED_DENOISER, SEED_TEXT, seeded
from gouache.models.tokenizer import build_tokenizer

QWEN3_HIDDEN = 32  # the tiny Qwen3's width: the transformer's cap_feat_dim
MAX_TEXT = 512  # the pipeline pads prompts to max_sequence_length (512) before keeping the real tokens
# Qwen3's chat template as the pipeline applies it (one user turn, the assistant's turn opened;
# with thinking enabled Qwen3 adds nothing more)
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def qwen3_text_encoder(seed: int, hidden: int = QWEN3_HIDDEN) -> tuple[Qwen3Model, PreTrainedTokenizerFast]:
    """A 2-layer Qwen3 and its tokenizer (Qwen's special tokens, the chat template), ids matching."""
    tok = build_tokenizer(MAX_TEXT, "qwen", ("user", "assistant"))
    tok.chat_template = CHAT_TEMPLATE
    ids = tok.convert_tokens_to_ids
    config = Qwen3Config(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=1024,
        bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"), pad_token_id=ids("<|endoftext|>"),
    )
    return seeded(seed, lambda: Qwen3Model(config).eval()), tok


def tiny_zimage_transformer() -> ZImageTransformer2DModel:
    def build() -> ZImageTransformer2DModel:
        net = ZImageTransformer2DModel(
            all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=64, n_layers=2, n_refiner_layers=1,
            n_heads=2, n_kv_heads=2, cap_feat_dim=QWEN3_HIDDEN,
            axes_dims=[8, 12, 12],  # must sum to dim / n_heads
            axes_lens=[1024, 128, 128],  # text positions; up to 128 tokens (2048 px) a side
        ).eval()
        for token in (net.x_pad_token, net.cap_pad_token):  # built as zeros; trained ones are not
            torch.nn.init.normal_(token.data)
        return net

    return seeded(SEED_DENOISER, build)


def build_tiny_zimage(vae) -> ZImagePipeline:
    """Z-Image around `vae` (FLUX.1's layout: the zoo's tiny one), with Z-Image-Turbo's schedule
    (a fixed shift of 3)."""
    text_encoder, tokenizer = qwen3_text_encoder(SEED_TEXT)
    return ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False),
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=tiny_zimage_transformer(),
    )
