"""ControlNets in the model runner: the output equals diffusers' ControlNet pipelines (one
ControlNet, and several as MultiControlNetModel), a batch of requests with different
ControlNets, images and scales equals each request alone, and ControlNets that do not fit the
model are refused before they run."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from gouache.adapter_names import ControlNetError, UnknownControlNet
from gouache.config import ControlNetConfig
from gouache.models.zoo import load_pipeline
from gouache.request import ImageRequest
from gouache.runner.model_runner import ModelRunner
from gouache.sched.plan import Batch

TOL = 1e-4
STEPS = 3
PIPELINES = {"tiny-sd": "StableDiffusionControlNetPipeline", "tiny-sdxl": "StableDiffusionXLControlNetPipeline"}


@pytest.fixture(scope="module", params=sorted(PIPELINES))
def model(request):
    return request.param


def image(seed: int, size=(64, 64)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)


def request(rid, nets=(), size=(64, 64), seed=1):
    h, w = size
    return ImageRequest(rid, "a cat", w, h, STEPS, 4.0, seed=seed, controlnets=tuple((n, b"", s) for n, _, s in nets))


def run(runner: ModelRunner, requests: list[tuple[ImageRequest, list]], patched=False,
        outputs: list | None = None) -> dict[str, torch.Tensor]:
    """Each request's STEPS steps in batches of all of them; `requests`: (request, its nets).
    The steps' outputs go to `outputs` if given."""
    for r, nets in requests:
        runner.prepare(r, controls=[img for _, img, _ in nets])
    ids = tuple(r.request_id for r, _ in requests)
    for _ in range(STEPS):
        out = runner.execute(Batch(ids, patched=patched))
        assert not out.failed and sorted(out.request_ids) == sorted(ids), out.failed
        if outputs is not None:
            outputs.append(out)
    latents = {rid: runner.states[rid].latents.clone() for rid in ids}
    for rid in ids:
        runner.release(rid)
    return latents


def reference(pipe, model, control_dir, names, images, scales, r):
    import diffusers
    from diffusers import ControlNetModel

    nets = [ControlNetModel.from_pretrained(str(control_dir / n)) for n in names]
    cls = getattr(diffusers, PIPELINES[model])
    theirs = cls.from_pipe(pipe, controlnet=nets[0] if len(nets) == 1 else nets)
    out = theirs(prompt=r.prompt,
                 image=[Image.fromarray(i) for i in images] if len(nets) > 1 else Image.fromarray(images[0]),
                 controlnet_conditioning_scale=scales if len(nets) > 1 else scales[0], height=r.height, width=r.width,
                 num_inference_steps=STEPS, guidance_scale=r.guidance_scale,
                 generator=torch.Generator().manual_seed(r.seed), output_type="latent")
    return out.images


@pytest.mark.parametrize("names", [("edges",), ("edges", "depth")], ids=["one", "multi"])
def test_output_equals_diffusers_controlnet_pipeline(pipe, model, control_dir, names):
    runner = ModelRunner(pipe, controlnet=ControlNetConfig(str(control_dir)))
    scales = [0.7, 1.3][: len(names)]
    nets = [(n, image(k), s) for k, (n, s) in enumerate(zip(names, scales))]
    r = request("a", nets)
    ours = run(runner, [(r, nets)])["a"]
    theirs = reference(pipe, model, control_dir, names, [img for _, img, _ in nets], scales, r)
    plain = run(runner, [(request("a"), [])])["a"]
    assert (ours - theirs).abs().max() <= TOL
    assert (ours - plain).abs().max() > 100 * TOL  # the ControlNet does something


def test_a_batch_of_mixed_controlnets_equals_each_request_alone(pipe, control_dir):
    runner = ModelRunner(pipe, controlnet=ControlNetConfig(str(control_dir)))
    mix = [(request("plain"), []),
           (request("edges", [("edges", None, 1.0)], seed=2), [("edges", image(1), 1.0)]),
           (request("both", [("depth", None, 0.5), ("edges", None, 2.0)], seed=3),
            [("depth", image(2), 0.5), ("edges", image(3), 2.0)]),
           (request("wide", [("edges", None, 0.8)], size=(64, 128), seed=4), [("edges", image(4, (64, 128)), 0.8)])]
    together = run(runner, mix, patched=True)  # ControlNet requests run plain forwards, one per size
    runner.controls.collect()  # what the engine thread does before a step
    assert not runner.controls.embeddings._by  # each request's embedded conditioning went with it
    for r, nets in mix:
        alone = run(runner, [(r, nets)])
        assert (together[r.request_id] - alone[r.request_id]).abs().max() <= TOL, r.request_id


def test_controlnets_that_do_not_fit_are_refused(pipe, control_dir, tmp_path):
    runtime = ModelRunner(pipe, controlnet=ControlNetConfig(str(control_dir))).controls
    with pytest.raises(UnknownControlNet, match="no nothing/config.json"):
        runtime.check("nothing")
    with pytest.raises(ControlNetError, match="must match"):
        runtime.check("../edges")
    config = json.loads((control_dir / "edges" / "config.json").read_text())
    (tmp_path / "wide").mkdir()
    (tmp_path / "wide" / "config.json").write_text(json.dumps({**config, "cross_attention_dim": 999}))
    (tmp_path / "gray").mkdir()
    (tmp_path / "gray" / "config.json").write_text(json.dumps({**config, "conditioning_channels": 1}))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{")
    other = ModelRunner(pipe, controlnet=ControlNetConfig(str(tmp_path))).controls
    with pytest.raises(ControlNetError, match="cross_attention_dim is 999"):
        other.check("wide")
    with pytest.raises(ControlNetError, match="1-channel conditioning"):
        other.check("gray")
    with pytest.raises(ControlNetError, match="no readable config.json"):
        other.check("broken")
    assert ModelRunner(pipe).controls.cache.names() == []
    with pytest.raises(UnknownControlNet, match="no --controlnet-dir"):
        ModelRunner(pipe).controls.check("edges")


def test_transformer_models_take_no_controlnets():
    runtime = ModelRunner(load_pipeline("tiny-sd3")).controls
    with pytest.raises(ControlNetError, match="UNet models"):
        runtime.check("edges")
