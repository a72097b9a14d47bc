"""The shapes family: small diffusers models trained here (`gouache train`) on the procedural
shapes dataset (`gouache.data.shapes`), so their pictures can be checked by a program.

This module holds what training and serving must agree on: the architectures, the tokenizer, the
weight files. The pipelines that put them together are in `zoo.py`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKL, FluxTransformer2DModel, SD3Transformer2DModel, UNet2DConditionModel
from safetensors import safe_open
from safetensors.torch import save
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    PreTrainedTokenizerFast,
    T5Config,
    T5EncoderModel,
)

from gouache.data.edits import EDIT_WORDS
from gouache.data.shapes import WORDS
from gouache.files import write_atomic
from gouache.models.tokenizer import build_tokenizer

WEIGHTS_DIR = Path(__file__).resolve().parent.parent / "weights"
SIZE = 128  # default pixels per side; trained on 64..128, square and not
TRAIN_SIZES: tuple[tuple[int, int], ...] = ((64, 64), (96, 96), (128, 128), (128, 64), (64, 128), (128, 96), (96, 128))
# What the shapes UNets predict: the velocity, whose loss weighs the noisiest steps (where the
# layout is decided) far more than the noise's loss does (v_prediction learnt colour 2.4x as
# often in the same 7 minutes of training; docs/models.md).
UNET_PREDICTION = "v_prediction"
# The shapes generators' default guidance scale, UNets and DiT: the pipelines' own (SD1.5's 7.5,
# SD3's 7) oversaturate and misplace, and the DiT draws the asked kind less often (docs/models.md).
GUIDANCE = 3.0
TEXT_LENGTH = 32  # tokens; the longest caption (three shapes) is 28 with <bos> and <eos>
TEXT_HIDDEN = 64
EDIT_TEXT_LENGTH = 16  # tokens of an instruction; the longest ("move the purple triangle to the bottom right") is 10
# How each component's weights are stored: fp16 halves the repository's bytes; they load as fp32.
STORED_DTYPE = torch.float16


def tokenizer() -> PreTrainedTokenizerFast:
    """CLIP-style byte-level BPE in which every caption word is one token."""
    return build_tokenizer(TEXT_LENGTH, "clip", WORDS)


def text_encoder(with_projection: bool, layers: int) -> CLIPTextModel:
    """A CLIP text encoder over `tokenizer()`. SD3 reads the penultimate layer, so its has 3 layers."""
    tok = tokenizer()
    config = CLIPTextConfig(
        vocab_size=len(tok), hidden_size=TEXT_HIDDEN, intermediate_size=2 * TEXT_HIDDEN,
        projection_dim=TEXT_HIDDEN, num_hidden_layers=layers, num_attention_heads=4,
        max_position_embeddings=TEXT_LENGTH,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    return (CLIPTextModelWithProjection if with_projection else CLIPTextModel)(config)


def vae() -> AutoencoderKL:
    """4 latent channels at 1/8 of the pixels, as SD's; narrow at full resolution, where it is costly.

    `scaling_factor` and `shift_factor` are set after training from the latents' statistics."""
    return AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(16, 32, 64, 64), layers_per_block=1, norm_num_groups=8,
        latent_channels=4, sample_size=SIZE, scaling_factor=1.0, shift_factor=0.0,
        force_upcast=False,
    )


def unet(in_channels: int = 4) -> UNet2DConditionModel:
    """SD1.5's layout at 1/10 the width: 16x16 latents at 128 px, cross-attention at 1/2 and 1/4."""
    return UNet2DConditionModel(
        sample_size=SIZE // 8, in_channels=in_channels, out_channels=4,
        block_out_channels=(32, 64, 64), layers_per_block=1, norm_num_groups=8,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=TEXT_HIDDEN,
        attention_head_dim=4,  # diffusers' legacy name for the number of heads
    )


def dit() -> SD3Transformer2DModel:
    """An SD3 MMDiT on the same 4-channel latents: one token per 2x2 latent patch (64 at 128 px)."""
    return SD3Transformer2DModel(
        sample_size=SIZE // 8, patch_size=2, in_channels=4, out_channels=4, num_layers=4,
        attention_head_dim=32, num_attention_heads=4,
        joint_attention_dim=2 * TEXT_HIDDEN,  # the two CLIP slots' states, concatenated
        caption_projection_dim=128,  # heads * head_dim
        pooled_projection_dim=2 * TEXT_HIDDEN,
        pos_embed_max_size=16,  # patches per side: up to 256 px
    )


def edit_tokenizer(kind: str) -> PreTrainedTokenizerFast:
    """shapes-edit's CLIP (`kind="clip"`) or T5 (`"t5"`) tokenizer, in which every instruction word is
    one token; its `model_max_length` is the T5 length the model was trained at, which the Flux
    family pads prompts to (FLUX.1's own is 512)."""
    return build_tokenizer(EDIT_TEXT_LENGTH, kind, EDIT_WORDS)


def edit_text_encoders() -> tuple[CLIPTextModel, T5EncoderModel]:
    """shapes-edit's CLIP (pooled: the transformer's `pooled_projections`) and T5 (its text tokens),
    2 layers each, TEXT_HIDDEN wide."""
    clip = edit_tokenizer("clip")
    t5 = edit_tokenizer("t5")
    clip_config = CLIPTextConfig(
        vocab_size=len(clip), hidden_size=TEXT_HIDDEN, intermediate_size=2 * TEXT_HIDDEN,
        projection_dim=TEXT_HIDDEN, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=EDIT_TEXT_LENGTH,
        bos_token_id=clip.bos_token_id, eos_token_id=clip.eos_token_id, pad_token_id=clip.pad_token_id,
    )
    t5_config = T5Config(
        vocab_size=len(t5), d_model=TEXT_HIDDEN, d_kv=16, d_ff=2 * TEXT_HIDDEN, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=EDIT_TEXT_LENGTH,
        feed_forward_proj="gated-gelu", is_encoder_decoder=False,
        pad_token_id=t5.pad_token_id, eos_token_id=t5.eos_token_id, decoder_start_token_id=t5.pad_token_id,
    )
    return CLIPTextModel(clip_config), T5EncoderModel(t5_config)


def edit_transformer() -> FluxTransformer2DModel:
    """FLUX.1 Kontext's transformer on the shapes VAE's 4-channel latents (packed 2x2: 16 per
    token): 2 double-stream and 4 single-stream blocks, width 128; no guidance embedding (the
    model is not guidance-distilled: it samples once per step, without CFG)."""
    return FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=4, attention_head_dim=32,
        num_attention_heads=4, joint_attention_dim=TEXT_HIDDEN, pooled_projection_dim=TEXT_HIDDEN,
        guidance_embeds=False, axes_dims_rope=(8, 12, 12),
    )


def weights_path(name: str, directory: Path = WEIGHTS_DIR) -> Path:
    return directory / f"{name}.safetensors"


def save_weights(
    components: dict[str, torch.nn.Module], name: str, directory: Path = WEIGHTS_DIR,
    metadata: dict[str, str] | None = None,
) -> Path:
    """Store the components' weights in one `<directory>/<name>.safetensors`, keys prefixed by
    component, in STORED_DTYPE; `metadata` (strings) rides along in the file's header."""
    directory.mkdir(parents=True, exist_ok=True)
    state = {
        f"{component}.{key}": value.detach().to("cpu", STORED_DTYPE).contiguous()
        for component, module in components.items()
        for key, value in module.state_dict().items()
    }
    path = weights_path(name, directory)
    write_atomic(path, save(state, metadata=metadata))
    return path


def load_weights(components: dict[str, torch.nn.Module], name: str, directory: Path = WEIGHTS_DIR) -> dict[str, str]:
    """Fill the components (built by this module's constructors) from `save_weights`'s file, in
    fp32 and in eval mode; returns the file's metadata."""
    path = weights_path(name, directory)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; `gouache train` writes it")
    with safe_open(str(path), "pt") as file:
        metadata = file.metadata() or {}
        state = {key: file.get_tensor(key).float() for key in file.keys()}
    for component, module in components.items():
        prefix = f"{component}."
        module.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}, strict=True)
        module.eval()
    return metadata


def load_unet(directory: Path = WEIGHTS_DIR) -> tuple[UNet2DConditionModel, CLIPTextModel]:
    """The trained shapes UNet and its text encoder."""
    model, encoder = unet(), text_encoder(with_projection=False, layers=2)
    load_weights({"unet": model, "text_encoder": encoder}, "shapes-unet", directory)
    return model, encoder


def load_edit(directory: Path = WEIGHTS_DIR) -> tuple[FluxTransformer2DModel, CLIPTextModel, T5EncoderModel]:
    """The trained shapes-edit transformer and its two text encoders."""
    transformer, (clip, t5) = edit_transformer(), edit_text_encoders()
    load_weights({"transformer": transformer, "text_encoder": clip, "text_encoder_2": t5}, "shapes-edit", directory)
    return transformer, clip, t5


def load_vae(directory: Path = WEIGHTS_DIR) -> AutoencoderKL:
    """The trained VAE with the latent scale and shift measured after its training."""
    model = vae()
    metadata = load_weights({"vae": model}, "shapes-vae", directory)
    model.register_to_config(
        scaling_factor=float(metadata["scaling_factor"]), shift_factor=float(metadata["shift_factor"])
    )
    return model
