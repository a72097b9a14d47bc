"""Z-Image (`gouache.runner.families.zimage`): what the family adds beside the exactness, edit,
LoRA and export tests that walk every family. Its forward takes any mix of sizes and prompt
lengths as one call; guidance above 0 runs CFG (0 does not), equal to the pipeline's; what it
does not serve is refused at start."""

import pytest
import torch

from gouache.config import BlockCacheConfig, CompileConfig, EngineConfig, ModelConfig, SchedulerConfig
from gouache.engine.build import build_engine
from gouache.request import ImageRequest
from gouache.runner.describe import model_info
from gouache.runner.model_runner import ModelRunner
from gouache.sched.plan import Batch

MODEL = "tiny-zimage"


def test_a_patched_step_of_three_sizes_is_one_forward_each_request_equal_to_itself_alone(pipes):
    pipe = pipes(MODEL)
    runner = ModelRunner(pipe)
    mix = [ImageRequest("wide", "a fox", 96, 64, 2, 4.0, seed=1),
           ImageRequest("tall", "a red fox in tall grass", 64, 96, 2, 0.0, seed=2),
           ImageRequest("big", "a fox", 128, 128, 2, 2.0, seed=3, negative_prompt="blurry")]
    calls = []
    hook = pipe.transformer.register_forward_hook(lambda *args: calls.append(1))
    try:
        for r in mix:
            runner.prepare(r)
        for _ in range(2):
            runner.execute(Batch(tuple(r.request_id for r in mix), patched=True))
    finally:
        hook.remove()
    assert len(calls) == 2  # one forward a step
    together = {r.request_id: runner.states.pop(r.request_id).latents for r in mix}
    for r in mix:
        runner.prepare(r)
        for _ in range(2):
            runner.execute(Batch((r.request_id,)))
        assert (together[r.request_id] - runner.states.pop(r.request_id).latents).abs().max() <= 1e-4, r.request_id


def test_guidance_zero_runs_no_cfg_and_equals_the_pipeline(pipes):
    pipe = pipes(MODEL)
    info = model_info(pipe, MODEL)
    assert (info.cfg_rows(0.0), info.cfg_rows(0.5)) == (1, 2)
    runner = ModelRunner(pipe)
    request = ImageRequest("turbo", "a red fox", 64, 64, 3, 0.0, seed=4)
    runner.prepare(request)
    assert runner.states["turbo"].rows == 1
    for _ in range(3):
        runner.execute(Batch(("turbo",)))
    expected = pipe(prompt="a red fox", height=64, width=64, num_inference_steps=3, guidance_scale=0.0,
                    generator=torch.Generator().manual_seed(4), output_type="latent").images
    assert (runner.states["turbo"].latents - expected).abs().max() <= 1e-4


@pytest.mark.parametrize(("flag", "config"), [
    ("--block-cache would be ignored: zimage models serve no",
     EngineConfig(block_cache=BlockCacheConfig(threshold=0.1))),
    ("--compile is not served for zimage models", EngineConfig(compile=CompileConfig(enabled=True))),
])
def test_what_the_family_does_not_serve_is_refused_at_start(flag, config):
    with pytest.raises(ValueError, match=flag):
        build_engine(ModelConfig(MODEL), config, SchedulerConfig(policy="orca", max_batch_size=2))
