"""LoRA files with text-encoder layers (SD, SDXL): each request's prompt is encoded with its
own adapters, equal to diffusers' `load_lora_weights` + `set_adapters` with the same file, in a
batch beside requests without them; encodings are cached per adapter set."""

import pytest
import torch
from safetensors.torch import save_file

from gouache.config import LoraConfig
from gouache.lora.files import random_lora
from gouache.models.zoo import load_pipeline
from gouache.request import ImageRequest
from gouache.runner.model_runner import ModelRunner
from gouache.sched.plan import Batch

TEXT_MODULES = (".q_proj", ".k_proj", ".v_proj", ".out_proj", ".fc1", ".fc2")


def text_lora(pipe, seed: int, rank: int = 4) -> dict[str, torch.Tensor]:
    """Random diffusers / peft keyed layers on every attention and MLP projection of each text encoder."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for encoder_name in ("text_encoder", "text_encoder_2"):
        encoder = getattr(pipe, encoder_name, None)
        for path, module in (encoder.named_modules() if encoder is not None else ()):
            if path.endswith(TEXT_MODULES):
                down = torch.randn(rank, module.in_features, generator=generator) / module.in_features ** 0.5
                up = torch.randn(module.out_features, rank, generator=generator) / rank ** 0.5
                out[f"{encoder_name}.{path}.lora_A.weight"], out[f"{encoder_name}.{path}.lora_B.weight"] = down, up
    return out


def kohya_text_lora(pipe, seed: int, rank: int = 4) -> dict[str, torch.Tensor]:
    """kohya keys (`lora_te_*` / `lora_te1_*`, `lora_te2_*`) with alphas: 2 on attention, 3 on the MLPs."""
    out = {}
    for key, value in text_lora(pipe, seed, rank).items():
        encoder, path = key.split(".", 1)
        path = path.removesuffix(".lora_A.weight").removesuffix(".lora_B.weight")
        if not path.startswith("text_model."):
            path = "text_model." + path
        stem = {"text_encoder": "lora_te1" if hasattr(pipe, "text_encoder_2") else "lora_te",
                "text_encoder_2": "lora_te2"}[encoder] + "_" + path.replace(".", "_")
        out[f"{stem}.lora_down.weight" if key.endswith("lora_A.weight") else f"{stem}.lora_up.weight"] = value
        out[f"{stem}.alpha"] = torch.tensor(3.0 if ".mlp." in path else 2.0)
    return out


@pytest.fixture(scope="module", params=["tiny-sd", "tiny-sdxl"])
def model(request):
    return request.param


@pytest.fixture(scope="module")
def lora_dir(model, tmp_path_factory):
    pipe = load_pipeline(model)
    directory = tmp_path_factory.mktemp(f"text-loras-{model}")
    save_file({**random_lora(pipe, rank=4, seed=0), **text_lora(pipe, seed=1)}, str(directory / "both.safetensors"))
    save_file(kohya_text_lora(pipe, seed=2), str(directory / "kohya.safetensors"))
    return directory


def request(rid: str, loras=(), prompt: str = "a red fox") -> ImageRequest:
    return ImageRequest(rid, prompt, 64, 64, 3, 5.0, seed=4, negative_prompt="blurry", loras=tuple(loras))


def serve(runner: ModelRunner, requests: list[ImageRequest]) -> dict[str, torch.Tensor]:
    for r in requests:
        runner.prepare(r)
    ids = tuple(r.request_id for r in requests)
    for _ in range(3):
        assert not runner.execute(Batch(ids)).failed
    return {rid: runner.states[rid].latents for rid in ids}


def diffusers_latents(model: str, lora_dir, name: str, scale: float) -> torch.Tensor:
    reference = load_pipeline(model)
    reference.set_progress_bar_config(disable=True)
    reference.load_lora_weights(str(lora_dir), weight_name=f"{name}.safetensors", adapter_name=name)
    reference.set_adapters([name], [scale])
    r = request("x")
    return reference(prompt=r.prompt, negative_prompt=r.negative_prompt, height=64, width=64, num_inference_steps=3,
                     guidance_scale=5.0, generator=torch.Generator().manual_seed(4), output_type="latent").images


@pytest.mark.parametrize(("name", "scale"), [("both", 0.8), ("kohya", 1.3)])
def test_text_encoder_layers_equal_diffusers_load_lora_weights_beside_a_request_without(model, lora_dir, name, scale):
    runner = ModelRunner(load_pipeline(model), lora=LoraConfig(str(lora_dir)), conditioning_bytes=1 << 26)
    ours = serve(runner, [request("with", [(name, scale)]), request("without")])
    plain = serve(ModelRunner(load_pipeline(model)), [request("plain")])["plain"]
    expected = diffusers_latents(model, lora_dir, name, scale)
    assert (ours["with"] - expected).abs().max() <= 1e-4
    assert (ours["without"] - plain).abs().max() <= 1e-4  # the same prompt's encoding without the adapter
    assert (ours["with"] - plain).abs().max() > 1e-2  # the adapter changed the picture


def test_encodings_are_cached_per_text_adapter_set(model, lora_dir):
    runner = ModelRunner(load_pipeline(model), lora=LoraConfig(str(lora_dir)), conditioning_bytes=1 << 26)
    runner.conditioning.take_report()
    conds = {}
    for rid, loras in (("a", [("kohya", 1.0)]), ("b", [("kohya", 1.0)]), ("c", [("kohya", 0.5)]), ("d", [])):
        runner.prepare(request(rid, loras))
        conds[rid] = runner.states[rid].cond["prompt_embeds"]
    counts = runner.conditioning.take_report().lookups
    assert counts[("text", "hit")] == 1 and counts[("text", "miss")] == 3
    assert torch.equal(conds["a"], conds["b"])
    assert not torch.equal(conds["a"], conds["c"]) and not torch.equal(conds["c"], conds["d"])
    assert runner.lora_runtime.store.describe("kohya")["layers"] == len(kohya_text_lora(runner.pipe, 2)) // 3
