"""The tiny FLUX.2 [klein] built-in: Flux2KleinPipeline (an MMDiT over 2x2-patchified 32-channel
latents with 4-axis RoPE, a Qwen3 text encoder whose hidden states 9, 18 and 27 are stacked, a VAE
with batch-norm latent statistics) shrunk to toy size, seeded random weights. It takes reference
images: an edit's uploads enter as reference tokens (instruction edits of one or more images)."""

from __future__ import annotations

from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Transformer2DModel
from transformers import Qwen3ForCausalLM

from gouache.models.qwen import QWEN3_HIDDEN, qwen3_text_encoder
from gouache.models.seeds import SEED_DENOISER, SEED_TEXT, SEED_VAE, seeded

KLEIN_LAYERS = 3  # hidden states of the text encoder the pipeline stacks (9, 18, 27)


def tiny_flux2_vae() -> AutoencoderKLFlux2:
    """FLUX.2's VAE layout (32 latent channels, an eighth of the image a side) at toy width, its
    batch-norm statistics drawn (built as 0 and 1, as no trained VAE has them)."""
    def build() -> AutoencoderKLFlux2:
        vae = AutoencoderKLFlux2(block_out_channels=(8, 16, 16, 16), layers_per_block=1, latent_channels=32,
                                 norm_num_groups=8, sample_size=256).eval()
        vae.bn.running_mean.normal_(0.0, 0.5)
        vae.bn.running_var.uniform_(0.5, 2.0)
        return vae

    return seeded(SEED_VAE, build)


def build_tiny_flux2_klein() -> Flux2KleinPipeline:
    """FLUX.2 [klein] base (not step-distilled: CFG with an empty negative prompt) at toy size."""
    text_encoder, tokenizer = qwen3_text_encoder(SEED_TEXT, Qwen3ForCausalLM)
    transformer = seeded(SEED_DENOISER, lambda: Flux2Transformer2DModel(
        patch_size=1, in_channels=128,  # 32 latent channels patchified 2x2
        num_layers=1, num_single_layers=2, attention_head_dim=32, num_attention_heads=2,
        joint_attention_dim=KLEIN_LAYERS * QWEN3_HIDDEN, axes_dims_rope=(8, 8, 8, 8),  # must sum to the head dim
        guidance_embeds=False,
    ).eval())
    scheduler = FlowMatchEulerDiscreteScheduler(  # FLUX.2's: the shift (mu) from the image's tokens and steps
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096, time_shift_type="exponential",
    )
    return Flux2KleinPipeline(scheduler=scheduler, vae=tiny_flux2_vae(), text_encoder=text_encoder,
                              tokenizer=tokenizer, transformer=transformer, is_distilled=False)
