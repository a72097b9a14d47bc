"""Quantized denoiser weights (`gouache.runner.quantize`): int8 linear layers stay close to fp32,
LoRA adapters on them run segmented (never merged into an int8 weight) with the effect they
have on fp32, and fp8 is refused on the CPU."""

import sys

import pytest
import torch

from gouache.config import LoraConfig, ModelConfig
from gouache.models.zoo import load_pipeline
from gouache.request import ImageRequest
from gouache.runner.model_runner import ModelRunner
from gouache.runner.quantize import quantize, quantized
from gouache.sched.plan import Batch
from gouache.uploads import EditMask, Upload
from tests.lora.random_files import random_loras

STEPS = 3


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory):
    return random_loras(tmp_path_factory.mktemp("loras"), "tiny-sd")


def run(pipe, lora_dir, loras_of: dict[str, tuple]) -> tuple[dict, list[str]]:
    """STEPS steps of one batch of requests (id -> adapters); their latents and the LoRA modes."""
    runner = ModelRunner(pipe, lora=LoraConfig(str(lora_dir)))
    for name in runner.lora_runtime.store.names():
        runner.lora_runtime.store.load(name).result()
    for seed, (rid, loras) in enumerate(loras_of.items()):
        runner.prepare(ImageRequest(rid, "a cat", 64, 64, STEPS, 4.0, seed=seed, loras=loras))
    modes = []
    for _ in range(STEPS):
        out = runner.execute(Batch(tuple(loras_of)))
        assert not out.failed
        modes.append(out.lora.mode)
    return {rid: runner.states[rid].latents for rid in loras_of}, modes


def test_int8_quantizes_the_linear_layers_only_and_stays_close_to_fp32(lora_dir):
    fp32 = load_pipeline("tiny-sd")
    int8 = quantize(load_pipeline("tiny-sd"), "int8")
    assert quantized(int8.unet) == "int8" and quantized(fp32.unet) is None
    linear = next(m for m in int8.unet.modules() if isinstance(m, torch.nn.Linear))
    conv = next(m for m in int8.unet.modules() if isinstance(m, torch.nn.Conv2d))
    assert type(linear.weight.data) is not torch.Tensor  # a quantized tensor subclass
    assert type(conv.weight.data) is torch.Tensor
    exact, _ = run(fp32, lora_dir, {"a": ()})
    approx, _ = run(int8, lora_dir, {"a": ()})
    scale = exact["a"].abs().max()
    assert 0 < (approx["a"] - exact["a"]).abs().max() < 0.05 * scale


def test_lora_on_int8_weights_runs_segmented_with_its_fp32_effect(lora_dir):
    fp32 = load_pipeline("tiny-sd")
    int8 = quantize(load_pipeline("tiny-sd"), "int8")
    asked = {"ink": (("ink", 1.0),), "paper": (("paper", 1.0),), "none": ()}
    exact, exact_modes = run(fp32, lora_dir, asked)
    approx, modes = run(int8, lora_dir, asked)
    assert set(modes) == {"segmented"}
    single, single_modes = run(int8, lora_dir, {"ink": (("ink", 1.0),)})
    assert set(single_modes) == {"segmented"}  # fp32 would merge a lone set
    plain, _ = run(int8, lora_dir, {"ink": ()})
    for rid in ("ink", "paper"):
        effect = (exact[rid] - exact["none"]).abs().max()
        assert effect > 1e-2  # the adapters matter ...
        assert (approx[rid] - exact[rid]).abs().max() < 0.25 * effect  # ... and keep their effect on int8
    assert (single["ink"] - approx["ink"]).abs().max() < 1e-4  # alone or beside others
    assert (single["ink"] - plain["ink"]).abs().max() > 1e-2


def test_fp8_is_refused_on_the_cpu():
    with pytest.raises(ValueError, match="GPU"):
        ModelConfig("tiny-sd", quantize="fp8")
    with pytest.raises(ValueError, match="GPU"):
        quantize(load_pipeline("tiny-sd"), "fp8")
    with pytest.raises(ValueError, match="int8 or fp8"):
        ModelConfig("tiny-sd", quantize="int4")


def test_quantize_without_torchao_installed_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # what the serving virtualenv has: no torchao
    with pytest.raises(ValueError, match=r"pip install 'gouache\[quantize\]'"):
        ModelConfig("tiny-sd", quantize="int8")
    assert ModelConfig("tiny-sd").quantize is None


def test_templates_and_controlnets_run_on_int8_weights(tmp_path):
    """A template store keys int8 weights apart from fp32 ones, records and replays on them, and
    a ControlNet's residuals enter the int8 UNet."""
    import numpy as np

    from gouache.config import ControlNetConfig, TemplateConfig
    from gouache.controlnet.model import random_controlnet
    from gouache.models.digest import model_digest

    fp32, int8 = load_pipeline("tiny-sd"), quantize(load_pipeline("tiny-sd"), "int8")
    assert model_digest(int8) != model_digest(fp32)
    runner = ModelRunner(int8, templates=TemplateConfig(directory=str(tmp_path / "templates")))
    image, mask = np.full((64, 64, 3), 100, np.uint8), np.zeros((64, 64), np.float32)
    mask[:32] = 1
    for rid, fields, edit_mask in (("record", {"register_template": True}, np.zeros_like(mask)),
                                   ("replay", {"template_cache": True}, mask)):
        runner.prepare(ImageRequest(rid, "a cat", 64, 64, STEPS, 4.0, seed=0, image=b"-", template_id="t", **fields),
                       Upload(image, EditMask(edit_mask)))
        for _ in range(STEPS):
            out = runner.execute(Batch((rid,)))
            assert not out.failed
    assert out.templates.tokens["replayed"] > 0
    random_controlnet(fp32, seed=0).save_pretrained(str(tmp_path / "controlnets" / "edges"))
    controlled = ModelRunner(int8, controlnet=ControlNetConfig(str(tmp_path / "controlnets")))
    controlled.prepare(ImageRequest("c", "a cat", 64, 64, STEPS, 4.0, seed=0, controlnets=(("edges", b"-", 1.0),)),
                       controls=[np.full((64, 64, 3), 255, np.uint8)])
    out = controlled.execute(Batch(("c",)))
    assert not out.failed and out.controlnet.runs == {"local": 1}
