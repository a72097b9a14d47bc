"""Packed DiT forwards: a mixed-resolution batch in one forward equals each image's own forward."""

from __future__ import annotations

import pytest
import torch
from diffusers import FluxPipeline, SD3Transformer2DModel
from diffusers.models.attention_processor import JointAttnProcessor2_0

from gouache.models.zoo import load_pipeline
from gouache.runner.pack_dit import Packing
from gouache.runner.pack_flux import packed_flux_forward
from gouache.runner.pack_sd3 import packed_sd3_forward

TOL = 1e-4
TEXT_LEN = 24  # any length works; real prompts give 333 (SD3) or 512 (Flux) tokens

# name -> shapes in caller order; SD3 shapes are latents, Flux shapes are token grids
SD3_CASES = {
    "one-image": [(8, 12)],
    "one-resolution": [(8, 8), (8, 8)],
    "two-resolutions": [(8, 12), (8, 8), (8, 12)],
    "three-resolutions": [(12, 8), (8, 12), (16, 16)],
    "four-resolutions": [(8, 8), (8, 12), (12, 8), (16, 16)],
}
FLUX_CASES = {
    "one-image": [(4, 6)],
    "one-resolution": [(4, 4), (4, 4)],
    "two-resolutions": [(4, 6), (4, 4), (4, 6)],
    "three-resolutions": [(6, 4), (4, 6), (8, 8)],
    "four-resolutions": [(4, 4), (4, 6), (6, 4), (8, 8)],
}


@pytest.fixture(scope="module")
def sd3():
    return load_pipeline("tiny-sd3").transformer


@pytest.fixture(scope="module")
def flux():
    return load_pipeline("tiny-flux").transformer


def make_inputs(family: str, shapes, text_len: int = TEXT_LEN, seed: int = 0) -> dict:
    """Per-image conditioning, all different; images of one size share their latent, so only
    the right timestep and prompt can give each its own reference output."""
    g = torch.Generator().manual_seed(seed)
    n, channels = len(shapes), 16 if family == "sd3" else 64
    latent = {s: torch.randn(channels, *s, generator=g) for s in sorted(set(shapes))}
    inputs = dict(
        samples=[latent[s] for s in shapes],
        timestep=torch.rand(n, generator=g) * (1000 if family == "sd3" else 1),
        encoder_hidden_states=torch.randn(n, text_len, 64, generator=g),
        pooled_projections=torch.randn(n, 64 if family == "sd3" else 32, generator=g),
    )
    if family == "flux":
        inputs["guidance"] = 1 + 4 * torch.rand(n, generator=g)
        inputs["txt_ids"] = torch.randint(0, 4, (text_len, 3), generator=g).float()
    return inputs


def reference_sd3(model, inputs: dict, i: int) -> torch.Tensor:
    one = {k: inputs[k][i : i + 1] for k in ("timestep", "encoder_hidden_states", "pooled_projections")}
    return model(hidden_states=inputs["samples"][i][None], **one, return_dict=False)[0][0]


def reference_flux(model, inputs: dict, i: int) -> torch.Tensor:
    x = inputs["samples"][i]
    c, h, w = x.shape
    one = {k: inputs[k][i : i + 1] for k in ("timestep", "guidance", "encoder_hidden_states", "pooled_projections")}
    img_ids = FluxPipeline._prepare_latent_image_ids(1, h, w, x.device, x.dtype)
    out = model(hidden_states=x.flatten(1).T[None], txt_ids=inputs["txt_ids"], img_ids=img_ids, **one,
                return_dict=False)[0]
    return out[0].T.reshape(c, h, w)


def run_packed(family: str, model, inputs: dict) -> list[torch.Tensor]:
    forward = packed_sd3_forward if family == "sd3" else packed_flux_forward
    return forward(model, **inputs)


def max_diffs(family: str, model, shapes) -> list[float]:
    inputs = make_inputs(family, shapes)
    reference = reference_sd3 if family == "sd3" else reference_flux
    with torch.no_grad():
        outs = run_packed(family, model, inputs)
        refs = [reference(model, inputs, i) for i in range(len(shapes))]
    assert [o.shape for o in outs] == [r.shape for r in refs]
    return [(o - r).abs().max().item() for o, r in zip(outs, refs)]


@pytest.mark.parametrize("case", SD3_CASES)
def test_packed_sd3_equals_each_image_alone(sd3, case):
    diffs = max_diffs("sd3", sd3, SD3_CASES[case])
    print(f"sd3 {case}: max abs diff {max(diffs):.2e}")
    assert max(diffs) <= TOL


@pytest.mark.parametrize("case", FLUX_CASES)
def test_packed_flux_equals_each_image_alone(flux, case):
    diffs = max_diffs("flux", flux, FLUX_CASES[case])
    print(f"flux {case}: max abs diff {max(diffs):.2e}")
    assert max(diffs) <= TOL


def test_sd35_dual_attention_and_qk_norm():
    """SD3.5's extra image-only attention (`attn2`, called without text) and its qk RMSNorms."""
    torch.manual_seed(0)
    model = SD3Transformer2DModel(
        sample_size=32, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=32,
        num_attention_heads=2, joint_attention_dim=64, caption_projection_dim=64, pooled_projection_dim=64,
        pos_embed_max_size=64, dual_attention_layers=(0,), qk_norm="rms_norm",
    ).eval()
    assert max(max_diffs("sd3", model, SD3_CASES["three-resolutions"])) <= TOL


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_the_comparison_can_fail(request, family):
    """The checks above mean something: conditioning changes the output, and so does running
    the plain model on a crop (crop-local positions, attention within the crop)."""
    model = request.getfixturevalue(family)
    inputs = make_inputs(family, (SD3_CASES if family == "sd3" else FLUX_CASES)["one-resolution"])
    reference = reference_sd3 if family == "sd3" else reference_flux
    side = 4 if family == "sd3" else 2  # half the image
    with torch.no_grad():
        a, b = reference(model, inputs, 0), reference(model, inputs, 1)  # same latent, other prompt and t
        corner = [x[:, -side:, -side:] for x in inputs["samples"][:1]]  # image 0's last corner, alone
        cut = reference(model, {**inputs, "samples": corner}, 0)
    assert (a - b).abs().max() > 100 * TOL
    assert (cut - a[:, -side:, -side:]).abs().max() > 100 * TOL


def test_packing_puts_same_sizes_together_and_round_trips():
    packing = Packing.build([(2, 3), (1, 1), (2, 3), (1, 2)], text_len=2, device=torch.device("cpu"))
    assert packing.order == (1, 3, 0, 2)
    assert [(g.shape, g.count, g.image_rows, g.text_rows) for g in packing.groups] == [
        ((1, 1), 1, slice(0, 1), slice(0, 2)), ((1, 2), 1, slice(1, 3), slice(2, 4)),
        ((2, 3), 2, slice(3, 15), slice(4, 8))]
    assert packing.image_index.tolist() == [1, 3, 3, *[0] * 6, *[2] * 6]
    assert packing.text_index.tolist() == [1, 1, 3, 3, 0, 0, 2, 2]
    images = [torch.randn(h * w, 5) for h, w in packing.shapes]
    assert all(torch.equal(a, b) for a, b in zip(packing.unpack(packing.pack(images)), images))


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_model_is_exactly_restored(request, family):
    model = request.getfixturevalue(family)
    shapes = (SD3_CASES if family == "sd3" else FLUX_CASES)["two-resolutions"]
    reference = reference_sd3 if family == "sd3" else reference_flux
    inputs = make_inputs(family, shapes)
    processors, modules = model.attn_processors, dict(model.named_modules())
    with torch.no_grad():
        before = reference(model, inputs, 0)
        run_packed(family, model, inputs)
        broken = {**inputs, "encoder_hidden_states": inputs["encoder_hidden_states"][:, :, :3]}  # fails inside
        with pytest.raises(RuntimeError):
            run_packed(family, model, broken)
        after = reference(model, inputs, 0)
    assert all(model.attn_processors[name] is p for name, p in processors.items())
    assert dict(model.named_modules()).keys() == modules.keys()
    assert all(module is modules[name] for name, module in model.named_modules())
    assert torch.equal(before, after)


def test_refuses_processors_it_would_silently_replace(sd3):
    class Custom(JointAttnProcessor2_0):
        pass

    processors = sd3.attn_processors
    sd3.set_attn_processor(Custom())
    try:
        with pytest.raises(ValueError, match="supports JointAttnProcessor2_0 only"):
            run_packed("sd3", sd3, make_inputs("sd3", [(8, 8), (8, 12)]))
    finally:
        sd3.set_attn_processor(dict(processors))
