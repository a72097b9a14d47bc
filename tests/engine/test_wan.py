"""Wan (`gouache.runner.families.wan`): the engine's clips equal `WanPipeline`'s seed for seed
(latents within 1e-4, frames within 2/255), alone and stepped beside clips of other lengths and
sizes that join and leave at other steps; a finished clip leaves the engine as an MP4."""

import asyncio
import io
import re
import time

import av
import numpy as np
import pytest
import torch
from diffusers.models.transformers.transformer_wan import WanAttnProcessor, WanRotaryPosEmbed
from PIL import Image

from gouache.attention import attention_modules
from gouache.config import EngineConfig, SchedulerConfig
from gouache.engine.client import AsyncEngine
from gouache.engine.video import encode_clip
from gouache.errors import InvalidRequestError
from gouache.outputs import ImageEvent, PartialImageEvent
from gouache.request import ImageRequest, RequestState
from gouache.runner.describe import model_info
from gouache.runner.model_runner import ModelRunner
from gouache.runner.pack_wan import packed_wan_forward, patches, unpatch
from gouache.sched.costmodel import BatchCostModel
from gouache.sched.plan import Batch
from gouache.sched.policies import make_policy
from gouache.uploads import Upload
from tests.engine.conftest import DTYPE
from tests.engine.test_exactness import TOLERANCE, run_engine

MODEL = "tiny-wan"


def clip(rid: str, seed: int, steps: int, frames: int = 5, width: int = 32, height: int = 32, guidance: float = 5.0,
         prompt: str = "a red fox running", **fields):
    return ImageRequest(rid, prompt, width, height, steps, guidance, seed, num_frames=frames, **fields)


def reference(pipe, r: ImageRequest, output_type: str = "latent"):
    return pipe(prompt=r.prompt, negative_prompt=r.negative_prompt, height=r.height, width=r.width,
                num_frames=r.num_frames, num_inference_steps=r.num_inference_steps, guidance_scale=r.guidance_scale,
                generator=torch.Generator().manual_seed(r.seed), output_type=output_type).frames


def test_a_clips_shape_carries_its_frames_and_an_images_does_not():
    assert RequestState.of(clip("c", 0, 2, frames=9, width=48), 2).resolution == (32, 48, 9)
    assert RequestState.of(clip("i", 0, 2, frames=1, width=48), 2).resolution == (32, 48)


@pytest.mark.parametrize("policy", ["orca", "patched"])
def test_engine_matches_the_pipeline_alone_and_beside_clips_of_other_lengths_and_sizes(pipes, policy):
    pipe = pipes(MODEL)
    alone, main = clip("alone", seed=7, steps=4), clip("main", seed=7, steps=4)
    others = {
        0: [clip("early", seed=1, steps=2, frames=9, prompt="blue sky"), main],
        1: [clip("wide", seed=2, steps=3, width=48, frames=1), clip("long", seed=4, steps=2, frames=13, height=48)],
        2: [clip("nocfg", seed=3, steps=3, guidance=1.0)],
    }
    solo = run_engine(pipe, {0: [alone]}, policy)["alone"]
    batched = run_engine(pipe, others, policy)
    expected = reference(pipe, alone)
    assert expected.shape == (1, 16, 2, 4, 4) and expected.abs().mean() > 0.1
    errors = {"alone": (solo - expected).abs().max().item(), "main": (batched["main"] - expected).abs().max().item()}
    for r in [r for group in others.values() for r in group if r.request_id != "main"]:
        errors[r.request_id] = (batched[r.request_id] - reference(pipe, r)).abs().max().item()
    assert max(errors.values()) <= TOLERANCE[DTYPE], errors


def test_a_packed_forward_gives_each_clip_its_own_forwards_prediction(pipes):
    transformer = pipes(MODEL).transformer
    generator = torch.Generator().manual_seed(0)
    shapes = [(2, 4, 4), (3, 4, 6), (2, 4, 4), (1, 6, 4), (3, 4, 6)]  # latent frames, height, width
    samples = [torch.randn(16, *shape, generator=generator) for shape in shapes]
    timestep = torch.tensor([999.0, 500.0, 10.0, 700.0, 250.0])
    text = torch.randn(len(shapes), 512, transformer.config.text_dim, generator=generator)
    calls = []
    hook = transformer.patch_embedding.register_forward_hook(lambda *_: calls.append(1))
    try:
        packed = packed_wan_forward(transformer, samples, timestep, text)
    finally:
        hook.remove()
    assert len(calls) == 1
    for i, (x, out) in enumerate(zip(samples, packed)):
        own = transformer(hidden_states=x[None], timestep=timestep[i:i + 1], encoder_hidden_states=text[i:i + 1],
                          return_dict=False)[0][0]
        assert out.shape == x.shape and (out - own).abs().max() <= 1e-5 * own.abs().max(), i
    # the model is its own again
    assert all(type(m.processor) is WanAttnProcessor for _, m in attention_modules(transformer))
    assert type(transformer.rope) is WanRotaryPosEmbed


def test_a_clips_patches_come_back_as_its_latents():
    latents = torch.arange(16 * 3 * 4 * 6, dtype=torch.float32).reshape(16, 3, 4, 6)
    tokens = patches(latents, (1, 2, 2))
    assert tokens.shape == (3 * 2 * 3, 16, 1, 2, 2)
    assert torch.equal(tokens[4, :, 0], latents[:, 0, 2:4, 2:4])  # frame 0, token row 1, column 1
    assert torch.equal(unpatch(tokens, (3, 2, 3)), latents)


def test_a_packed_step_of_clips_of_three_shapes_is_one_forward(pipes):
    pipe = pipes(MODEL)
    runner = ModelRunner(pipe)
    requests = [clip("a", 1, 2), clip("b", 2, 2, frames=9, width=48), clip("c", 3, 2, frames=1, height=48)]
    for r in requests:
        runner.prepare(r)
    calls = []
    hook = pipe.transformer.patch_embedding.register_forward_hook(lambda *_: calls.append(1))
    try:
        runner.execute(Batch(tuple(r.request_id for r in requests), patched=True))
        packed = len(calls)
        runner.execute(Batch(tuple(r.request_id for r in requests)))
    finally:
        hook.remove()
    assert (packed, len(calls) - packed) == (1, 3)


def test_decoded_frames_match_the_pipelines(pipes):
    pipe = pipes(MODEL)
    runner = ModelRunner(pipe)
    requests = [clip("clip", seed=5, steps=2, frames=9, width=48), clip("still", seed=6, steps=2, frames=1)]
    for r in requests:
        runner.prepare(r)
    for _ in range(2):
        runner.execute(Batch(tuple(r.request_id for r in requests)))
    states = [runner.states[r.request_id] for r in requests]
    pixels = runner.family.decode_many(states, [s.latents for s in states])
    assert pixels[0].shape == (9, 32, 48, 3) and pixels[1].shape == (32, 32, 3)
    for r, got in zip(requests, pixels):
        expected = reference(pipe, r, "np")[0]  # float [F, H, W, 3] in [0, 1]
        frames = got if r.num_frames > 1 else got[None]
        assert np.abs(frames.astype(np.float32) / 255 - expected).max() <= 2 / 255, r.request_id
    assert pixels[0].std() > 10  # not a flat clip


def decoded(mp4: bytes) -> tuple[np.ndarray, float]:
    """An MP4's frames, uint8 [F, H, W, 3], and its frame rate."""
    with av.open(io.BytesIO(mp4)) as container:
        rate = float(container.streams.video[0].average_rate)
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)]), rate


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else float(10 * np.log10(255 ** 2 / mse))


def test_a_clip_encodes_to_an_mp4_of_its_frames_and_rate_with_a_first_frame_thumbnail():
    ramp = np.linspace(0, 255, 48, dtype=np.float32)
    frames = np.stack([np.stack([np.roll(ramp, 4 * k)[None].repeat(32, 0)] * 3, -1) for k in range(9)])
    mp4, thumbnail = encode_clip(frames.astype(np.uint8), 12)
    got, rate = decoded(mp4)
    assert got.shape == (9, 32, 48, 3) and rate == 12
    assert psnr(got, frames) > 35
    assert psnr(np.asarray(Image.open(io.BytesIO(thumbnail)).convert("RGB")), frames[0]) > 30


def test_the_engine_delivers_a_clip_as_mp4_beside_an_image_request_and_previews_its_first_frame(pipes):
    pipe = pipes(MODEL)
    engine = AsyncEngine(pipe, model_info(pipe, MODEL), EngineConfig(), make_policy(SchedulerConfig(policy="orca")))
    requests = [clip("c-0", seed=3, steps=4, frames=9, width=48), clip("s-0", seed=4, steps=2, frames=1)]
    requests[0].partial_images, requests[0].fps = 1, 8

    async def scenario():
        await engine.start()
        handles = [await engine.submit([r]) for r in requests]
        events = [[e async for e in handle] for handle in handles]
        await engine.aclose()
        return events

    clip_events, still_events = asyncio.run(scenario())
    [video] = [e for e in clip_events if isinstance(e, ImageEvent)]
    [preview] = [e for e in clip_events if isinstance(e, PartialImageEvent)]
    frames, rate = decoded(video.image)
    assert frames.shape == (9, 32, 48, 3) and rate == 8
    assert Image.open(io.BytesIO(preview.image)).size == (48, 32)
    assert Image.open(io.BytesIO(video.thumbnail)).size == (48, 32)
    # the pipeline's frames through the same encoder (random weights draw noise, which 4:2:0
    # chroma blurs: the clip's own PSNR says little)
    expected, _ = decoded(encode_clip((reference(pipe, requests[0], "np")[0] * 255).round().astype(np.uint8), 8)[0])
    assert psnr(frames, expected) > 40
    [still] = [e for e in still_events if isinstance(e, ImageEvent)]
    assert Image.open(io.BytesIO(still.image)).size == (32, 32) and still.thumbnail == b""


def test_a_deadline_policy_plans_clips_by_length_and_refuses_a_length_its_cost_model_never_saw(pipes):
    pipe = pipes(MODEL)
    priced = BatchCostModel([(32, 32, 5), (32, 48, 9)])
    for composition in ({(32, 32, 5): 1}, {(32, 48, 9): 1}, {(32, 32, 5): 1, (32, 48, 9): 1}):
        priced.record(composition, 0.01 * sum(composition.values()))
    engine = AsyncEngine(pipe, model_info(pipe, MODEL), EngineConfig(),
                         make_policy(SchedulerConfig(policy="patched-slo"), priced), predictor=priced)
    assert engine.info.sizes == ((32, 32, 5), (32, 48, 9))
    unpriced, fine = clip("u", 1, 2, frames=9), [clip("a", 2, 2), clip("b", 3, 2, frames=9, width=48)]
    for r in fine:
        r.slo_ms, r.arrival_time = 60_000, time.monotonic()

    async def scenario():
        await engine.start()
        with pytest.raises(InvalidRequestError) as refused:
            await engine.submit([unpriced])
        handles = [await engine.submit([r]) for r in fine]
        done = [[e async for e in handle] for handle in handles]
        await engine.aclose()
        return refused.value, done

    refused, done = asyncio.run(scenario())
    assert refused.param == "size" and "prices only 32x32x5, 48x32x9, not 32x32x9" in str(refused)
    assert all(any(isinstance(e, ImageEvent) for e in events) for events in done), done


@pytest.mark.parametrize("patched", [False, True], ids=["per-clip", "per-token"])
def test_the_block_cache_reuses_clips_or_tokens_in_a_step_of_mixed_clips_and_keeps_exact_clips_exact(pipes, patched,
                                                                                                     caplog):
    from gouache.config import BlockCacheConfig

    runner = ModelRunner(pipes(MODEL), block_cache=BlockCacheConfig(max_reuse=2))
    requests = [clip("cached", 1, 6, block_cache=0.5), clip("long", 2, 6, frames=9, width=48, block_cache=0.5),
                clip("exact", 3, 6, frames=5, height=48, block_cache=0.0)]
    for r in requests:
        runner.prepare(r)
    ids = tuple(r.request_id for r in requests)
    for _ in range(6):
        out = runner.execute(Batch(ids, patched=patched))
        assert not out.failed and sorted(out.request_ids) == sorted(ids)
    assert runner.cache.reused > 0 and "retrying them one by one" not in caplog.text  # one forward did them all
    alone = ModelRunner(pipes(MODEL))
    alone.prepare(clip("exact", 3, 6, frames=5, height=48))
    for _ in range(6):
        alone.execute(Batch(("exact",)))
    assert (runner.states["exact"].latents - alone.states["exact"].latents).abs().max() <= TOLERANCE[DTYPE]


@pytest.mark.parametrize("model", [MODEL, "tiny-wan-i2v"])
def test_compiled_clip_steps_run_the_warmed_row_graph_and_equal_eager_ones(pipes, model):
    from gouache.config import CompileConfig

    config = CompileConfig(enabled=True, sizes=((32, 48, 9),), buckets=(2, 4), backend="eager", background=False)
    compiled, eager = ModelRunner(pipes(model), compile=config), ModelRunner(pipes(model))
    compiled.warm_up(32)
    requests = [clip("a", 1, 3, frames=9, width=48), clip("b", 2, 3, frames=9, width=48, prompt="a blue sky")]
    reports = []
    for runner in (compiled, eager):
        for r in requests:
            runner.prepare(r)
        for _ in range(3):
            reports.append(runner.execute(Batch(("a", "b"))).compile)
    assert [r.compiled for r in reports[:3]] == [1, 1, 1] and sum(r.recompiles for r in reports[:3]) == 0
    for rid in ("a", "b"):
        assert (compiled.states[rid].latents - eager.states[rid].latents).abs().max() <= TOLERANCE[DTYPE]
    compiled.prepare(clip("c", 3, 2, frames=5))
    compiled.prepare(clip("d", 4, 2, frames=9, width=48))
    mixed = compiled.execute(Batch(("c", "d"), patched=True)).compile  # a packed forward of clips: eager, counted
    assert mixed.eager == {"mixed_sizes": 1}


@pytest.mark.parametrize(("model", "size", "why"), [
    ("tiny-sd3", (64, 64, 5), "--compile-sizes 64x64x5: a clip's size, for a video model"),
    (MODEL, (32, 32, 6), "--compile-sizes 32x32x6: a clip has 1 + a multiple of 4 frames"),
])
def test_compile_sizes_of_clips_are_refused_at_start_where_the_model_cannot_make_them(model, size, why):
    from gouache.config import CompileConfig, ModelConfig
    from gouache.engine.build import build_engine

    config = EngineConfig(compile=CompileConfig(enabled=True, sizes=(size,), backend="eager"))
    with pytest.raises(ValueError, match=re.escape(why)):
        build_engine(ModelConfig(model), config, SchedulerConfig(policy="orca", max_batch_size=2))


def test_wan_2_2s_second_expert_and_per_token_timesteps_are_refused_not_served_wrong(pipes):
    from diffusers import WanImageToVideoPipeline, WanPipeline

    from gouache.models.wan import tiny_wan_transformer

    pipe = pipes(MODEL)
    parts = {name: getattr(pipe, name) for name in ("tokenizer", "text_encoder", "vae", "scheduler", "transformer")}
    for extra in ({"transformer_2": tiny_wan_transformer(), "boundary_ratio": 0.875}, {"expand_timesteps": True}):
        with pytest.raises(ValueError, match="Wan 2.2's"):
            ModelRunner(WanPipeline(**parts, **extra))
    i2v = pipes("tiny-wan-i2v")
    parts = {name: getattr(i2v, name) for name in ("tokenizer", "text_encoder", "vae", "scheduler", "transformer")}
    with pytest.raises(ValueError, match="no CLIP image encoder"):  # Wan 2.2 A14B's image-to-video
        ModelRunner(WanImageToVideoPipeline(**parts))
    flf2v = tiny_wan_transformer(image_to_video=True)
    flf2v.register_to_config(pos_embed_seq_len=2 * 17)
    with pytest.raises(ValueError, match="first-last-frame"):
        ModelRunner(WanImageToVideoPipeline(**{**parts, "transformer": flf2v}, image_encoder=i2v.image_encoder,
                                            image_processor=i2v.image_processor))


# -- image-to-video (`WanImageToVideoFamily`) ------------------------------------------------------

I2V = "tiny-wan-i2v"


def first_frame(seed: int, width: int, height: int) -> Upload:
    """A smooth random picture at the clip's size (the engine's upload; the pipeline resizes none)."""
    coarse = np.random.default_rng(seed).integers(0, 256, (4, 4, 3), dtype=np.uint8)
    return Upload(np.asarray(Image.fromarray(coarse).resize((width, height), Image.Resampling.BILINEAR)))


def i2v_reference(pipe, r: ImageRequest, upload: Upload, output_type: str = "latent"):
    return pipe(image=Image.fromarray(upload.image), prompt=r.prompt, negative_prompt=r.negative_prompt,
                height=r.height, width=r.width, num_frames=r.num_frames, num_inference_steps=r.num_inference_steps,
                guidance_scale=r.guidance_scale, generator=torch.Generator().manual_seed(r.seed),
                output_type=output_type).frames


@pytest.mark.parametrize("policy", ["orca", "patched"])
def test_image_to_video_matches_its_pipeline_beside_clips_of_other_lengths_sizes_and_first_frames(pipes, policy):
    pipe = pipes(I2V)
    main = clip("main", seed=7, steps=3)
    others = [clip("long", seed=1, steps=2, frames=9, width=48, prompt="blue sky"),
              clip("still", seed=2, steps=2, frames=1, height=48), clip("nocfg", seed=3, steps=2, guidance=1.0)]
    uploads = {r.request_id: first_frame(k, r.width, r.height) for k, r in enumerate([main, *others])}
    pair = {r.request_id: (r, {"upload": uploads[r.request_id]}) for r in [main, *others]}
    batched = run_engine(pipe, {0: [pair["long"], pair["main"]], 1: [pair["still"], pair["nocfg"]]}, policy)
    errors = {rid: (batched[rid] - i2v_reference(pipe, r, uploads[rid])).abs().max().item()
              for rid, (r, _) in pair.items()}
    assert max(errors.values()) <= TOLERANCE[DTYPE], errors
    # the first frame steers the clip: another one gives other latents
    other = run_engine(pipe, {0: [(main, {"upload": first_frame(9, 32, 32)})]}, policy)["main"]
    assert (other - batched["main"]).abs().max() > 0.01


def test_image_to_video_decoded_frames_match_the_pipelines(pipes):
    pipe = pipes(I2V)
    runner = ModelRunner(pipe)
    r = clip("clip", seed=5, steps=2, frames=5, width=48)
    upload = first_frame(0, 48, 32)
    runner.prepare(r, upload)
    for _ in range(2):
        runner.execute(Batch(("clip",)))
    state = runner.states["clip"]
    [got] = runner.family.decode_many([state], [state.latents])
    expected = i2v_reference(pipe, r, upload, "np")[0]
    assert got.shape == (5, 32, 48, 3)
    assert np.abs(got.astype(np.float32) / 255 - expected).max() <= 2 / 255
