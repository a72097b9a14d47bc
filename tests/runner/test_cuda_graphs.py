"""The compiled pieces under CUDA graphs (inductor's graph trees), on a GPU only: a DiT's packed
forward of mixed sizes and its template replays run a piece per block, the same compiled
function block after block with the time embedding of the first read by every later one, so a
step's pieces must share one generation of the tree (`CompiledDenoiser._graphs_begin`), and what
a step keeps past it must be copied out of the graphs' memory (`_kept`). The H200's first run of
them (2026-11-29) failed with "accessing tensor output of CUDAGraphs that has been overwritten"
before the fix; these check it on the tiny models, several steps in a row, against eager runs.
`benchmarks/gpu.sh` part `gputests` runs them."""

import numpy as np
import pytest
import torch

from gouache.config import CompileConfig, TemplateConfig
from gouache.models.zoo import load_pipeline
from gouache.request import ImageRequest
from gouache.runner.model_runner import ModelRunner
from gouache.sched.plan import Batch
from gouache.uploads import EditMask, Upload

pytestmark = pytest.mark.gpu
TOL = 2e-3  # fp32 with TF32 off; inductor's fused kernels against eager's


@pytest.fixture(scope="module", params=["tiny-sd3", "tiny-flux"])
def pipe(request):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return load_pipeline(request.param, "float32", "cuda")


def runners(pipe, sizes: tuple[int, ...]) -> tuple[ModelRunner, ModelRunner]:
    eager = ModelRunner(pipe, templates=TemplateConfig())
    compiled = ModelRunner(pipe, templates=TemplateConfig(), compile=CompileConfig(
        enabled=True, buckets=(2, 4), sizes=tuple((s, s) for s in sizes), cuda_graphs=True, graphs=16))
    compiled.warm_up(sizes[0])
    assert compiled.family.pieces is not None
    return eager, compiled


def run(runner: ModelRunner, specs: list[tuple[str, int, dict]], steps: int, upload: Upload | None = None
        ) -> tuple[dict[str, torch.Tensor], int]:
    """Latents of `specs` (id, size, fields) after `steps` steps of them together, and the
    forwards that ran compiled."""
    for rid, size, fields in specs:
        runner.prepare(ImageRequest(rid, f"a red circle {rid}", size, size, steps + 1, 4.0, seed=1, **fields),
                       upload)
    compiled = 0
    for _ in range(steps):
        out = runner.execute(Batch(tuple(rid for rid, _, _ in specs), patched=True))
        assert not out.failed
        compiled += out.compile.compiled
    latents = {rid: runner.states[rid].latents.clone() for rid, _, _ in specs}
    for rid, _, _ in specs:
        runner.release(rid)
    return latents, compiled


def assert_close(eager: dict, compiled: dict) -> None:
    for rid, latents in eager.items():
        assert (latents - compiled[rid]).abs().max().item() <= TOL, rid


def test_a_packed_step_of_mixed_sizes_runs_its_pieces_under_cuda_graphs(pipe):
    eager, compiled = runners(pipe, (64, 128))
    specs = [("small", 64, {}), ("large", 128, {})]
    expected, _ = run(eager, specs, 3)
    latents, ran = run(compiled, specs, 3)
    assert ran == 3  # every step's packed forward in the pieces
    assert_close(expected, latents)
    alone, _ = run(compiled, [("again", 64, {})], 2)  # a row graph after the pieces, its output kept
    assert alone["again"].isfinite().all()


def test_a_template_replay_runs_its_pieces_under_cuda_graphs(pipe):
    eager, compiled = runners(pipe, (64,))
    image = np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    mask = np.zeros((64, 64), np.float32)
    mask[16:40, 16:40] = 1
    edit = {"image": b"-", "template_id": "t"}
    expected = {}
    for runner in (eager, compiled):
        blank = Upload(image, EditMask(np.zeros_like(mask)))
        run(runner, [("record", 64, {**edit, "register_template": True})], 4, blank)
        latents, ran = run(runner, [("replay", 64, {**edit, "template_cache": True})], 4, Upload(image, EditMask(mask)))
        expected.setdefault("latents", latents)
    assert ran == 4 and compiled.templates.counts.replayed_tokens > 0
    assert_close(expected["latents"], latents)
