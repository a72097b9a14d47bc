"""Qwen-Image (`gouache.runner.families.qwen`): what the family adds beside the exactness, edit,
LoRA and export tests that walk every family. Its tokenizer splits the prompt template's prefix
into the tokens the pipeline drops; prompts of other lengths and sizes of one packed shape share
a step, each equal to itself alone; a compiled step equals the eager one on the graph warmed at
start whatever the prompt's length; what it does not serve is refused at start."""

import pytest
import torch

from gouache.config import BlockCacheConfig, CompileConfig, EngineConfig, ModelConfig, SchedulerConfig, TemplateConfig
from gouache.engine.build import build_engine
from gouache.request import ImageRequest
from gouache.runner.model_runner import ModelRunner
from gouache.sched.plan import Batch

MODEL = "tiny-qwen-image"


def test_the_template_prefix_is_the_tokens_the_pipeline_drops(pipes):
    pipe = pipes(MODEL)
    prefix = pipe.prompt_template_encode.split("{}")[0]
    assert len(pipe.tokenizer(prefix)["input_ids"]) == pipe.prompt_template_encode_start_idx == 34
    embeds, mask = pipe.encode_prompt("a red fox", device="cpu")
    suffix = pipe.prompt_template_encode.split("{}")[1]
    assert mask is None and embeds.shape[1] == len(pipe.tokenizer("a red fox" + suffix)["input_ids"])


def run(runner: ModelRunner, requests: list[ImageRequest], steps: int = 2, reports: list | None = None
        ) -> dict[str, torch.Tensor]:
    """Latents after `steps` patched steps of all `requests`; each step's compile report to `reports`."""
    for r in requests:
        runner.prepare(r)
    ids = tuple(r.request_id for r in requests)
    for _ in range(steps):
        out = runner.execute(Batch(ids, patched=True))
        assert not out.failed and sorted(out.request_ids) == sorted(ids)
        if reports is not None:
            reports.append(out.compile)
    return {rid: runner.states.pop(rid).latents for rid in ids}


def test_prompts_of_other_lengths_and_transposed_sizes_in_one_step_equal_each_alone(pipes):
    """The text of one forward is padded to its longest prompt and masked; 96x64 and 64x96 (one
    packed shape, two token grids) run apart."""
    runner = ModelRunner(pipes(MODEL))
    mix = [ImageRequest("short", "a fox", 96, 64, 2, 4.0, seed=1),
           ImageRequest("long", "a red fox in a field of tall grass at dawn", 96, 64, 2, 4.0, seed=2,
                        negative_prompt="blurry, dark"),
           ImageRequest("tall", "a fox", 64, 96, 2, 1.0, seed=3)]
    together = run(runner, mix)
    for r in mix:
        assert (together[r.request_id] - run(runner, [r])[r.request_id]).abs().max() <= 1e-4, r.request_id


def test_a_compiled_step_equals_the_eager_one_on_the_warmed_graph(pipes):
    """Under --compile the text pads to a bucket of tokens, so prompts of other lengths than the
    warm-up's meet its graph (no compile while serving)."""
    pipe = pipes(MODEL)
    compiled = ModelRunner(pipe, compile=CompileConfig(enabled=True, buckets=(4,)))
    compiled.warm_up(64)
    assert compiled.family.compiled.take_report().graphs == 1
    mix = [ImageRequest("a", "a red circle", 64, 64, 2, 4.0, seed=1),
           ImageRequest("b", "a much longer prompt than the other one", 64, 64, 2, 1.0, seed=2)]
    reports = []
    ours = run(compiled, mix, reports=reports)
    assert [(r.compiled, r.graphs, r.eager) for r in reports] == [(1, 0, {})] * 2
    eager = run(ModelRunner(pipe), mix)
    for rid, latents in eager.items():
        assert (ours[rid] - latents).abs().max() <= 1e-4, rid


@pytest.mark.parametrize(("flag", "config"), [
    ("--block-cache", EngineConfig(block_cache=BlockCacheConfig(threshold=0.1))),
    ("--template-cache", EngineConfig(templates=TemplateConfig(default=True))),
])
def test_what_the_family_does_not_serve_is_refused_at_start(flag, config):
    with pytest.raises(ValueError, match=f"{flag} would be ignored: qwenimage models serve no"):
        build_engine(ModelConfig(MODEL), config, SchedulerConfig(policy="orca", max_batch_size=2))


def test_sequence_parallelism_is_refused_at_start():
    with pytest.raises(ValueError, match="Ulysses supports .* not QwenImageTransformer2DModel"):
        build_engine(ModelConfig(MODEL), EngineConfig(devices=2, executor="multiproc"),
                     SchedulerConfig(policy="fixed-sp-2", max_batch_size=2))
