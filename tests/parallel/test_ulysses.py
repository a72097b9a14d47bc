"""Ulysses sequence parallelism: SD3, Flux and Wan transformers at degree 2 and 4 equal degree 1.

Each test starts its gloo workers once and checks several things in them. Every rank writes the
max |Δ| of each of its comparisons, which the test asserts (and prints, under `pytest -s`); any
other failing check raises in its worker, which fails the test, and a hang fails it after
TIMEOUT_S.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from diffusers import FluxPipeline, FluxTransformer2DModel, SD3Transformer2DModel, WanTransformer3DModel

from gouache.models.zoo import SEED_DENOISER, load_pipeline, seeded
from gouache.parallel.ulysses import ulysses

pytestmark = pytest.mark.slow

TOL = 1e-4
TIMEOUT_S = 120  # per spawn
BATCH = 2  # rows differ in noise, timestep and text, as CFG rows do
TEXT_LEN = 7  # divides by no degree: the text shards unevenly
GRIDS = [(4, 4), (2, 8)]  # image tokens per side (SD3: latent / patch size): square and not
ODD_GRID = (3, 3)  # 9 image tokens: no degree divides them
CLIP_FRAMES = 3  # a Wan clip's latent frames: 3 x the grid's tokens (27 of ODD_GRID)


def flux_4_heads() -> FluxTransformer2DModel:
    """tiny-flux with 4 heads of 16 channels: tiny-flux's 2 heads do not go to degree 4."""
    return seeded(SEED_DENOISER, lambda: FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=1, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=4, joint_attention_dim=64, pooled_projection_dim=32, guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),
    ).eval())


def sd35_4_heads() -> SD3Transformer2DModel:
    """An SD3.5-style MMDiT: qk RMSNorm, and an image-only second attention (`attn2`) in block 0."""
    return seeded(SEED_DENOISER, lambda: SD3Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=16,
        num_attention_heads=4, joint_attention_dim=64, caption_projection_dim=64, pooled_projection_dim=64,
        pos_embed_max_size=16, dual_attention_layers=(0,), qk_norm="rms_norm",
    ).eval())


def wan_4_heads() -> WanTransformer3DModel:
    """A Wan 2.1 transformer with 4 heads of 16 channels (tiny-wan's 2 do not go to degree 4)."""
    return seeded(SEED_DENOISER, lambda: WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16, in_channels=16, out_channels=16,
        text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=64,
    ).eval())


MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "tiny-sd3": lambda: load_pipeline("tiny-sd3").transformer,  # 2 heads
    "tiny-flux": lambda: load_pipeline("tiny-flux").transformer,  # 2 heads
    "shapes-dit": lambda: load_pipeline("shapes-dit").transformer,  # 4 heads
    "flux-4-heads": flux_4_heads,
    "sd35-4-heads": sd35_4_heads,
    "tiny-wan": lambda: load_pipeline("tiny-wan").transformer,  # 2 heads
    "tiny-wan-i2v": lambda: load_pipeline("tiny-wan-i2v").transformer,  # its first frame's CLIP states attended too
    "wan-4-heads": wan_4_heads,
}


# --------------------------------------------------------------------------- inputs and forwards


def inputs(model: torch.nn.Module, grid: tuple[int, int], seed: int = 0) -> dict:
    """One forward's full inputs, as every rank passes them."""
    g, config, (h, w) = torch.Generator().manual_seed(seed), model.config, grid
    if isinstance(model, WanTransformer3DModel):  # a clip: text by cross-attention only, no pooled vector
        p_t, p_h, p_w = config.patch_size
        latents = torch.randn(BATCH, config.in_channels, CLIP_FRAMES * p_t, h * p_h, w * p_w, generator=g)
        text, image = TEXT_LEN, {}
        if config.image_dim is not None:  # image-to-video: 17 CLIP states, before the text's 512 rows (it splits there)
            text, image = 512, {"encoder_hidden_states_image": torch.randn(BATCH, 17, config.image_dim, generator=g)}
        return dict(hidden_states=latents, timestep=1000 * torch.rand(BATCH, generator=g),
                    encoder_hidden_states=torch.randn(BATCH, text, config.text_dim, generator=g), **image)
    common = dict(
        encoder_hidden_states=torch.randn(BATCH, TEXT_LEN, config.joint_attention_dim, generator=g),
        pooled_projections=torch.randn(BATCH, config.pooled_projection_dim, generator=g),
    )
    if isinstance(model, SD3Transformer2DModel):
        p = config.patch_size
        latents = torch.randn(BATCH, config.in_channels, h * p, w * p, generator=g)
        return dict(hidden_states=latents, timestep=1000 * torch.rand(BATCH, generator=g), **common)
    return dict(
        hidden_states=torch.randn(BATCH, h * w, config.in_channels, generator=g),
        timestep=torch.rand(BATCH, generator=g),  # Flux takes timesteps / 1000
        guidance=1 + 4 * torch.rand(BATCH, generator=g),
        txt_ids=torch.randint(0, 4, (TEXT_LEN, 3), generator=g).float(),
        img_ids=FluxPipeline._prepare_latent_image_ids(1, h, w, "cpu", torch.float32),
        **common,
    )


def with_residuals(model: torch.nn.Module, kwargs: dict, grid: tuple[int, int]) -> dict:
    """kwargs plus ControlNet residuals [B, image tokens, D] for every block kind the model has."""
    g, config = torch.Generator().manual_seed(1), model.config
    shape = (BATCH, grid[0] * grid[1], config.num_attention_heads * config.attention_head_dim)
    names = ["controlnet_block_samples", "controlnet_single_block_samples"]  # Flux's
    if isinstance(model, SD3Transformer2DModel):
        names = ["block_controlnet_hidden_states"]
    return kwargs | {name: [0.1 * torch.randn(shape, generator=g) for _ in range(2)] for name in names}


def forward(model: torch.nn.Module, kwargs: dict, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The model's output under `group`; checks that every rank of the group got the same one."""
    with torch.no_grad(), ulysses(model, group):
        out = model(**kwargs, return_dict=False)[0]
    if group is not None:
        everyone = [torch.empty_like(out) for _ in range(dist.get_world_size(group))]
        dist.all_gather(everyone, out, group=group)
        assert all(torch.equal(out, other) for other in everyone), "ranks disagree"
    return out


def delta(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def denoise(model: torch.nn.Module, kwargs: dict, groups: list[dist.ProcessGroup | None]) -> torch.Tensor:
    """Euler steps of the flow ODE from kwargs' latents; step i runs under groups[i]."""
    x, sigmas = kwargs["hidden_states"], torch.linspace(1, 0, len(groups) + 1)
    scale = 1 if isinstance(model, FluxTransformer2DModel) else 1000
    for group, sigma, after in zip(groups, sigmas, sigmas[1:]):
        velocity = forward(model, kwargs | {"hidden_states": x, "timestep": (sigma * scale).repeat(BATCH)}, group)
        x = x + (after - sigma) * velocity
    return x


def hooks(model: torch.nn.Module) -> list[tuple[str, list, list]]:
    return [(name, list(m._forward_hooks), list(m._forward_pre_hooks)) for name, m in model.named_modules()]


def check_restore(model: torch.nn.Module, group: dist.ProcessGroup) -> None:
    """After the context, also one whose forward raised, the model has its own processors,
    modules and hooks, and its forward is unchanged."""
    kwargs = inputs(model, GRIDS[0])
    before, processors = forward(model, kwargs), model.attn_processors
    modules, hooks_before = list(model.modules()), hooks(model)
    forward(model, kwargs, group)
    with pytest.raises(ValueError, match="must divide the image token count"):
        forward(model, inputs(model, ODD_GRID), group)
    assert model.attn_processors.keys() == processors.keys()
    assert all(model.attn_processors[name] is processor for name, processor in processors.items())
    after = list(model.modules())
    assert len(after) == len(modules) and all(a is b for a, b in zip(after, modules))
    assert hooks(model) == hooks_before
    assert torch.equal(forward(model, kwargs), before)


# ------------------------------------------------------------------------------------- workers


def start(rank: int, world: int, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
        timeout=timedelta(seconds=TIMEOUT_S),
    )


def finish(rank: int, tmp: str, deltas: dict[str, float]) -> None:
    (Path(tmp) / f"deltas-{rank}.json").write_text(json.dumps(deltas))
    dist.destroy_process_group()


def two_ranks(rank: int, tmp: str) -> None:
    """Degree 2 over the whole world: every model, both grids, ControlNet residuals; the restore."""
    start(rank, 2, tmp)
    group, deltas = dist.group.WORLD, {}
    for name, build in MODELS.items():
        model = build()
        for grid in GRIDS:
            kwargs = inputs(model, grid)
            deltas[f"{name} {grid} k=2"] = delta(forward(model, kwargs), forward(model, kwargs, group))
        if not isinstance(model, WanTransformer3DModel):  # no ControlNet takes Wan's tokens
            kwargs = with_residuals(model, inputs(model, GRIDS[1]), GRIDS[1])
            deltas[f"{name} {GRIDS[1]} controlnet k=2"] = delta(forward(model, kwargs), forward(model, kwargs, group))
        check_restore(model, group)
    finish(rank, tmp, deltas)


def four_ranks(rank: int, tmp: str) -> None:
    """Degree 4 over the world and degree 2 over the subgroups {0, 1} and {2, 3}; the head-count
    and membership errors; denoising loops whose degree changes every step."""
    start(rank, 4, tmp)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group, in order
    groups, deltas = {2: pairs[rank // 2], 4: dist.group.WORLD}, {}
    with (pytest.raises(ValueError, match="not in the Ulysses group"),
          ulysses(MODELS["tiny-sd3"](), pairs[1 - rank // 2])):
        pass
    for name, build in MODELS.items():
        model = build()
        for degree, group in groups.items():
            if model.config.num_attention_heads % degree:
                processors = model.attn_processors
                with pytest.raises(ValueError, match=f"do not divide by degree {degree}"), ulysses(model, group):
                    pass
                assert all(model.attn_processors[k] is v for k, v in processors.items())
                continue
            for grid in GRIDS:
                kwargs = inputs(model, grid)
                deltas[f"{name} {grid} k={degree}"] = delta(forward(model, kwargs), forward(model, kwargs, group))
        if model.config.num_attention_heads % 4 == 0:
            kwargs = inputs(model, GRIDS[1])
            steps = [None, groups[2], groups[4], None]
            reference = denoise(model, kwargs, [None] * len(steps))
            deltas[f"{name} {GRIDS[1]} steps k=1,2,4,1"] = delta(reference, denoise(model, kwargs, steps))
    finish(rank, tmp, deltas)


# --------------------------------------------------------------------------------------- tests


def spawn(worker: Callable[[int, str], None], nprocs: int, tmp_path: Path) -> list[dict[str, float]]:
    """Run worker(rank, tmp_path) in nprocs processes; each rank's deltas. A worker's exception
    is raised here (the others are terminated); a hang is killed after TIMEOUT_S."""
    context = mp.start_processes(worker, args=(str(tmp_path),), nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    while not context.join(timeout=max(0.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"Ulysses workers still running after {TIMEOUT_S} s")
    return [json.loads((tmp_path / f"deltas-{rank}.json").read_text()) for rank in range(nprocs)]


def assert_close(per_rank: list[dict[str, float]]) -> None:
    for name, value in per_rank[0].items():
        print(f"{name:<42} max|Δ| {value:.2e}")
    far = [(rank, name, value) for rank, deltas in enumerate(per_rank) for name, value in deltas.items()
           if not value <= TOL]  # NaN is far too
    assert not far, f"over {TOL}: {far}"


def test_degree_two_equals_degree_one(tmp_path):
    assert_close(spawn(two_ranks, 2, tmp_path))


def test_degree_four_subgroups_and_changing_degrees(tmp_path):
    assert_close(spawn(four_ranks, 4, tmp_path))
