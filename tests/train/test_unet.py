"""The shapes UNets' training target agrees with what the served pipeline's sampler reads."""

import pytest
import torch

from gouache.models import trained
from gouache.models.zoo import shapes_sd
from gouache.train.unet import BATCH, NOISE_DRAWS, encoded_batch, foreground_weights, velocity


@pytest.fixture(scope="module")
def pipe():
    torch.manual_seed(0)
    return shapes_sd(trained.vae(), trained.text_encoder(with_projection=False, layers=2), trained.unet())


@pytest.mark.parametrize("index", [0, 7, 19])
def test_a_perfect_prediction_of_the_training_target_gives_the_sampler_the_clean_latents(pipe, index):
    scheduler = pipe.scheduler
    scheduler.set_timesteps(20)
    t = scheduler.timesteps[index]
    generator = torch.Generator().manual_seed(index)
    latents, noise = torch.randn(2, 4, 8, 8, generator=generator), torch.randn(2, 4, 8, 8, generator=generator)
    alpha = scheduler.alphas_cumprod[int(t)].expand(2)
    noisy = alpha.sqrt().view(-1, 1, 1, 1) * latents + (1 - alpha).sqrt().view(-1, 1, 1, 1) * noise
    sigma = ((1 - alpha[0]) / alpha[0]).sqrt()
    sample = noisy * (1 + sigma**2).sqrt()  # the Euler sampler's latents: clean + sigma * noise
    assert torch.allclose(scheduler.scale_model_input(sample, t), noisy, atol=1e-5)
    clean = scheduler.step(velocity(latents, noise, alpha), t, sample).pred_original_sample
    assert torch.allclose(clean, latents, atol=1e-3)


def test_the_first_step_samples_pure_noise(pipe):
    """Zero terminal SNR: the layout must come from the prompt, as nothing of the image is left."""
    pipe.scheduler.set_timesteps(20)
    assert int(pipe.scheduler.timesteps[0]) == 999
    assert pipe.scheduler.alphas_cumprod[999] < 1e-6


def test_each_encoded_image_is_drawn_at_several_noise_levels(pipe):
    pixels, latents, captions = encoded_batch(pipe.vae, 0, 3, torch.Generator().manual_seed(0))
    images = BATCH // NOISE_DRAWS
    assert len(pixels) == len(latents) == len(captions) == BATCH
    assert (torch.equal(latents[:images], latents[images:2 * images])
            and captions[:images] == captions[images:2 * images])
    assert torch.equal(pixels[:images], pixels[images:])
    assert latents.shape[1] == 4 and not torch.equal(latents[0], latents[1])


def test_foreground_weights_mark_the_latent_pixels_under_a_shape():
    pixels = torch.ones(1, 3, 64, 64)
    pixels[:, :, 8:16, 40:56] = -1.0  # one black shape on white
    weights = foreground_weights(pixels, (8, 8))
    expected = torch.ones(8, 8)
    expected[1, 5:7] = 5.0
    assert torch.equal(weights[0, 0], expected)
