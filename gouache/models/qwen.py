"""Qwen text encoders at toy size (Qwen2.5-VL with its image processor, Qwen3), tokenizers and chat
template built in code, and the tiny Qwen-Image built-ins: Qwen-Image's pipelines (MMDiT over
packed 2x2 latents, the 3D causal VAE of one frame; Edit and Edit-Plus) shrunk to toy size,
seeded random weights."""

from __future__ import annotations

from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImageEditPipeline,
    QwenImageEditPlusPipeline,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from transformers import (
    PreTrainedModel,
    PreTrainedTokenizerFast,
    ProcessorMixin,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLProcessor,
    Qwen3Config,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from gouache.models.seeds import SEED_DENOISER, SEED_TEXT, SEED_VAE, seeded
from gouache.models.tokenizer import build_tokenizer

QWEN_HIDDEN = 32  # the tiny Qwen2.5-VL's text width: the transformer's joint_attention_dim
# The pipelines drop the hidden states of their prompt template's prefix (34 tokens of Qwen's own
# tokenizer: QwenImagePipeline.prompt_template_encode_start_idx; 64 for the edit pipelines). With
# these words one token each, the built tokenizer splits each prefix into as many tokens, so only
# the prompt's (and the uploads') remain.
TEMPLATE_WORDS = ("system", "Describe", "the", "image", "by", "detailing", "color", "shape", "size", "texture",
                  "quantity", "text", "spatial", "relationships", "of", "objects", "and", "background", "user",
                  "assistant",
                  # the edit pipelines' prefix (64 tokens of Qwen's tokenizer)
                  "key", "features", "input", "then", "explain", "how", "instruction", "should", "alter", "or",
                  "modify", "Generate", "a", "new", "that", "meets", "requirements", "while", "maintaining",
                  "consistency", "with", "original", "where", "appropriate", "'s", "(", "),")
MAX_TEMPLATE_TOKENS = 1024 + 64  # the pipelines truncate prompts at 1024 tokens after the prefix


class QwenVLProcessor(Qwen2VLProcessor):
    """Qwen2-VL's processor of image prompts (each `<|image_pad|>` expanded to the image's merged
    patches) without its video processor, which transformers builds only with torchvision (not
    installable beside this project's CPU build of torch); the Qwen-Image-Edit pipelines send
    images only. Saved and loaded as a pipeline component like any processor."""

    # diffusers loads a component of a library it does not know with the loader of a base class it
    # knows, looked up by name in the component's module: this module's `ProcessorMixin`
    loader_base = ProcessorMixin

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


def qwen_text_encoder(seed: int, hidden: int = QWEN_HIDDEN
                      ) -> tuple[Qwen2_5_VLForConditionalGeneration, PreTrainedTokenizerFast]:
    """A 2-layer Qwen2.5-VL (a 1-block vision tower, for the edit pipelines' image prompts) and
    its tokenizer, with matching special-token ids."""
    tok = build_tokenizer(MAX_TEMPLATE_TOKENS, "qwen", TEMPLATE_WORDS)
    ids = tok.convert_tokens_to_ids
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
            rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},  # halves of head_dim 8: t, h, w
            bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"), pad_token_id=ids("<|endoftext|>"),
        ),
        vision_config=dict(
            depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=hidden, patch_size=14,
            spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[0], window_size=56,
        ),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
    )
    return seeded(seed, lambda: Qwen2_5_VLForConditionalGeneration(config).eval()), tok


QWEN3_HIDDEN = 32  # the tiny Qwen3's width (Z-Image's cap_feat_dim; FLUX.2 stacks three of its layers)
QWEN3_LAYERS = 27  # FLUX.2 [klein] reads hidden states 9, 18 and 27
MAX_TEXT = 512  # Z-Image and FLUX.2 pad prompts to max_sequence_length (512)
# Qwen3's chat template as the pipelines apply it: one user turn and the assistant's opened;
# with thinking off (FLUX.2) an empty thinking block follows, as Qwen3's own template writes it
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
                 "{% endif %}")


def qwen3_text_encoder(seed: int, cls: type[PreTrainedModel], hidden: int = QWEN3_HIDDEN
                       ) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """A Qwen3 (`cls`: Qwen3Model, Qwen3ForCausalLM) of QWEN3_LAYERS layers `hidden` wide and its
    tokenizer (Qwen's special tokens, the chat template), ids matching."""
    tok = build_tokenizer(MAX_TEXT, "qwen", ("user", "assistant"))
    tok.chat_template = CHAT_TEMPLATE
    ids = tok.convert_tokens_to_ids
    config = Qwen3Config(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=QWEN3_LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=1024,
        bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"), pad_token_id=ids("<|endoftext|>"),
        tie_word_embeddings=True,
    )
    return seeded(seed, lambda: cls(config).eval()), tok


def tiny_qwen_vae() -> AutoencoderKLQwenImage:
    """Qwen-Image's VAE layout (16 latent channels, an eighth of the image a side, the published
    per-channel latent mean and std) at a base width of 4: the edit models encode every upload at
    a megapixel (1.2 s on this CPU, 2.1 s at width 8)."""
    return seeded(SEED_VAE, lambda: AutoencoderKLQwenImage(
        base_dim=4, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1, attn_scales=[],
        temperal_downsample=[False, True, True],
    ).eval())


def qwen_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """Qwen-Image's published schedule: exponential shift growing with the image's tokens, stretched
    to end at 0.02."""
    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
        base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential",
    )


def tiny_qwen_transformer() -> QwenImageTransformer2DModel:
    return seeded(SEED_DENOISER, lambda: QwenImageTransformer2DModel(
        patch_size=2, in_channels=64, out_channels=16,  # 16 latent channels packed 2x2
        num_layers=2, attention_head_dim=32, num_attention_heads=2, joint_attention_dim=QWEN_HIDDEN,
        axes_dims_rope=(8, 12, 12),  # must sum to attention_head_dim
    ).eval())


def tiny_qwen_processor(tokenizer: PreTrainedTokenizerFast) -> QwenVLProcessor:
    """The VL encoder's image inputs at 56-112 px a side (4-16 merged tokens): toy size."""
    return QwenVLProcessor(image_processor=Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112),
                           tokenizer=tokenizer)


def build_tiny_qwen_image_edit(plus: bool = False) -> QwenImageEditPipeline | QwenImageEditPlusPipeline:
    """tiny-qwen-image's components in Qwen-Image-Edit's pipeline (with `plus`, Edit-Plus's)."""
    text_encoder, tokenizer = qwen_text_encoder(SEED_TEXT)
    return (QwenImageEditPlusPipeline if plus else QwenImageEditPipeline)(
        scheduler=qwen_scheduler(), vae=tiny_qwen_vae(), text_encoder=text_encoder, tokenizer=tokenizer,
        processor=tiny_qwen_processor(tokenizer), transformer=tiny_qwen_transformer())


def build_tiny_qwen_image() -> QwenImagePipeline:
    text_encoder, tokenizer = qwen_text_encoder(SEED_TEXT)
    return QwenImagePipeline(scheduler=qwen_scheduler(), vae=tiny_qwen_vae(), text_encoder=text_encoder,
                             tokenizer=tokenizer, transformer=tiny_qwen_transformer())
