"""Qwen-Image (`gouache.runner.families.qwen`): what the family adds beside the exactness, edit,
LoRA and export tests that walk every family. Its tokenizer splits the prompt templates' prefixes
into the tokens the pipelines drop; prompts of other lengths and sizes of one packed shape share
a step, each equal to itself alone; a compiled step equals the eager one on the graph warmed at
start whatever the prompt's length; what it does not serve is refused at start. Qwen-Image-Edit
and Edit-Plus: instruction edits of one image and of several equal their pipelines, a masked
edit QwenImageEditInpaintPipeline."""

import diffusers
import numpy as np
import pytest
import torch
from PIL import Image

from gouache.config import BlockCacheConfig, CompileConfig, EngineConfig, ModelConfig, SchedulerConfig, TemplateConfig
from gouache.engine.build import build_engine
from gouache.request import ImageRequest
from gouache.runner.model_runner import ModelRunner
from gouache.sched.plan import Batch
from gouache.uploads import EditMask, Upload

MODEL = "tiny-qwen-image"


def test_the_template_prefix_is_the_tokens_the_pipeline_drops(pipes):
    pipe = pipes(MODEL)
    prefix = pipe.prompt_template_encode.split("{}")[0]
    assert len(pipe.tokenizer(prefix)["input_ids"]) == pipe.prompt_template_encode_start_idx == 34
    embeds, mask = pipe.encode_prompt("a red fox", device="cpu")
    suffix = pipe.prompt_template_encode.split("{}")[1]
    assert mask is None and embeds.shape[1] == len(pipe.tokenizer("a red fox" + suffix)["input_ids"])
    edit = pipes("tiny-qwen-image-edit")
    prefix = edit.prompt_template_encode.split("<|vision_start|>")[0]
    assert len(edit.tokenizer(prefix)["input_ids"]) == edit.prompt_template_encode_start_idx == 64


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


@pytest.mark.slow
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


def uploads() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"wide": rng.integers(0, 255, (64, 96, 3), dtype=np.uint8),
            "other": rng.integers(0, 255, (80, 64, 3), dtype=np.uint8)}


def edit_reference(pipe, request: ImageRequest, images: list[np.ndarray]) -> torch.Tensor:
    pictures = [Image.fromarray(i) for i in images]
    return pipe(image=pictures if len(pictures) > 1 else pictures[0], prompt=request.prompt, negative_prompt=" ",
                true_cfg_scale=request.guidance_scale, height=request.height, width=request.width,
                num_inference_steps=request.num_inference_steps, generator=torch.Generator().manual_seed(request.seed),
                output_type="latent").images


@pytest.mark.slow
def test_instruction_edits_of_other_sizes_equal_qwen_image_edit_in_one_step(pipes):
    """Each upload is read by the VL encoder and enters as reference tokens at a megapixel: edits
    of two sizes share a patched step, each equal to QwenImageEditPipeline."""
    from tests.engine.test_exactness import run_engine

    pipe, images = pipes("tiny-qwen-image-edit"), uploads()
    wide = ImageRequest("wide", "make it blue", 96, 64, 2, 4.0, seed=1, image=b"-")
    tall = ImageRequest("tall", "make it red", 64, 80, 2, 4.0, seed=2, image=b"-")
    arrivals = {0: [(wide, {"upload": Upload(images["wide"])}), (tall, {"upload": Upload(images["other"])})]}
    latents = run_engine(pipe, arrivals, "patched")
    for request, image in ((wide, images["wide"]), (tall, images["other"])):
        assert (latents[request.request_id] - edit_reference(pipe, request, [image])).abs().max() <= 1e-4


@pytest.mark.slow
def test_an_edit_of_two_images_equals_qwen_image_edit_plus(pipes):
    from tests.engine.test_exactness import run_engine

    pipe, images = pipes("tiny-qwen-image-edit-plus"), uploads()
    two = ImageRequest("two", "put the second in the first", 96, 64, 2, 4.0, seed=1, image=b"-")
    latents = run_engine(pipe, {0: [(two, {"upload": Upload(images["wide"], references=(images["other"],))})]})
    expected = edit_reference(pipe, two, [images["wide"], images["other"]])
    assert (latents["two"] - expected).abs().max() <= 1e-4
    one = edit_reference(pipe, two, [images["wide"]])
    assert (expected - one).abs().max() > 1e-3  # the second image counts


@pytest.mark.slow
def test_a_masked_edit_equals_qwen_image_edit_inpaint_at_its_megapixel(pipes):
    """The inpaint pipeline edits at its reference's megapixel size: there the engine's masked
    edit (the sampled original its reference) is that pipeline's."""
    from tests.engine.test_exactness import run_engine

    pipe = pipes("tiny-qwen-image-edit")
    image = np.random.default_rng(1).integers(0, 255, (1024, 1024, 3), dtype=np.uint8)
    mask = np.zeros((1024, 1024), np.float32)
    mask[256:768, 256:768] = 1.0
    request = ImageRequest("masked", "a cat", 1024, 1024, 2, 4.0, seed=3, image=b"-")
    latents = run_engine(pipe, {0: [(request, {"upload": Upload(image, EditMask(mask))})]})
    cls = diffusers.QwenImageEditInpaintPipeline
    inpaint = cls(**{k: v for k, v in pipe.components.items() if k in cls._get_signature_keys(cls)[0]})
    inpaint.set_progress_bar_config(disable=True)
    expected = inpaint(prompt="a cat", image=Image.fromarray(image),
                       mask_image=Image.fromarray((mask * 255).astype(np.uint8)),
                       negative_prompt=" ", true_cfg_scale=4.0, height=1024, width=1024, num_inference_steps=2,
                       strength=1.0, generator=torch.Generator().manual_seed(3), output_type="latent").images
    assert (latents["masked"] - expected).abs().max() <= 1e-4
