"""The model zoo: tiny built-ins run, are reproducible and non-degenerate; archs match papers."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from PIL import Image

from gouache.errors import UnknownModelError
from gouache.models.arch import build_arch
from gouache.models.tokenizer import build_tokenizer
from gouache.models.zoo import BUILDERS, BUILTIN_MODELS, export_model, load_pipeline
from gouache.runner.describe import denoiser, model_info
from gouache.runner.families import make_family

SIZE = 64  # pixels: the smallest size every tiny model accepts (8 latents; Flux packs 2x2)


def generate(pipe, prompt: str = "a red fox", seed: int = 0) -> torch.Tensor:
    """Two-step latent generation; inpainting pipelines get a grey image and a full mask, Kontext
    keeps the size (it would scale it to a megapixel), Wan makes a clip of 5 frames (2 latent ones),
    image-to-video from a grey first frame."""
    extra = {}
    if "Inpaint" in type(pipe).__name__:
        extra = dict(
            image=Image.new("RGB", (SIZE, SIZE), (128, 64, 32)),
            mask_image=Image.new("L", (SIZE, SIZE), 255),
        )
    if "Kontext" in type(pipe).__name__:
        extra = dict(max_area=SIZE * SIZE)
    if "Wan" in type(pipe).__name__:
        extra = dict(num_frames=5)
    if "WanImageToVideo" in type(pipe).__name__:
        extra["image"] = Image.new("RGB", (SIZE, SIZE), (128, 64, 32))
    pipe.set_progress_bar_config(disable=True)
    out = pipe(
        prompt=prompt,
        height=SIZE,
        width=SIZE,
        num_inference_steps=2,
        generator=torch.Generator().manual_seed(seed),
        output_type="latent",
        **extra,
    )
    return out.frames if "Wan" in type(pipe).__name__ else out.images


def state_digest(pipe) -> str:
    """SHA-256 over every tensor of every module of the pipeline, in a fixed order."""
    digest = hashlib.sha256()
    for name, module in sorted(pipe.components.items()):
        if isinstance(module, torch.nn.Module):
            for key, tensor in sorted(module.state_dict().items()):
                digest.update(f"{name}.{key}".encode())
                digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def pipes() -> dict:
    return {name: build() for name, build in BUILDERS.items()}


# the Qwen-Image-Edit built-ins are tiny-qwen-image's denoiser and encoders in another pipeline
# (whose every call encodes its reference at a megapixel): tiny-qwen-image stands for them here
@pytest.mark.parametrize("name", [name for name in BUILTIN_MODELS if not name.startswith("tiny-qwen-image-edit")])
def test_tiny_model_generates_and_listens_to_the_prompt(pipes, name):
    pipe = pipes[name]
    fox, cat = generate(pipe, "a red fox"), generate(pipe, "a cat")
    assert torch.isfinite(fox).all()
    assert fox.abs().max() > 0
    assert not torch.equal(fox, cat), "the text conditioning does not reach the denoiser"
    assert model_info(pipe, name).family == BUILTIN_MODELS[name].family


@pytest.mark.parametrize("name", list(BUILTIN_MODELS))
def test_denoiser_weights_and_output_are_not_degenerate(pipes, name):
    net = denoiser(pipes[name])
    zero = [n for n, p in net.named_parameters() if p.dim() >= 2 and not p.any()]
    assert zero == []
    for component in ("text_encoder", "text_encoder_2", "text_encoder_3", "image_encoder", "vae"):
        module = getattr(pipes[name], component, None)
        if module is not None:
            assert all(p.any() for p in module.parameters() if p.dim() >= 2), component


def test_denoiser_output_depends_on_its_inputs(pipes):
    net = denoiser(pipes["tiny-sd"])
    gen = torch.Generator().manual_seed(0)
    x, text = torch.randn(1, 4, 8, 8, generator=gen), torch.randn(1, 77, 32, generator=gen)
    with torch.no_grad():
        out = net(x, 500, encoder_hidden_states=text).sample
        assert out.abs().mean() > 1e-3
        assert not torch.allclose(out, net(x + 1, 500, encoder_hidden_states=text).sample)
        assert not torch.allclose(out, net(x, 10, encoder_hidden_states=text).sample)
        assert not torch.allclose(out, net(x, 500, encoder_hidden_states=-text).sample)


@pytest.mark.parametrize("name", list(BUILTIN_MODELS))
def test_builds_are_bit_identical_whatever_the_global_rng(pipes, name):
    torch.manual_seed(12345)
    torch.rand(1000)  # the caller's RNG state must not leak into the weights
    assert state_digest(BUILDERS[name]()) == state_digest(pipes[name])


@pytest.mark.slow
def test_another_process_builds_the_same_weights(pipes):
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[2])\n"
        "from test_zoo import state_digest\n"
        "from gouache.models.zoo import BUILDERS\n"
        "print(state_digest(BUILDERS['tiny-flux']()))"
    )
    here = Path(__file__).parent
    root = here.parent.parent
    out = subprocess.run(
        [sys.executable, "-c", code, str(here), str(root)],
        capture_output=True, text=True, check=True,
    )
    assert out.stdout.strip().splitlines()[-1] == state_digest(pipes["tiny-flux"])


@pytest.mark.parametrize("name", ["tiny-sdxl", "tiny-flux", "tiny-qwen-image", "tiny-zimage", "tiny-flux2-klein",
                                  "tiny-wan", "shapes-unet", "shapes-dit"])
def test_export_then_load_gives_identical_latents(pipes, name, tmp_path):
    export_model(name, str(tmp_path / name))
    loaded = load_pipeline(str(tmp_path / name))
    assert type(loaded) is type(pipes[name])
    assert state_digest(loaded) == state_digest(pipes[name])
    # equal weights; a loaded weight may sit at another memory alignment, where the CPU's matmul
    # kernels sum in another order: tiny-qwen-image's timestep embedder (a [256, 1] view at 40
    # bytes past a 64-byte boundary, against 0 built) differs in the last bit, 5e-7 in 2 steps
    assert (generate(loaded) - generate(pipes[name])).abs().max() <= 1e-5


def test_a_qwen_image_edit_directory_naming_transformers_processor_loads_with_gouaches(pipes, tmp_path):
    """Real Qwen-Image-Edit directories name transformers' Qwen2VLProcessor, which transformers
    builds only with torchvision: gouache's QwenVLProcessor loads in its place, its settings kept."""
    export_model("tiny-qwen-image-edit", str(tmp_path / "edit"))
    for path, key, value in ((tmp_path / "edit" / "model_index.json", "processor",
                              ["transformers", "Qwen2VLProcessor"]),
                             (tmp_path / "edit" / "processor" / "processor_config.json", "processor_class",
                              "Qwen2VLProcessor")):
        config = json.loads(path.read_text())
        config[key] = value
        path.write_text(json.dumps(config))
    loaded = load_pipeline(str(tmp_path / "edit"))
    assert type(loaded.processor).__name__ == "QwenVLProcessor"
    assert loaded.processor.image_processor.size == pipes["tiny-qwen-image-edit"].processor.image_processor.size
    assert state_digest(loaded) == state_digest(pipes["tiny-qwen-image-edit"])


def test_unknown_model_names_the_builtins(tmp_path):
    for bad in ("sdxl-turbo", str(tmp_path)):  # tmp_path exists but has no model_index.json
        with pytest.raises(UnknownModelError) as err:
            load_pipeline(bad)
        assert err.value.param == "model"
        assert all(name in err.value.message for name in BUILTIN_MODELS)
        assert "local diffusers directory" in err.value.message


def test_the_tiny_wans_are_described_as_video_models(pipes):
    info = model_info(pipes["tiny-wan"], "tiny-wan")
    assert (info.family, info.size_step, info.token_pixels) == ("wan", 16, 16)
    assert (info.default_guidance, info.uses_cfg, info.generation) == (5.0, True, True)
    assert (info.clips.frame_step, info.clips.max_frames, info.clips.fps, info.clips.from_image) == (4, 161, 16, False)
    assert model_info(pipes["tiny-wan-i2v"], "tiny-wan-i2v").clips == replace(info.clips, from_image=True)
    assert all(model_info(pipe, name).clips is None for name, pipe in pipes.items() if not name.startswith("tiny-wan"))


def test_model_info_of_builtins(pipes):
    info = {name: model_info(pipe, name) for name, pipe in pipes.items() if name.startswith("tiny-")}
    assert {i.size_step for i in info.values()} == {16}
    # the router counts an edit's tokens in the family's own (a UNet's latent pixel, a DiT's patch)
    assert {n: i.token_pixels for n, i in info.items()} == {n: make_family(pipes[n], None).token_pixels for n in info}
    assert {n: (i.default_size, i.default_steps) for n, i in info.items()} == {
        n: (128 if n.startswith("tiny-wan") else 256, 20) for n in info}  # a clip is many images
    guidance = {n: i.default_guidance for n, i in info.items() if "inpaint" not in n}
    assert guidance == {"tiny-sd": 7.5, "tiny-sdxl": 5.0, "tiny-sd3": 7.0, "tiny-flux": 3.5, "tiny-flux-kontext": 3.5,
                        "tiny-qwen-image": 4.0, "tiny-qwen-image-edit": 4.0, "tiny-qwen-image-edit-plus": 4.0,
                        "tiny-zimage": 5.0, "tiny-flux2-klein": 4.0, "tiny-wan": 5.0, "tiny-wan-i2v": 5.0}
    assert [n for n, i in info.items() if not i.uses_cfg] == ["tiny-flux", "tiny-flux-kontext"]
    edits = ["tiny-qwen-image-edit", "tiny-qwen-image-edit-plus"]
    assert [n for n, i in info.items() if i.instruction_edit] == ["tiny-flux-kontext", *edits, "tiny-flux2-klein"]
    assert {n: i.max_input_images for n, i in info.items() if i.max_input_images > 1} == {
        "tiny-qwen-image-edit-plus": 3, "tiny-flux2-klein": 4}
    assert [n for n, i in info.items() if not i.generation] == edits
    assert [n for n, i in info.items() if not i.serves("block_cache")] == ["tiny-qwen-image", *edits,
                                                                         "tiny-flux2-klein", "tiny-zimage"]
    assert [n for n, i in info.items() if i.cfg_from != 1.0] == ["tiny-zimage"]
    inpainting = [n for n, i in info.items() if i.inpaint_channels]
    assert inpainting == ["tiny-sd-inpaint", "tiny-sdxl-inpaint"]


def test_model_info_of_other_weights_uses_the_pipeline_defaults(pipes):
    assert model_info(pipes["tiny-sdxl"], "my-sdxl").default_steps == 30
    assert model_info(pipes["tiny-sd3"], "my-sd3").default_size == 256  # sample_size 32 * 8
    assert model_info(pipes["tiny-flux"], "my-flux").default_size == 1024  # Flux's 128 latents


PUBLISHED_PARAMS = {"sdxl-arch": 2.567e9, "sd3-arch": 2.028e9, "flux-arch": 11.90e9}


@pytest.mark.parametrize("name", list(PUBLISHED_PARAMS))
def test_arch_param_counts_match_published(name):
    net = build_arch(name)
    params = list(net.parameters())
    assert all(p.is_meta for p in params)
    assert sum(p.numel() for p in params) == pytest.approx(PUBLISHED_PARAMS[name], rel=0.01)
    assert torch.get_default_dtype() == torch.float32  # restored after building in bf16


def encode(tok, prompts: list[str]):
    """The call every diffusers pipeline makes on its tokenizers."""
    return tok(prompts, padding="max_length", max_length=tok.model_max_length, truncation=True,
               return_tensors="pt")


@pytest.mark.parametrize("kind", ["clip", "t5"])
def test_tokenizer_pads_truncates_decodes_and_saves(kind, tmp_path):
    tok = build_tokenizer(77, kind)
    prompts = ["a red fox", "ünïcödé 🦊 " + "word " * 200]
    enc = encode(tok, prompts)
    assert enc.input_ids.shape == (2, 77)
    assert enc.input_ids[1, -1] == tok.eos_token_id  # truncation keeps the closing eos
    assert enc.input_ids[0, -1] == tok.pad_token_id
    assert (tok.bos_token_id is None) == (kind == "t5")
    assert tok.batch_decode(enc.input_ids, skip_special_tokens=True)[0] == "a red fox"
    assert tok.decode(tok("ünïcödé 🦊").input_ids, skip_special_tokens=True) == "ünïcödé 🦊"
    tok.save_pretrained(tmp_path)
    again = type(tok).from_pretrained(tmp_path)
    assert again.model_max_length == 77
    assert torch.equal(encode(again, prompts).input_ids, enc.input_ids)


def test_clip_pools_at_the_tokenizers_eos(pipes):
    pipe = pipes["tiny-sd"]
    ids = encode(pipe.tokenizer, ["a red fox"]).input_ids
    eos = int((ids[0] == pipe.tokenizer.eos_token_id).nonzero()[0])
    with torch.no_grad():
        out = pipe.text_encoder(ids)
    assert pipe.text_encoder.config.eos_token_id == pipe.tokenizer.eos_token_id
    assert torch.equal(out.pooler_output[0], out.last_hidden_state[0, eos])


def test_pipelines_truncate_long_prompts(pipes):
    # the pipelines batch_decode the cut-off tail to warn about it: that must work too
    embeds = pipes["tiny-sdxl"].encode_prompt("word " * 200, do_classifier_free_guidance=False)[0]
    assert embeds.shape == (1, 77, 64)


def test_every_shapes_caption_word_is_one_token():
    from gouache.data.shapes import WORDS
    from gouache.models.trained import tokenizer

    tok = tokenizer()
    for word in WORDS:
        assert len(tok(word, add_special_tokens=False).input_ids) == 1, word
        assert len(tok(f"a {word}", add_special_tokens=False).input_ids) == 2, word
    longest = ("a purple triangle at the bottom right, a yellow square at the top left and a green circle in the "
               "center on a black background")
    assert len(tok(longest).input_ids) == 28 <= tok.model_max_length
