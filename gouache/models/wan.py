"""The tiny Wan built-in: Wan 2.1's text-to-video pipeline (a DiT over 1x2x2 patches of a causal 3D
VAE's latents, 3D RoPE over frames, rows and columns, cross-attention to a UMT5 encoder's 512
states, UniPC over flow-matching sigmas) shrunk to toy size, seeded random weights, tokenizer
built in code."""

from __future__ import annotations

from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

from gouache.models.seeds import SEED_DENOISER, SEED_TEXT, SEED_VAE, seeded
from gouache.models.tokenizer import build_tokenizer

WAN_TEXT_LENGTH = 512  # WanPipeline pads every prompt's states to this (its max_sequence_length)
WAN_TEXT_HIDDEN = 32  # the tiny UMT5's width: the transformer's text_dim
WAN_FLOW_SHIFT = 3.0  # Wan 2.1's published shift at 480p (5.0 at 720p)


def umt5_text_encoder(seed: int, hidden: int = WAN_TEXT_HIDDEN) -> tuple[UMT5EncoderModel, PreTrainedTokenizerFast]:
    """A 2-layer UMT5 encoder (gated GELU, relative positions per layer), `hidden` wide, and its
    tokenizer, ids matching."""
    tok = build_tokenizer(WAN_TEXT_LENGTH, "t5")
    config = UMT5Config(
        vocab_size=len(tok), d_model=hidden, d_kv=8, d_ff=2 * hidden, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=32, feed_forward_proj="gated-gelu",
        is_encoder_decoder=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        decoder_start_token_id=tok.pad_token_id,
    )
    return seeded(seed, lambda: UMT5EncoderModel(config).eval()), tok


def tiny_wan_transformer() -> WanTransformer3DModel:
    return seeded(SEED_DENOISER, lambda: WanTransformer3DModel(
        patch_size=(1, 2, 2), in_channels=16, out_channels=16,
        num_attention_heads=2, attention_head_dim=32,  # RoPE: 12 channels for frames, 10 each for rows, columns
        text_dim=WAN_TEXT_HIDDEN, freq_dim=256, ffn_dim=64, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6,
    ).eval())


def tiny_wan_vae() -> AutoencoderKLWan:
    """Wan 2.1's VAE layout (16 latent channels, an eighth of a frame a side, a quarter of the
    frames after the first, the published per-channel latent mean and std) at a base width of 4."""
    return seeded(SEED_VAE, lambda: AutoencoderKLWan(
        base_dim=4, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1, attn_scales=[],
        temperal_downsample=[False, True, True],
    ).eval())


def wan_scheduler() -> UniPCMultistepScheduler:
    """Wan 2.1's published sampler: UniPC (order 2, predicting x0) over flow-matching sigmas
    shifted by WAN_FLOW_SHIFT."""
    return UniPCMultistepScheduler(
        num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=WAN_FLOW_SHIFT,
        solver_order=2, predict_x0=True, solver_type="bh2", lower_order_final=True, final_sigmas_type="zero",
    )


def build_tiny_wan() -> WanPipeline:
    text_encoder, tokenizer = umt5_text_encoder(SEED_TEXT)
    return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=tiny_wan_vae(),
                       scheduler=wan_scheduler(), transformer=tiny_wan_transformer())
