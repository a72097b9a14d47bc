import os

import pytest
import torch

from gouache.models.zoo import load_pipeline

# Where and in what precision the engine tests build their pipelines: the CPU in fp32 unless set,
# e.g. GOUACHE_TEST_DEVICE=cuda GOUACHE_TEST_DTYPE=bfloat16 (benchmarks/gpu.sh runs the exactness
# tests so).
DEVICE = os.environ.get("GOUACHE_TEST_DEVICE", "cpu")
DTYPE = os.environ.get("GOUACHE_TEST_DTYPE", "float32")
if DEVICE.startswith("cuda") and DTYPE == "float32":
    # fp32 as written: on an H200 (torch 2.11, TF32 convolutions on, torch's default) the UNets'
    # batched latents differed from the pipeline's alone by up to 7e-3 (one image alone: 0). TF32,
    # whose kernels a batch's size picks, is the suspect; the next GPU run of this file tells
    # (benchmarks/results/gpu/exactness_h200.md)
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False


@pytest.fixture(scope="session")
def pipes():
    """Built-in tiny pipelines, built once per test session."""
    cache = {}

    def get(name: str):
        if name not in cache:
            cache[name] = load_pipeline(name, DTYPE, DEVICE)
            cache[name].set_progress_bar_config(disable=True)
        return cache[name]

    return get


def guidance_kwargs(pipe, guidance: float, negative_prompt: str | None = None) -> dict:
    """A diffusers pipeline call's guidance arguments for a request's: Qwen-Image's true CFG takes
    `true_cfg_scale` and runs only with a negative prompt (the engine's default one, " ")."""
    from gouache.runner.describe import family_of
    from gouache.runner.families.qwen import DEFAULT_NEGATIVE

    if family_of(pipe) != "qwenimage":
        return {"guidance_scale": guidance, **({"negative_prompt": negative_prompt} if negative_prompt else {})}
    if guidance <= 1.0:
        return {"true_cfg_scale": guidance}
    return {"true_cfg_scale": guidance, "negative_prompt": negative_prompt or DEFAULT_NEGATIVE}


def as_state_latents(pipe, latents: torch.Tensor) -> torch.Tensor:
    """A pipeline's `output_type="latent"` result in the layout the engine's states hold: FLUX.2's
    pipeline returns its latents de-normalised and unpatchified, the others as they denoise them."""
    from gouache.runner.describe import family_of

    if family_of(pipe) != "flux2":
        return latents
    vae = pipe.vae
    mean = vae.bn.running_mean.view(1, -1, 1, 1)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
    return pipe._pack_latents((pipe._patchify_latents(latents) - mean) / std)
