"""The model zoo: tiny built-in pipelines, local diffusers directories, full-size architectures.

The tiny built-ins are real diffusers pipelines (SD1.5, SDXL, SD3, Flux, FLUX.1 Kontext,
Qwen-Image and its Edit and Edit-Plus, Z-Image, FLUX.2 [klein] and two inpainting variants) with
the published architectures shrunk to a few thousand parameters per layer and seeded random
weights. They need no network, build in a fraction of a second, run a 512x512 CFG denoiser step
on two CPU cores in about 0.2 s, and are bit-identical in every process, which is what tests,
the simulator and multi-process runners rely on.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from diffusers import (
    AutoencoderKL,
    DiffusionPipeline,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    FluxKontextPipeline,
    FluxPipeline,
    FluxTransformer2DModel,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
    StableDiffusionInpaintPipeline,
    StableDiffusionPipeline,
    StableDiffusionXLInpaintPipeline,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    PreTrainedTokenizerFast,
    T5Config,
    T5EncoderModel,
)

from gouache.errors import UnknownModelError
from gouache.models import trained
from gouache.models.arch import ARCH_CONFIGS, build_arch, default_dtype
from gouache.models.flux2 import build_tiny_flux2_klein
from gouache.models.qwen import QwenVLProcessor, build_tiny_qwen_image, build_tiny_qwen_image_edit
from gouache.models.seeds import (
    SEED_DENOISER,
    SEED_TEXT,
    SEED_TEXT_2,
    SEED_TEXT_3,
    SEED_VAE,
    seeded,
    torch_dtype,
)
from gouache.models.tokenizer import build_tokenizer
from gouache.models.wan import build_tiny_wan, build_tiny_wan_i2v
from gouache.models.zimage import build_tiny_zimage

CLIP_MAX_LENGTH = 77  # CLIP's context, which the SD pipelines pad every prompt to
T5_MAX_LENGTH = 512  # FLUX.1's T5 tokenizer's length, which the Flux family pads prompts to (SD3 pads to its 256)
TEXT_HIDDEN = 32  # hidden size of every tiny CLIP text encoder (and its projection)
T5_HIDDEN = 64  # d_model of the tiny T5: SD3 pads the two CLIPs' concatenated states to it
VL_PROCESSORS = ("Qwen2VLProcessor", "Qwen2_5_VLProcessor")  # the processors Qwen-Image-Edit directories name

TINY_DEFAULT_SIZE = 256  # pixels per side: small enough for CPU tests at full pipeline speed
TINY_DEFAULT_STEPS = 20  # every built-in's default step count


@dataclass(frozen=True)
class BuiltinSpec:
    """What `gouache models` lists about a built-in model."""

    family: str  # sd | sdxl | sd3 | flux | qwenimage | zimage | flux2 | wan
    description: str  # one line for humans
    default_size: int = TINY_DEFAULT_SIZE  # pixels per side of a request without `size`
    default_guidance: float | None = None  # a request's guidance scale when it gives none; None: the family's
    generation: bool = True  # makes images from text alone; False: only edits (its pipeline may generate)


BUILTIN_MODELS: dict[str, BuiltinSpec] = {
    "tiny-sd": BuiltinSpec("sd", "SD1.5-style UNet, CLIP text encoder, Euler; random weights"),
    "tiny-sdxl": BuiltinSpec("sdxl", "SDXL-style UNet with text_time conditioning, two CLIPs"),
    "tiny-sd3": BuiltinSpec("sd3", "SD3 MMDiT, two CLIPs + T5, flow matching (shift 3.0)"),
    "tiny-flux": BuiltinSpec("flux", "FLUX.1-dev-style transformer, guidance-distilled, CLIP + T5"),
    "tiny-flux-kontext": BuiltinSpec("flux", "tiny-flux in FLUX.1 Kontext's pipeline: edits without a mask follow "
                                             "the prompt (instruction edits)"),
    "tiny-qwen-image": BuiltinSpec("qwenimage", "Qwen-Image-style MMDiT, Qwen2.5-VL text encoder, 3D VAE, true CFG"),
    "tiny-qwen-image-edit": BuiltinSpec("qwenimage", "tiny-qwen-image in Qwen-Image-Edit's pipeline: edits follow "
                                                      "the prompt, the upload read by the VL encoder and as reference "
                                                      "tokens; no generations"),
    "tiny-qwen-image-edit-plus": BuiltinSpec("qwenimage", "tiny-qwen-image in Qwen-Image-Edit-Plus's pipeline: "
                                                           "instruction edits of up to 3 images; no generations"),
    "tiny-zimage": BuiltinSpec("zimage", "Z-Image-style single-stream DiT over a list of sizes, Qwen3 text encoder"),
    "tiny-flux2-klein": BuiltinSpec("flux2", "FLUX.2 [klein]-style MMDiT, Qwen3 text encoder; edits take up to "
                                             "4 images as references (instruction edits)"),
    "tiny-wan": BuiltinSpec("wan", "Wan 2.1-style text-to-video DiT (3D RoPE over frames), UMT5 text encoder, "
                                   "causal 3D VAE, UniPC; clips through /v1/videos", default_size=128),
    "tiny-wan-i2v": BuiltinSpec("wan", "tiny-wan in Wan 2.1's image-to-video pipeline: a clip from its first frame "
                                       "(input_reference), a CLIP vision encoder's states attended beside the text",
                                default_size=128),
    "tiny-sd-inpaint": BuiltinSpec("sd", "SD1.5-style inpainting pipeline, 9-channel UNet"),
    "tiny-sdxl-inpaint": BuiltinSpec("sdxl", "SDXL-style inpainting pipeline, 9-channel UNet"),
    "shapes-unet": BuiltinSpec(
        "sd", "SD1.5-style UNet trained here on coloured shapes (`gouache train unet`); 64-128 px",
        default_size=trained.SIZE, default_guidance=trained.GUIDANCE,
    ),
    "shapes-unet-inpaint": BuiltinSpec(
        "sd", "shapes-unet fine-tuned into a 9-channel inpainting UNet (`gouache train inpaint`)",
        default_size=trained.SIZE, default_guidance=trained.GUIDANCE,
    ),
    "shapes-dit": BuiltinSpec(
        "sd3", "SD3 MMDiT trained here on coloured shapes (`gouache train dit`); 64-128 px",
        default_size=trained.SIZE, default_guidance=trained.GUIDANCE,
    ),
    "shapes-edit": BuiltinSpec(
        "flux", "FLUX.1 Kontext-style transformer trained here on instruction edits of shapes (`gouache train "
                "edit`): \"make the red circle blue\"; 64-128 px; no generations",
        default_size=trained.SIZE, generation=False,
    ),
}

DEFAULT_STEPS = {"sd": 30, "sdxl": 30, "sd3": 28, "flux": 28, "qwenimage": 50, "zimage": 50, "flux2": 50, "wan": 50}
# the pipelines' defaults (Qwen-Image's is its true_cfg_scale)
DEFAULT_GUIDANCE = {"sd": 7.5, "sdxl": 5.0, "sd3": 7.0, "flux": 3.5, "qwenimage": 4.0, "zimage": 5.0, "flux2": 4.0,
                    "wan": 5.0}


# ---------------------------------------------------------------------------- seeded building


def clip_text_encoder(
    seed: int, with_projection: bool, hidden: int = TEXT_HIDDEN
) -> tuple[CLIPTextModel, PreTrainedTokenizerFast]:
    """A 2-layer CLIP text encoder (`hidden` wide, its projection too) and its tokenizer, with
    matching special-token ids.

    CLIP pools at the first `eos_token_id`, so the config's ids must be the tokenizer's.
    """
    tok = build_tokenizer(CLIP_MAX_LENGTH, "clip")
    config = CLIPTextConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
        projection_dim=hidden, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=CLIP_MAX_LENGTH,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    cls = CLIPTextModelWithProjection if with_projection else CLIPTextModel
    return seeded(seed, lambda: cls(config).eval()), tok


def t5_text_encoder(seed: int, hidden: int = T5_HIDDEN) -> tuple[T5EncoderModel, PreTrainedTokenizerFast]:
    """A 2-layer T5 v1.1-style (gated-GELU) encoder, `hidden` wide, and its tokenizer."""
    tok = build_tokenizer(T5_MAX_LENGTH, "t5")
    config = T5Config(
        vocab_size=len(tok), d_model=hidden, d_kv=16, d_ff=2 * hidden, num_layers=2,
        num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=32,
        feed_forward_proj="gated-gelu", is_encoder_decoder=False,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        decoder_start_token_id=tok.pad_token_id,
    )
    return seeded(seed, lambda: T5EncoderModel(config).eval()), tok


def tiny_vae(
    latent_channels: int, scaling_factor: float, shift_factor: float | None
) -> AutoencoderKL:
    """Four blocks: the latent is an eighth of the image a side, as in every real SD/Flux VAE."""
    # The 16-channel VAEs of SD3 and Flux have no quant convs; SD1.5/SDXL's 4-channel ones do.
    quant = latent_channels == 4
    return seeded(
        SEED_VAE,
        lambda: AutoencoderKL(
            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
            block_out_channels=(8, 16, 16, 16), layers_per_block=1, norm_num_groups=8,
            latent_channels=latent_channels, sample_size=TINY_DEFAULT_SIZE,
            scaling_factor=scaling_factor, shift_factor=shift_factor,
            use_quant_conv=quant, use_post_quant_conv=quant,
            force_upcast=False,  # random weights do not overflow in fp16; skip the fp32 copy
        ).eval(),
    )


def tiny_unet(in_channels: int, sdxl: bool) -> UNet2DConditionModel:
    """Two down blocks; attention only at the half-resolution level, where it is cheap."""
    extra = {}
    cross_attention_dim = TEXT_HIDDEN
    if sdxl:
        cross_attention_dim = 2 * TEXT_HIDDEN  # both CLIPs' hidden states, concatenated
        time_embed_dim = 8
        extra = dict(
            addition_embed_type="text_time",
            addition_time_embed_dim=time_embed_dim,
            # six micro-conditioning numbers (original size, crop, target size) + pooled text
            projection_class_embeddings_input_dim=6 * time_embed_dim + TEXT_HIDDEN,
            use_linear_projection=True,
        )
    return seeded(
        SEED_DENOISER,
        lambda: UNet2DConditionModel(
            sample_size=TINY_DEFAULT_SIZE // 8, in_channels=in_channels, out_channels=4,
            block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=8,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            cross_attention_dim=cross_attention_dim,
            attention_head_dim=2,  # diffusers' legacy name: 2 heads (of 32 channels)
            **extra,
        ).eval(),
    )


def euler_scheduler(prediction_type: str = "epsilon", zero_terminal_snr: bool = False) -> EulerDiscreteScheduler:
    """SD1.5's and SDXL's published noise schedule (the two configs agree on every value); the
    network predicts the noise ("epsilon", as theirs do) or the velocity ("v_prediction").

    `zero_terminal_snr` rescales the schedule so that its last step is pure noise and samples from
    the last step on ("trailing"), as Lin et al. (2024) propose: SD's own schedule leaves 7 % of the
    image in its noisiest latents, so a model trained on it reads the layout from the noise and
    not from the prompt."""
    return EulerDiscreteScheduler(
        num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
        beta_schedule="scaled_linear", prediction_type=prediction_type, steps_offset=1,
        timestep_spacing="trailing" if zero_terminal_snr else "leading", interpolation_type="linear",
        use_karras_sigmas=False, rescale_betas_zero_snr=zero_terminal_snr,
    )


def build_tiny_sd(inpaint: bool = False) -> DiffusionPipeline:
    text_encoder, tokenizer = clip_text_encoder(SEED_TEXT, with_projection=False)
    cls = StableDiffusionInpaintPipeline if inpaint else StableDiffusionPipeline
    return cls(
        vae=tiny_vae(4, scaling_factor=0.18215, shift_factor=None),
        text_encoder=text_encoder, tokenizer=tokenizer,
        unet=tiny_unet(9 if inpaint else 4, sdxl=False), scheduler=euler_scheduler(),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )


def build_tiny_sdxl(inpaint: bool = False) -> DiffusionPipeline:
    text_encoder, tokenizer = clip_text_encoder(SEED_TEXT, with_projection=False)
    text_encoder_2, tokenizer_2 = clip_text_encoder(SEED_TEXT_2, with_projection=True)
    cls = StableDiffusionXLInpaintPipeline if inpaint else StableDiffusionXLPipeline
    return cls(
        vae=tiny_vae(4, scaling_factor=0.13025, shift_factor=None),
        text_encoder=text_encoder, tokenizer=tokenizer,
        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
        unet=tiny_unet(9 if inpaint else 4, sdxl=True), scheduler=euler_scheduler(),
        add_watermarker=False,
    )


def build_tiny_sd3() -> DiffusionPipeline:
    text_encoder, tokenizer = clip_text_encoder(SEED_TEXT, with_projection=True)
    text_encoder_2, tokenizer_2 = clip_text_encoder(SEED_TEXT_2, with_projection=True)
    text_encoder_3, tokenizer_3 = t5_text_encoder(SEED_TEXT_3)
    transformer = seeded(
        SEED_DENOISER,
        lambda: SD3Transformer2DModel(
            sample_size=TINY_DEFAULT_SIZE // 8, patch_size=2, in_channels=16, out_channels=16,
            num_layers=2,
            attention_head_dim=32,  # CPU attention kernels are far faster at 32 than at 16
            num_attention_heads=2,
            joint_attention_dim=T5_HIDDEN,
            caption_projection_dim=64,  # must equal heads * head_dim
            pooled_projection_dim=2 * TEXT_HIDDEN,  # both CLIPs' projections, concatenated
            pos_embed_max_size=128,  # up to 2048 px per side
        ).eval(),
    )
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
        vae=tiny_vae(16, scaling_factor=1.5305, shift_factor=0.0609),
        text_encoder=text_encoder, tokenizer=tokenizer,
        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
        text_encoder_3=text_encoder_3, tokenizer_3=tokenizer_3,
    )


def build_tiny_flux(kontext: bool = False) -> DiffusionPipeline:
    """FLUX.1-dev's architecture at toy size; with `kontext`, in FLUX.1 Kontext's pipeline (the
    same transformer, which then also reads reference tokens: instruction edits)."""
    text_encoder, tokenizer = clip_text_encoder(SEED_TEXT, with_projection=False)
    text_encoder_2, tokenizer_2 = t5_text_encoder(SEED_TEXT_2)
    transformer = seeded(
        SEED_DENOISER,
        lambda: FluxTransformer2DModel(
            patch_size=1,
            in_channels=64,  # 16 latent channels packed 2x2
            num_layers=1, num_single_layers=2, attention_head_dim=32, num_attention_heads=2,
            joint_attention_dim=T5_HIDDEN,
            pooled_projection_dim=TEXT_HIDDEN,  # CLIPTextModel's pooled output
            guidance_embeds=True,
            axes_dims_rope=(8, 12, 12),  # must sum to attention_head_dim
        ).eval(),
    )
    scheduler = FlowMatchEulerDiscreteScheduler(  # FLUX.1-dev's: shift grows with image size
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
        base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096,
    )
    return (FluxKontextPipeline if kontext else FluxPipeline)(
        scheduler=scheduler, vae=tiny_vae(16, scaling_factor=0.3611, shift_factor=0.1159),
        text_encoder=text_encoder, tokenizer=tokenizer,
        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, transformer=transformer,
    )


def shapes_sd(vae: AutoencoderKL, text_encoder: CLIPTextModel, unet: UNet2DConditionModel) -> DiffusionPipeline:
    """A shapes UNet's pipeline around the given components (trained or in training): SD1.5's, or
    its inpainting one for a 9-channel UNet."""
    cls = StableDiffusionInpaintPipeline if unet.config.in_channels == 9 else StableDiffusionPipeline
    return cls(
        vae=vae, text_encoder=text_encoder, tokenizer=trained.tokenizer(), unet=unet,
        scheduler=euler_scheduler(trained.UNET_PREDICTION, zero_terminal_snr=True), safety_checker=None,
        feature_extractor=None, requires_safety_checker=False,
    )


def shapes_sd3(
    vae: AutoencoderKL, text_encoder: CLIPTextModelWithProjection, transformer: SD3Transformer2DModel
) -> StableDiffusion3Pipeline:
    """The shapes DiT's pipeline: one CLIP in both of SD3's CLIP slots and no T5 (the pipeline
    then appends zeros in its place)."""
    tokenizer = trained.tokenizer()
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
        text_encoder_2=text_encoder, tokenizer_2=tokenizer, text_encoder_3=None, tokenizer_3=None,
    )


def shapes_kontext(vae: AutoencoderKL, text_encoder: CLIPTextModel, text_encoder_2: T5EncoderModel,
                   transformer: FluxTransformer2DModel) -> FluxKontextPipeline:
    """The shapes edit model's pipeline: FLUX.1 Kontext's, its scheduler shifted by 3 at every size
    (as the model was trained), prompts padded to its tokenizers' length (pass the pipeline
    `max_sequence_length=trained.EDIT_TEXT_LENGTH`; gouache does)."""
    return FluxKontextPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
        vae=vae, text_encoder=text_encoder, tokenizer=trained.edit_tokenizer("clip"),
        text_encoder_2=text_encoder_2, tokenizer_2=trained.edit_tokenizer("t5"), transformer=transformer,
    )


def build_shapes_unet(in_channels: int = 4) -> DiffusionPipeline:
    """shapes-unet, or with 9 input channels shapes-unet-inpaint."""
    name = "shapes-unet-inpaint" if in_channels == 9 else "shapes-unet"
    unet, text_encoder = trained.unet(in_channels), trained.text_encoder(with_projection=False, layers=2)
    trained.load_weights({"unet": unet, "text_encoder": text_encoder}, name)
    return shapes_sd(trained.load_vae(), text_encoder, unet)


def build_shapes_dit() -> DiffusionPipeline:
    transformer, text_encoder = trained.dit(), trained.text_encoder(with_projection=True, layers=3)
    trained.load_weights({"transformer": transformer, "text_encoder": text_encoder}, "shapes-dit")
    return shapes_sd3(trained.load_vae(), text_encoder, transformer)


def build_shapes_edit() -> DiffusionPipeline:
    transformer, clip, t5 = trained.load_edit()
    return shapes_kontext(trained.load_vae(), clip, t5, transformer)


BUILDERS: dict[str, Callable[[], DiffusionPipeline]] = {
    "tiny-sd": build_tiny_sd,
    "tiny-sdxl": build_tiny_sdxl,
    "tiny-sd3": build_tiny_sd3,
    "tiny-flux": build_tiny_flux,
    "tiny-flux-kontext": lambda: build_tiny_flux(kontext=True),
    "tiny-qwen-image": build_tiny_qwen_image,
    "tiny-qwen-image-edit": build_tiny_qwen_image_edit,
    "tiny-qwen-image-edit-plus": lambda: build_tiny_qwen_image_edit(plus=True),
    "tiny-flux2-klein": build_tiny_flux2_klein,
    "tiny-zimage": lambda: build_tiny_zimage(tiny_vae(16, scaling_factor=0.3611, shift_factor=0.1159)),
    "tiny-wan": build_tiny_wan,
    "tiny-wan-i2v": build_tiny_wan_i2v,
    "tiny-sd-inpaint": lambda: build_tiny_sd(inpaint=True),
    "tiny-sdxl-inpaint": lambda: build_tiny_sdxl(inpaint=True),
    "shapes-unet": build_shapes_unet,
    "shapes-unet-inpaint": lambda: build_shapes_unet(in_channels=9),
    "shapes-dit": build_shapes_dit,
    "shapes-edit": build_shapes_edit,
}


# ----------------------------------------------------------- full-size architectures' pipelines


def arch_pipeline(name: str, dtype: str = "bfloat16", device: str = "cpu") -> DiffusionPipeline:
    """The full-size denoiser `name` in its own diffusers pipeline, so every technique of the
    runner (templates, adapters, the block cache, parallel workers) runs on it: the text
    encoders are 2-layer ones exactly as wide as the published ones (so the denoiser sees
    conditioning of the published shapes: SDXL's 77 tokens of 2048, SD3's 77 + 256 of 4096),
    the VAE the tiny one of the family's latent channels. What it draws is noise; what it costs
    per step is the published model's."""
    denoiser = build_arch(name, device, dtype)
    if name == "sdxl-arch":
        scheduler = euler_scheduler()
    elif name == "sd3-arch":
        scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    else:
        scheduler = FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
            base_image_seq_len=256, max_image_seq_len=4096)
    with torch.device(device), default_dtype(torch_dtype(dtype)):  # the small parts built in dtype, there
        return _pipeline_around(name, denoiser, scheduler)


def _pipeline_around(name: str, denoiser: torch.nn.Module, scheduler) -> DiffusionPipeline:
    if name == "sdxl-arch":
        text_encoder, tokenizer = clip_text_encoder(SEED_TEXT, with_projection=False, hidden=768)
        text_encoder_2, tokenizer_2 = clip_text_encoder(SEED_TEXT_2, with_projection=True, hidden=1280)
        return StableDiffusionXLPipeline(
            vae=tiny_vae(4, scaling_factor=0.13025, shift_factor=None), text_encoder=text_encoder,
            tokenizer=tokenizer, text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, unet=denoiser,
            scheduler=scheduler, add_watermarker=False)
    elif name == "sd3-arch":  # no T5: the pipeline puts its 256 tokens of zeros in its place
        text_encoder, tokenizer = clip_text_encoder(SEED_TEXT, with_projection=True, hidden=768)
        text_encoder_2, tokenizer_2 = clip_text_encoder(SEED_TEXT_2, with_projection=True, hidden=1280)
        return StableDiffusion3Pipeline(
            transformer=denoiser, scheduler=scheduler,
            vae=tiny_vae(16, scaling_factor=1.5305, shift_factor=0.0609), text_encoder=text_encoder,
            tokenizer=tokenizer, text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, text_encoder_3=None,
            tokenizer_3=None)
    else:
        text_encoder, tokenizer = clip_text_encoder(SEED_TEXT, with_projection=False, hidden=768)
        text_encoder_2, tokenizer_2 = t5_text_encoder(SEED_TEXT_2, hidden=4096)
        return FluxPipeline(
            scheduler=scheduler, vae=tiny_vae(16, scaling_factor=0.3611, shift_factor=0.1159),
            text_encoder=text_encoder, tokenizer=tokenizer, text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
            transformer=denoiser)


# ------------------------------------------------------------------------ loading and export


def load_pipeline(model: str, dtype: str = "float32", device: str = "cpu") -> DiffusionPipeline:
    """A built-in tiny model by name, a full-size architecture with random weights
    (`gouache.models.arch`), or a local diffusers directory (never the network)."""
    if model in ARCH_CONFIGS:
        return arch_pipeline(model, dtype, device)
    if model in BUILDERS:
        pipe = BUILDERS[model]()
        if dtype != "float32":  # built in fp32; a no-op cast would only log a warning
            pipe = pipe.to(dtype=torch_dtype(dtype))
        return pipe.to(device)
    index = os.path.join(model, "model_index.json")
    if os.path.isfile(index):
        with open(index) as file:
            components = json.load(file)
        # a component saved as absent ([null, null]), e.g. SD3 without T5, loads as absent
        given = {k: None for k, v in components.items() if v == [None, None]}
        if components.get("processor") in (["transformers", name] for name in VL_PROCESSORS):
            # transformers builds Qwen2-VL's processor only with torchvision: gouache's stands in
            given["processor"] = QwenVLProcessor.from_pretrained(os.path.join(model, "processor"))
        # `dtype=` is diffusers' current spelling of `torch_dtype=` (deprecated in 0.42)
        pipe = DiffusionPipeline.from_pretrained(model, local_files_only=True, dtype=torch_dtype(dtype), **given)
        return pipe.to(device)
    raise UnknownModelError(
        f"unknown model {model!r}: expected a built-in ({', '.join(BUILTIN_MODELS)}) or a path"
        " to a local diffusers directory (one containing model_index.json)",
        param="model",
    )


def export_model(name: str, directory: str) -> None:
    """Write built-in `name` as a diffusers directory that `load_pipeline` loads back equal."""
    if name not in BUILDERS:
        raise UnknownModelError(
            f"unknown built-in {name!r}; expected one of {', '.join(BUILTIN_MODELS)}", param="model"
        )
    BUILDERS[name]().save_pretrained(directory, safe_serialization=True)


def model_id(model: str) -> str:
    """The id clients see for `--model`: a built-in's name, a directory's folder name (never a path)."""
    return model if model in BUILDERS else os.path.basename(os.path.normpath(model))
