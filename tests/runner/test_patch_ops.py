
import pytest
import torch
from diffusers import UNet2DConditionModel
from torch import nn

from gouache.models.zoo import load_pipeline, seeded
from gouache.runner.layout import PatchLayout
from gouache.runner.patch_ops import HaloConv2d, PatchGroupNorm, PatchIndex, patch_unet, patched_unet_forward

TOL = 1e-4  # fp32; the patched forward sums in a different order, so it is ~1e-6 off, not 0
MIXED = [(8, 8), (8, 12), (12, 8), (16, 16)]  # latent sizes; non-square both ways

CASES = {  # name: (latent sizes in caller order, patch side)
    "one-resolution": ([(8, 8), (8, 8)], 4),
    "two-resolutions": ([(8, 12), (8, 8), (8, 12)], 4),
    "mixed": (MIXED, 4),
    "patch-2": ([(8, 8), (4, 6), (6, 4)], 2),
    "whole-image": ([(8, 8), (8, 8)], 8),
}


@pytest.fixture(scope="module")
def unets():
    with torch.no_grad():
        yield {name: load_pipeline(name).unet for name in ("tiny-sd", "tiny-sdxl", "tiny-sd-inpaint")}


def conditioning(unet, n: int, seed: int = 0):
    """Per image: a distinct timestep, text embedding and (SDXL) micro-conditioning."""
    g = torch.Generator().manual_seed(seed)
    timestep = torch.linspace(999, 1, n).round()
    text = torch.randn(n, 7, unet.config.cross_attention_dim, generator=g)
    added = None
    if unet.config.addition_embed_type == "text_time":
        pooled = unet.add_embedding.linear_1.in_features - 6 * unet.config.addition_time_embed_dim
        added = {
            "text_embeds": torch.randn(n, pooled, generator=g),
            "time_ids": 100 * torch.rand(n, 6, generator=g),  # sizes and crops, scaled like pixels
        }
    return timestep, text, added


def per_image_forward(unet, samples, timestep, text, added):
    def one(i):
        cond = None if added is None else {k: v[i : i + 1] for k, v in added.items()}
        return unet(samples[i][None], timestep[i : i + 1], text[i : i + 1], added_cond_kwargs=cond).sample[0]

    return [one(i) for i in range(len(samples))]


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert [x.shape for x in a] == [y.shape for y in b]
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def random_samples(unet, shapes, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(unet.config.in_channels, h, w, generator=g) for h, w in shapes]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("model", ["tiny-sd", "tiny-sdxl", "tiny-sd-inpaint"])
@pytest.mark.parametrize("as_data", [False, True], ids=["per-group", "as-data"])
def test_patched_forward_equals_per_image_forward(unets, model, case, as_data):
    """Attention per resolution group, or (`as_data`) over the whole batch's projections with
    each image's segment of tokens and text as tensors."""
    unet, (shapes, patch) = unets[model], CASES[case]
    samples = random_samples(unet, shapes)
    cond = conditioning(unet, len(shapes))
    with torch.no_grad():
        out = patched_unet_forward(unet, PatchLayout.build(shapes, patch), samples, *cond, whole_batches=not as_data,
                                   as_data=as_data)
        assert max_diff(out, per_image_forward(unet, samples, *cond)) <= TOL


def test_naive_patches_are_far_off(unets):
    """Without the patched operators the comparison above would fail: it tests something."""
    unet, layout = unets["tiny-sd"], PatchLayout.build(MIXED, 4)
    samples = random_samples(unet, MIXED)
    timestep, text, _ = conditioning(unet, len(MIXED))
    caller = PatchIndex(layout).tensors(torch.device("cpu")).caller
    with torch.no_grad():
        naive = unet(layout.split(samples), timestep[caller], text[caller]).sample
        assert max_diff(layout.merge(naive), per_image_forward(unet, samples, timestep, text, None)) > 1e-2


def test_any_number_of_levels():
    """An SDXL-shaped UNet (three blocks, two downsamples): the deepest patch side is 1."""
    unet = seeded(0, lambda: UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, block_out_channels=(16, 16, 32), layers_per_block=1,
        norm_num_groups=8, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=16,
        attention_head_dim=2, transformer_layers_per_block=(1, 1, 2),
    ).eval())
    samples, cond = random_samples(unet, MIXED), conditioning(unet, len(MIXED))
    with torch.no_grad():
        out = patched_unet_forward(unet, PatchLayout.build(MIXED, 4), samples, *cond)
        assert max_diff(out, per_image_forward(unet, samples, *cond)) <= TOL
        with pytest.raises(ValueError, match="multiple of 4"):
            patched_unet_forward(unet, PatchLayout.build(MIXED, 2), samples, *cond)


# ------------------------------------------------------------------------------- each op


@pytest.mark.parametrize(
    "conv",
    [
        nn.Conv2d(4, 8, 3, padding=1),
        nn.Conv2d(8, 3, 3, stride=2, padding=1),
        nn.Conv2d(6, 6, 3, padding=1, groups=3, bias=False),
        nn.Conv2d(2, 5, 5, padding=2),
        nn.Conv2d(3, 4, 3, padding=2, dilation=2),
        nn.Conv2d(3, 4, (3, 1), stride=2, padding=(1, 0)),
    ],
    ids=["3x3", "stride-2", "grouped", "5x5", "dilated", "3x1-stride-2"],
)
def test_halo_conv_equals_conv_on_each_image(conv):
    layout = PatchLayout.build(MIXED, 4)
    images = [torch.randn(conv.in_channels, h, w) for h, w in MIXED]
    with torch.no_grad():
        out = layout.merge(HaloConv2d(conv, PatchIndex(layout))(layout.split(images)))
        assert max_diff(out, [conv(x[None])[0] for x in images]) <= 1e-5


def test_halo_conv_refuses_paddings_it_cannot_reproduce():
    index = PatchIndex(PatchLayout.build(MIXED, 4))
    with pytest.raises(ValueError, match="'same' padding"):
        HaloConv2d(nn.Conv2d(4, 4, 3, stride=2, padding=0), index)  # Downsample2D(padding=0)
    with pytest.raises(ValueError, match="unsupported conv padding"):
        HaloConv2d(nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect"), index)
    with pytest.raises(ValueError, match="wider than the patch side 4"):  # would need 2 neighbours
        HaloConv2d(nn.Conv2d(1, 1, 11, padding=5), index)(torch.zeros(index.layout.num_patches, 1, 4, 4))


@pytest.mark.parametrize("offset", [0.0, 100.0])  # a large mean would cancel a one-pass variance
def test_patch_group_norm_equals_group_norm_on_each_image(offset):
    norm = nn.GroupNorm(4, 16)
    nn.init.normal_(norm.weight), nn.init.normal_(norm.bias)
    layout = PatchLayout.build(MIXED, 4)
    images = [offset + torch.randn(16, h, w) * (i + 1) for i, (h, w) in enumerate(MIXED)]
    with torch.no_grad():
        out = layout.merge(PatchGroupNorm(norm, PatchIndex(layout))(layout.split(images)))
        assert max_diff(out, [norm(x[None])[0] for x in images]) <= 1e-4


def test_context_restores_modules_and_processors_even_on_error(unets):
    unet = unets["tiny-sdxl"]
    modules, processors = dict(unet.named_modules()), unet.attn_processors
    sample, (timestep, text, added) = torch.randn(1, 4, 8, 8), conditioning(unet, 1)
    with torch.no_grad():
        before = unet(sample, timestep, text, added_cond_kwargs=added).sample
        with pytest.raises(RuntimeError, match="boom"):
            with patch_unet(unet, PatchLayout.build(MIXED, 4)) as index:
                assert any(isinstance(m, HaloConv2d) for m in unet.modules())
                with pytest.raises(RuntimeError, match="does not nest"), patch_unet(unet, index.layout):
                    pass
                raise RuntimeError("boom")
        after = unet(sample, timestep, text, added_cond_kwargs=added).sample
    assert dict(unet.named_modules()).keys() == modules.keys()
    assert all(m is modules[name] for name, m in unet.named_modules())
    assert all(p is processors[name] for name, p in unet.attn_processors.items())
    assert torch.equal(before, after)
