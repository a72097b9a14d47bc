"""The tiny Wan built-ins: Wan 2.1's text-to-video pipeline (a DiT over 1x2x2 patches of a causal 3D
VAE's latents, 3D RoPE over frames, rows and columns, cross-attention to a UMT5 encoder's 512
states, UniPC over flow-matching sigmas) and its image-to-video one (the first frame's VAE latents
and a mask beside the noise, a CLIP vision encoder's states of it attended beside the text)
shrunk to toy size, seeded random weights, tokenizer built in code."""

from __future__ import annotations

from diffusers import (
    AutoencoderKLWan,
    UniPCMultistepScheduler,
    WanImageToVideoPipeline,
    WanPipeline,
    WanTransformer3DModel,
)
from transformers import (
    CLIPImageProcessor,
    CLIPVisionConfig,
    CLIPVisionModel,
    PreTrainedTokenizerFast,
    UMT5Config,
    UMT5EncoderModel,
)

from gouache.models.seeds import SEED_DENOISER, SEED_IMAGE, SEED_TEXT, SEED_VAE, seeded
from gouache.models.tokenizer import build_tokenizer

WAN_TEXT_LENGTH = 512  # WanPipeline pads every prompt's states to this (its max_sequence_length)
WAN_TEXT_HIDDEN = 32  # the tiny UMT5's width: the transformer's text_dim
WAN_FLOW_SHIFT = 3.0  # Wan 2.1's published shift at 480p (5.0 at 720p)
WAN_IMAGE_HIDDEN = 32  # the tiny CLIP vision encoder's width: the image-to-video transformer's image_dim
WAN_IMAGE_SIDE = 32  # pixels a side the CLIP encoder reads (Wan 2.1's ViT-H/14 reads 224)


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


def tiny_wan_transformer(image_to_video: bool = False) -> WanTransformer3DModel:
    """Wan 2.1's transformer at width 64; `image_to_video`: the I2V one's, whose input is the noise
    beside a 4-channel mask and the first frame's 16 latent channels, and whose cross-attention
    attends to the CLIP states through projections of their own (added_kv_proj_dim)."""
    image = {"in_channels": 36, "image_dim": WAN_IMAGE_HIDDEN, "added_kv_proj_dim": 64} if image_to_video else {}
    return seeded(SEED_DENOISER, lambda: WanTransformer3DModel(**{
        "patch_size": (1, 2, 2), "in_channels": 16, "out_channels": 16,
        "num_attention_heads": 2, "attention_head_dim": 32,  # RoPE: 12 channels for frames, 10 each for rows, columns
        "text_dim": WAN_TEXT_HIDDEN, "freq_dim": 256, "ffn_dim": 64, "num_layers": 2, "cross_attn_norm": True,
        "qk_norm": "rms_norm_across_heads", "eps": 1e-6, **image,
    }).eval())


def clip_image_encoder(seed: int) -> tuple[CLIPVisionModel, CLIPImageProcessor]:
    """A 2-layer CLIP vision transformer over 8x8 patches of a 32x32 picture (16 patches and the
    class token: 17 states, where Wan's ViT-H/14 makes 257) and its processor (resize the short
    side, centre-crop, CLIP's normalisation)."""
    config = CLIPVisionConfig(hidden_size=WAN_IMAGE_HIDDEN, intermediate_size=2 * WAN_IMAGE_HIDDEN,
                              num_hidden_layers=2, num_attention_heads=2, image_size=WAN_IMAGE_SIDE, patch_size=8,
                              projection_dim=WAN_IMAGE_HIDDEN)
    processor = CLIPImageProcessor(size={"shortest_edge": WAN_IMAGE_SIDE},
                                   crop_size={"height": WAN_IMAGE_SIDE, "width": WAN_IMAGE_SIDE})
    return seeded(seed, lambda: CLIPVisionModel(config).eval()), processor


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


def build_tiny_wan_i2v() -> WanImageToVideoPipeline:
    text_encoder, tokenizer = umt5_text_encoder(SEED_TEXT)
    image_encoder, image_processor = clip_image_encoder(SEED_IMAGE)
    return WanImageToVideoPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=tiny_wan_vae(),
                                   scheduler=wan_scheduler(), image_processor=image_processor,
                                   image_encoder=image_encoder, transformer=tiny_wan_transformer(image_to_video=True))
