"""The block cache on real blocks, per patch inside a mixed-size patched UNet forward and per
token inside a packed DiT forward: a unit that is reused takes the block's earlier output; the
others are computed exactly, with the reused units' activations filled in from the cache where
a halo, GroupNorm or attention reads them."""

import pytest
import torch

from gouache.block_cache.blocks import CachedForward, cacheable_blocks, cached_blocks
from gouache.block_cache.store import BlockCache
from gouache.config import BlockCacheConfig
from gouache.models.zoo import load_pipeline
from gouache.runner.layout import PatchLayout
from gouache.runner.patch_ops import patched_unet_forward
from tests.runner.test_pack_dit import make_inputs, reference_flux, reference_sd3, run_packed
from tests.runner.test_patch_ops import TOL, conditioning, max_diff, per_image_forward, random_samples, unets  # noqa: F401


@pytest.mark.parametrize("model", ["tiny-sd", "tiny-sdxl"])
@pytest.mark.parametrize("shapes", [[(8, 8), (8, 12)], [(8, 8), (8, 8)]], ids=["patches", "whole-images"])
def test_an_unchanged_image_is_reused_and_its_batch_mate_stays_exact(unets, model, shapes):  # noqa: F811 (the imported fixture)
    unet = unets[model]
    cache = BlockCache(BlockCacheConfig(max_reuse=3))
    request = CachedForward(cache, (("a", 0), ("b", 0)), (0.05, 0.05))
    layout = PatchLayout.build(shapes, 4)
    cond = conditioning(unet, 2)
    first_samples = random_samples(unet, shapes, seed=1)
    with torch.no_grad():
        first = patched_unet_forward(unet, layout, first_samples, *cond, cache=request)
        assert max_diff(first, per_image_forward(unet, first_samples, *cond)) <= TOL  # nothing cached yet
        # a's input is the same again: reused in every block; b's is new: computed in every block
        samples = [first_samples[0], random_samples(unet, shapes, seed=2)[1]]
        again = patched_unet_forward(unet, layout, samples, *cond, cache=request)
        exact = per_image_forward(unet, samples, *cond)
    blocks = len(cacheable_blocks(unet))
    units = layout.grid(0)[0] * layout.grid(0)[1] if len(set(shapes)) > 1 else 1
    assert cache.reused == blocks * units  # every unit of a, in every block
    assert torch.equal(again[0], first[0])
    assert (again[1] - exact[1]).abs().max() <= TOL


def test_blocks_are_restored_and_unwrapped_attributes_reach_the_model(unets):  # noqa: F811 (the imported fixture)
    unet = unets["tiny-sd"]
    before = [getattr(parent, name) for parent, name, _ in cacheable_blocks(unet)]
    cache_pass = BlockCache().begin([("a", 0)], [1], [0.1], "image")
    with pytest.raises(RuntimeError, match="boom"), cached_blocks(unet, cache_pass):
        wrapped = getattr(*cacheable_blocks(unet)[0][:2])
        assert wrapped.inner is before[0] and wrapped.resnets is before[0].resnets
        raise RuntimeError("boom")
    assert [getattr(parent, name) for parent, name, _ in cacheable_blocks(unet)] == before


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_an_unchanged_image_reuses_its_tokens_in_a_packed_forward_and_its_batch_mate_stays_exact(family):
    model = load_pipeline(f"tiny-{family}").transformer
    shapes = [(8, 8), (8, 12)] if family == "sd3" else [(4, 4), (4, 6)]
    reference = reference_sd3 if family == "sd3" else reference_flux
    inputs = make_inputs(family, shapes)
    cache = BlockCache(BlockCacheConfig(max_reuse=3))
    request = CachedForward(cache, (("a", 0), ("b", 0)), (0.05, 0.05))
    with torch.no_grad():
        first = run_packed(family, model, {**inputs, "cache": request})
        assert max(max_diffs_of(first, model, inputs, reference)) <= TOL
        g = torch.Generator().manual_seed(5)
        inputs["samples"] = [inputs["samples"][0], torch.randn(inputs["samples"][1].shape, generator=g)]
        again = run_packed(family, model, {**inputs, "cache": request})
        assert max_diffs_of(again, model, inputs, reference)[1] <= TOL
        tokens = shapes[0][0] * shapes[0][1] // (4 if family == "sd3" else 1)  # SD3 patches 2x2 latents per token
        assert cache.reused == tokens * len(cacheable_blocks(model))
        assert (again[0] - first[0]).abs().max() <= 1e-6  # its text rows were computed again, on the same inputs
        # nothing changed: every token reused, the blocks run on their text rows alone
        third = run_packed(family, model, {**inputs, "cache": request})
    assert [(t - a).abs().max() <= 1e-6 for t, a in zip(third, again)] == [True, True]


def max_diffs_of(outs, model, inputs, reference) -> list[float]:
    return [(o - reference(model, inputs, i)).abs().max().item() for i, o in enumerate(outs)]


@pytest.mark.parametrize("name", ["tiny-wan", "tiny-wan-i2v"])
@pytest.mark.parametrize("shapes", [[(2, 4, 4), (3, 4, 6)], [(2, 4, 4), (2, 4, 4)]], ids=["tokens", "whole-clips"])
def test_an_unchanged_clip_is_reused_in_a_wan_forward_and_its_batch_mate_stays_exact(shapes, name):
    """Wan: per token in a packed forward of clips of two shapes, per clip in the model's own batch;
    image-to-video with each clip's first frame's states."""
    from gouache.runner.pack_wan import packed_wan_forward

    model = load_pipeline(name).transformer
    g = torch.Generator().manual_seed(0)
    samples = [torch.randn(model.config.in_channels, *shape, generator=g) for shape in shapes]
    timestep, text = torch.tensor([500.0, 400.0]), torch.randn(2, 512, model.config.text_dim, generator=g)
    image = None if model.config.image_dim is None else torch.randn(2, 17, model.config.image_dim, generator=g)
    cache = BlockCache(BlockCacheConfig(max_reuse=3))
    request = CachedForward(cache, (("a", 0), ("b", 0)), (0.05, 0.05))

    def own(i, x):
        return model(hidden_states=x[None], timestep=timestep[i:i + 1], encoder_hidden_states=text[i:i + 1],
                     encoder_hidden_states_image=None if image is None else image[i:i + 1], return_dict=False)[0][0]

    with torch.no_grad():
        first = packed_wan_forward(model, samples, timestep, text, cache=request, encoder_hidden_states_image=image)
        assert max((o - own(i, x)).abs().max() for i, (o, x) in enumerate(zip(first, samples))) <= TOL
        samples = [samples[0], torch.randn(samples[1].shape, generator=g)]  # a's input again, b's new
        again = packed_wan_forward(model, samples, timestep, text, cache=request, encoder_hidden_states_image=image)
        assert (again[1] - own(1, samples[1])).abs().max() <= TOL
        units = shapes[0][0] * shapes[0][1] * shapes[0][2] // 4 if shapes[0] != shapes[1] else 1  # 2x2 a token
        assert cache.reused == units * len(cacheable_blocks(model))
        assert (again[0] - first[0]).abs().max() <= 1e-6
