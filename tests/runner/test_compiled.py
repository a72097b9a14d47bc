"""Compiled denoiser forwards (`gouache.runner.compiled`): a compiled step equals the eager one
(merged and segmented LoRA adapters included), a step whose module was changed by a hook or
whose techniques the graph does not hold runs eagerly and says why, padding to a bucket changes
no row, one graph of dynamic rows serves every row count, and a warmed load never recompiles.
One graph per model (one bucket of 2 rows at 64 px: a one-row forward is padded to it; a UNet
and a DiT): compiling is slow on 2 cores. The DiT's graphs are inductor's; the UNet's go through
dynamo's `eager` backend (the same graphs, guards and recompiles without generated code: inductor
takes about two minutes for the UNet's plain and adapter graphs here, and compiles the UNet's
row graphs in tests/parallel/test_cfg.py and tests/runner/test_background.py)."""

import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch._dynamo.utils
from torch import nn

from gouache.block_cache.layer import BlockCacheLayer
from gouache.config import (
    CompileConfig,
    ControlNetConfig,
    EngineConfig,
    LoraConfig,
    ModelConfig,
    SchedulerConfig,
    TemplateConfig,
)
from gouache.controlnet.layer import ControlNetLayer
from gouache.controlnet.model import forward as controlnet_forward
from gouache.controlnet.model import random_controlnet
from gouache.engine.build import build_engine
from gouache.forward_layers import Step
from gouache.lora.layer import LoraLayer
from gouache.models.zoo import load_pipeline
from gouache.outputs import CompileReport
from gouache.parallel.layer import ParallelLayer
from gouache.request import ImageRequest
from gouache.runner import compile_cache
from gouache.runner.compiled import CompiledDenoiser
from gouache.runner.compiled import _call as compiled_call
from gouache.runner.forward import Forward, LayoutLayer
from gouache.runner.model_runner import ModelRunner
from gouache.sched.plan import Batch
from gouache.templates.layer import TemplateLayer
from gouache.uploads import EditMask, Upload
from tests.lora.random_files import random_loras

TOL = 1e-4
SIZE = 64


@pytest.fixture(scope="module", params=["tiny-sd", "tiny-flux"])
def model(request):
    return request.param


@pytest.fixture(scope="module")
def lora_dir(model, tmp_path_factory):
    return random_loras(tmp_path_factory.mktemp("loras"), model)


@pytest.fixture(scope="module")
def runners(pipe, lora_dir):
    """An eager runner and a compiled one of the same pipeline, the compiled one warmed up."""
    loras = LoraConfig(str(lora_dir))
    eager = ModelRunner(pipe, lora=loras)
    backend = "eager" if hasattr(pipe, "unet") else "inductor"
    compiled = ModelRunner(pipe, lora=loras, compile=CompileConfig(enabled=True, buckets=(2,), backend=backend))
    compiled.warm_up(SIZE)
    report = compiled.family.compiled.take_report()
    assert report.graphs >= 1 and report.recompiles == 0 and report.warmup_s > 0
    return eager, compiled


def steps(runner: ModelRunner, requests: list[ImageRequest], batches: list[tuple[str, ...] | Batch]):
    """Prepare `requests` (a conditioning image for each ControlNet), run one step of each batch
    (its ids, or a `Batch`); the latents and the compile report."""
    for name in runner.lora_runtime.store.names():
        runner.lora_runtime.store.load(name).result()
    for r in requests:
        runner.prepare(r, controls=[np.full((r.height, r.width, 3), 200, np.uint8)] * len(r.controlnets))
    report = CompileReport()
    for batch in batches:
        batch = batch if isinstance(batch, Batch) else Batch(batch)
        out = runner.execute(batch)
        assert not out.failed and sorted(out.request_ids) == sorted(batch.request_ids)
        report.compiled += out.compile.compiled
        report.graphs += out.compile.graphs
        report.recompiles += out.compile.recompiles
        for why, n in out.compile.eager.items():
            report.eager[why] = report.eager.get(why, 0) + n
    latents = {r.request_id: runner.states[r.request_id].latents.clone() for r in requests}
    for r in requests:
        runner.release(r.request_id)
    return latents, report


def request(rid, guidance=4.0, seed=1, loras=()):
    return ImageRequest(rid, f"a red circle {rid}", SIZE, SIZE, 4, guidance, seed=seed, loras=tuple(loras))


def assert_equal(eager: dict, compiled: dict) -> None:
    for rid, latents in eager.items():
        assert (latents - compiled[rid]).abs().max() <= TOL, rid


@pytest.mark.slow
def test_compiled_steps_equal_eager_padded_or_not_and_never_recompile(runners):
    eager, compiled = runners
    requests = [request("a"), request("b", guidance=1.0, seed=2), request("c", guidance=1.0, seed=3)]
    # rows: a alone (2 rows with CFG, 1 without: padded), b alone (1: padded), b and c (2), all three (past the
    # last bucket)
    batches = [("a",), ("b",), ("b", "c"), ("a", "b", "c")]
    expected, _ = steps(eager, requests, batches)
    got, report = steps(compiled, requests, batches)
    assert_equal(expected, got)
    rows = 2 if compiled.family.uses_cfg(requests[0]) else 1
    past = 2 + rows > 2
    assert report.compiled == len(batches) - past and report.eager == ({"rows": 1} if past else {})
    assert report.graphs == 0 and report.recompiles == 0


@pytest.mark.slow
def test_a_merged_lora_is_read_by_the_compiled_graph(runners):
    eager, compiled = runners
    one = [request("ink", loras=(("ink", 1.0),), guidance=1.0)]
    expected, _ = steps(eager, one, [("ink",)] * 2)
    got, report = steps(compiled, one, [("ink",)] * 2)
    assert_equal(expected, got)
    assert report.compiled == 2 and report.recompiles == 0  # merged in place: the graph's inputs


@pytest.mark.slow
def test_segmented_adapters_run_in_a_graph_of_their_own_that_serves_any_sets_of_their_ranks(runners):
    eager, compiled = runners

    def two(first, second):
        return [request("one", loras=((first, 1.0),), guidance=1.0, seed=4),
                request("two", loras=((second, 1.0),), guidance=1.0, seed=5)]

    plain, _ = steps(eager, [request("one", guidance=1.0, seed=4), request("two", guidance=1.0, seed=5)],
                     [("one", "two")])
    expected, _ = steps(eager, two("ink", "paper"), [("one", "two")])
    assert min((plain[r] - expected[r]).abs().max() for r in plain) > 1e-3  # each row's adapter matters
    got, report = steps(compiled, two("ink", "paper"), [("one", "two")])
    assert_equal(expected, got)
    assert report.compiled == 1 and report.eager == {} and report.graphs == 1  # the slots' graph, once
    expected, _ = steps(eager, two("paper", "ink"), [("one", "two")])
    got, report = steps(compiled, two("paper", "ink"), [("one", "two")])
    assert_equal(expected, got)
    assert report.compiled == 1 and report.graphs == 0  # other rows, other adapters: the same graph
    one_shape = [Batch(("one", "two"), patched=True)]  # a patched step of one shape: the model's own batch
    expected, _ = steps(eager, two("ink", "paper"), one_shape)
    got, report = steps(compiled, two("ink", "paper"), one_shape)
    assert_equal(expected, got)
    assert report.compiled == 1 and report.graphs == 0
    _, report = steps(compiled, [request("p", guidance=1.0)], [("p",)])
    assert report.compiled == 1 and report.graphs == 0  # and the plain graph still serves plain steps
    three = [*two("ink", "paper"), request("three", loras=(("ink", 1.0),), guidance=1.0, seed=6)]
    expected, _ = steps(eager, three, [("one", "two", "three")])
    got, report = steps(compiled, three, [("one", "two", "three")])
    assert_equal(expected, got)
    assert report.eager == {"rows": 1}  # past the last bucket: the slots apply eagerly


@pytest.mark.slow
def test_a_hook_added_after_compiling_is_honoured_by_running_eagerly(runners, pipe):
    eager, compiled = runners
    out = (eager.family.denoiser.proj_out if hasattr(eager.family.denoiser, "proj_out")
           else eager.family.denoiser.conv_out)
    handle = out.register_forward_hook(lambda module, args, output: output + 0.5)
    try:
        expected, _ = steps(eager, [request("h", guidance=1.0)], [("h",)])
        got, report = steps(compiled, [request("h", guidance=1.0)], [("h",)])
    finally:
        handle.remove()
    plain, _ = steps(eager, [request("h", guidance=1.0)], [("h",)])
    assert (plain["h"] - expected["h"]).abs().max() > 1e-3  # the hook matters ...
    assert_equal(expected, got)  # ... and the compiled runner kept it
    assert report.eager == {"hooks": 1}
    after, report = steps(compiled, [request("h", guidance=1.0)], [("h",)])
    assert_equal(plain, after)
    assert report.compiled == 1 and report.recompiles == 0


@pytest.mark.slow
def test_a_weight_changed_in_place_is_seen_without_recompiling(runners, pipe):
    eager, compiled = runners
    weight = next(p for p in compiled.family.denoiser.parameters() if p.dim() > 1)
    with torch.no_grad():
        weight.mul_(1.5)
    try:
        expected, _ = steps(eager, [request("w", guidance=1.0)], [("w",)])
        got, report = steps(compiled, [request("w", guidance=1.0)], [("w",)])
    finally:
        with torch.no_grad():
            weight.div_(1.5)
    assert_equal(expected, got)
    assert report.compiled == 1 and report.recompiles == 0


@pytest.mark.slow
def test_steps_whose_techniques_the_graph_does_not_hold_run_eagerly(runners):
    eager, compiled = runners
    if compiled.family.patches:
        pytest.skip("a UNet's graphs hold the block cache, template replays and mixed sizes (the tests below)")
    cached = [ImageRequest("bc", "a red circle", SIZE, SIZE, 4, 1.0, seed=1, block_cache=0.5)]
    _, report = steps(compiled, cached, [("bc",)])
    assert report.eager == {"block_cache": 1}
    sizes = [request("s64", guidance=1.0), ImageRequest("s32", "a square", 32, 32, 4, 1.0, seed=2)]
    _, report = steps(compiled, sizes, [Batch(("s64", "s32"), patched=True)])
    assert report.eager == {"mixed_sizes": 1}  # a packed DiT forward compiles where --compile-sizes mix


@pytest.mark.slow
@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "padded"])
def test_a_patched_unet_runs_one_graph_for_every_mix_of_its_patch_side(runners, pipe, dynamic):
    """The layout as data (`CompiledDenoiser.patched`): mixes of other patch and image counts run
    the graph the first compiled, equal to eager patched steps; 16 patches or more take a graph
    of their own (dynamo splits a UNet's convolutions there: `patch_bucket`). Padded (static
    shapes, as under CUDA graphs): one graph per patch and image bucket (`static_bucket`: 16
    patches of 8 images, then of 16), equal too. Dynamo's graphs
    through the `eager` backend: inductor's code for a patched UNet takes minutes on 2 cores
    (`benchmarks/patched_compile.py` checks its exactness; tests/test_attention.py compiles the
    attention operator with inductor)."""
    eager, _ = runners
    if not eager.family.patches:
        pytest.skip("packed DiT pieces: tests/runner/test_pieces.py")
    torch._dynamo.reset()  # the other variant's graphs would serve this one's shapes (the tests using them ran)
    compiled = ModelRunner(pipe, compile=CompileConfig(enabled=True, buckets=(2, 4, 8)))
    denoiser = compiled.family.compiled
    denoiser._compiled = torch.compile(denoiser.denoiser, dynamic=False, backend="eager")
    denoiser.warm, denoiser.dynamic_rows = True, dynamic
    small = [ImageRequest(f"s32-{i}", "a square", 32, 32, 4, 4.0, seed=2 + i) for i in range(3)]
    sizes = [request("s64"), request("t64", seed=5), *small]
    # 8x8 and 4x4 latents in patches of 4, two rows each: 10, 12, 14 patches; then 18
    mixes = [("s64", "s32-0"), ("s64", "s32-0", "s32-1"), ("s64", "s32-0", "s32-1", "s32-2")]
    groups = ((mixes, 1), ([("s64", "t64", "s32-0")], 1)) if dynamic else ((mixes, 2),)
    for batches, graphs in groups:
        patched = [Batch(ids, patched=True) for ids in batches]
        expected, _ = steps(eager, sizes, patched)
        got, report = steps(compiled, sizes, patched)
        assert_equal(expected, got)
        assert report.compiled == len(batches) and report.eager == {} and report.graphs == graphs


@pytest.mark.slow
def test_controlnet_residuals_are_inputs_of_the_unet_graph(runners, pipe, tmp_path):
    """Steps with ControlNet residuals in some rows run compiled: the ControlNet in one graph
    of dynamic rows, the UNet taking its residuals in another (beside the plain one), each
    serving every row count, equal to eager steps. Through dynamo's `eager` backend, as the
    patched test above (inductor compiles plain adds of inputs)."""
    if not hasattr(pipe, "unet"):
        pytest.skip("ControlNets are served for UNets")
    torch._dynamo.reset()  # the graphs of the tests before would serve these shapes
    random_controlnet(pipe, seed=0, std=0.2).save_pretrained(str(tmp_path / "edges"))
    controls = ControlNetConfig(str(tmp_path))
    eager = ModelRunner(pipe, controlnet=controls)
    compiled = ModelRunner(pipe, controlnet=controls, compile=CompileConfig(enabled=True, buckets=(2, 4, 8)))
    denoiser = compiled.family.compiled
    denoiser._compiled = torch.compile(denoiser.denoiser, dynamic=False, backend="eager")
    denoiser._controlnet = torch.compile(controlnet_forward, dynamic=False, backend="eager")
    denoiser.warm = True
    edges = (("edges", b"-", 0.8),)
    requests = [ImageRequest("c1", "a red circle", SIZE, SIZE, 4, 4.0, seed=1, controlnets=edges),
                ImageRequest("c2", "a blue square", SIZE, SIZE, 4, 4.0, seed=2, controlnets=edges),
                request("p1", seed=3)]
    batches = [("c1",), ("c1", "p1"), ("c1", "c2", "p1")]  # 2, 4 and 6 rows, some without residuals
    expected, _ = steps(eager, requests, batches)
    plain, _ = steps(eager, [request("c1", seed=1)], [("c1",)])
    assert (plain["c1"] - expected["c1"]).abs().max() > 1e-3  # the residuals matter
    got, report = steps(compiled, requests, batches)
    assert_equal(expected, got)
    assert report.compiled == len(batches) and report.eager == {} and report.graphs == 2


@pytest.mark.slow
@pytest.mark.parametrize("prompt", ["own", "the recorder's"])
def test_a_template_replay_runs_one_graph_for_every_mask(runners, pipe, prompt):
    """The layout as data: replays of two masks, alone and together, run compiled, equal to
    eager replays; the recorder's steps run eagerly, saying why. A UNet's (`CompiledDenoiser.
    replayed`) in one graph; a DiT's in pieces (`PackedPieces.replay`), their buckets warmed
    up before (no graph compiled while serving), the text rows replayed too where the prompt is
    the recorder's (their keys rotated in the break, Flux's RoPE). Through dynamo's `eager`
    backend (`CompileConfig.backend`), as the tests above."""
    if prompt != "own" and hasattr(pipe, "unet"):
        pytest.skip("a UNet's edits replay no text rows")
    torch._dynamo.reset()  # the graphs of the tests before would serve these shapes
    eager = ModelRunner(pipe, templates=TemplateConfig())
    compiled = ModelRunner(pipe, templates=TemplateConfig(), compile=CompileConfig(
        enabled=True, buckets=(2, 4, 8), sizes=((SIZE, SIZE),), backend="eager"))
    assert "template" in compiled.family.compiled.holds
    denoiser = compiled.family.compiled
    pieces = compiled.family.pieces
    if pieces is not None:
        assert set(pieces.buckets.by_kind) == {"replay x2", "replay x4", "replay x8"}
        text_len = compiled.family.prepare(request("probe")).cond["prompt_embeds"].shape[1]
        denoiser.warm_up(pieces.graphs(text_len), progress=lambda line: None)
        assert denoiser.take_report().failed == 0
    denoiser.warm = True
    image = np.random.default_rng(0).integers(0, 255, (SIZE, SIZE, 3), dtype=np.uint8)
    top, square = np.zeros((SIZE, SIZE), np.float32), np.zeros((SIZE, SIZE), np.float32)
    top[:24], square[24:48, 16:40] = 1, 1

    def edits(runner, specs, batches):
        for rid, mask, fields in specs:
            runner.prepare(ImageRequest(rid, f"a cat {rid}" if prompt == "own" else "a cat", SIZE, SIZE, 4, 4.0,
                                        seed=1, image=b"-", template_id="t", **fields), Upload(image, EditMask(mask)))
        report = CompileReport()
        for batch in batches:
            out = runner.execute(Batch(batch))
            assert not out.failed
            report.compiled += out.compile.compiled
            report.graphs += out.compile.graphs
            for why, n in out.compile.eager.items():
                report.eager[why] = report.eager.get(why, 0) + n
        return {rid: runner.states[rid].latents.clone() for rid, _, _ in specs}, report

    record = [("record", np.zeros_like(top), {"register_template": True})]
    replays = [("top", top, {"template_cache": True}), ("square", square, {"template_cache": True})]
    batches = [("top", "square"), ("top",), ("top", "square"), ("square",), ("top", "square")]
    expected = {}
    for runner in (eager, compiled):
        _, report = edits(runner, record, [("record",)] * 4)
        latents, replayed = edits(runner, replays, batches)
        expected.setdefault("latents", latents)
    assert report.eager == {"template recording": 4}
    assert_equal(expected["latents"], latents)
    assert replayed.compiled == len(batches) and replayed.eager == {}
    assert replayed.graphs == (1 if pieces is None else 0)
    assert compiled.templates.counts == eager.templates.counts and compiled.templates.counts.replayed_tokens > 0
    assert (compiled.templates.counts.replayed_text > 0) == (prompt != "own")  # a DiT's text rows


@pytest.mark.slow
def test_a_block_cache_runs_each_block_compiled_on_its_computed_rows(runners, pipe):
    """Under the block cache (per image) each UNet block runs compiled on the rows it
    computes (`CompiledDenoiser.block`; on a GPU, held here), a graph per block, any rows: equal
    to the eager cache's steps, the same blocks reused. Through dynamo's `eager` backend, as the
    tests above."""
    if not hasattr(pipe, "unet"):
        pytest.skip("a DiT's block cache runs eagerly")
    torch._dynamo.reset()  # the graphs of the tests before would serve these shapes
    eager = ModelRunner(pipe)
    compiled = ModelRunner(pipe, compile=CompileConfig(enabled=True, buckets=(2, 4, 8)))
    denoiser = compiled.family.compiled
    assert "block_cache" not in denoiser.holds  # on a CPU the pieces lost to eager blocks (docs/speed.md) ...
    denoiser.holds |= {"block_cache"}  # ... they run on a GPU's
    denoiser._block = torch.compile(compiled_call, dynamic=False, backend="eager")
    denoiser.warm = True
    cached = [ImageRequest(f"bc{i}", f"a red circle {i}", SIZE, SIZE, 8, 4.0, seed=i, block_cache=0.3)
              for i in range(2)]
    latents, reused, report = {}, {}, CompileReport()
    for name, runner in (("eager", eager), ("compiled", compiled)):
        for r in cached:
            runner.prepare(r)
        reused[name] = []
        for _ in range(8):
            out = runner.execute(Batch(("bc0", "bc1")))
            assert not out.failed
            reused[name].append(out.block_cache.reused)
            report.compiled += out.compile.compiled
            report.graphs += out.compile.graphs
            report.eager.update(out.compile.eager)
        latents[name] = {r.request_id: runner.states[r.request_id].latents.clone() for r in cached}
    assert_equal(latents["eager"], latents["compiled"])
    assert reused["compiled"] == reused["eager"] and sum(reused["eager"]) > 0
    assert report.compiled == 8 and report.eager == {}
    blocks = len(pipe.unet.down_blocks) + 1 + len(pipe.unet.up_blocks)
    assert 0 < report.graphs <= 2 * blocks  # each block: all rows, some rows (2 on: dynamic)


@pytest.mark.slow
@pytest.mark.parametrize("instruct", ["tiny-flux-kontext", "tiny-flux2-klein", "tiny-qwen-image-edit"])
def test_an_instruction_edit_runs_the_row_graph_its_warm_up_compiled(instruct):
    """An instruction edit's references follow the image's tokens: its forward is a row graph
    per size and reference layout, which the warm-up compiles for an edit of its size with one
    reference of that size (Qwen-Image-Edit's, at a megapixel, from a square upload); its steps
    run compiled, one graph for any row count, equal to eager steps, compiling nothing more.
    Through dynamo's `eager` backend, as the tests above."""
    torch._dynamo.reset()  # the graphs of the tests before would serve these shapes
    pipe = load_pipeline(instruct)
    eager = ModelRunner(pipe)
    compiled = ModelRunner(pipe, compile=CompileConfig(enabled=True, buckets=(2, 4), backend="eager"))
    compiled.warm_up(SIZE)
    compiled.family.compiled.take_report()
    rng = np.random.default_rng(0)
    uploads = {f"e{i}": Upload(rng.integers(0, 255, (SIZE, SIZE, 3), dtype=np.uint8)) for i in range(2)}
    batches = [("e0",), ("e0", "e1")]
    latents = {}
    for name, runner in (("eager", eager), ("compiled", compiled)):
        report = CompileReport()
        for rid, upload in uploads.items():
            runner.prepare(ImageRequest(rid, f"make it red {rid}", SIZE, SIZE, 4, 2.5, seed=1, image=b"-"), upload)
        for batch in batches:
            out = runner.execute(Batch(batch))
            assert not out.failed
            report.compiled += out.compile.compiled
            report.recompiles += out.compile.recompiles
            report.eager.update(out.compile.eager)
        latents[name] = {rid: runner.states[rid].latents.clone() for rid in uploads}
    assert_equal(latents["eager"], latents["compiled"])
    assert (report.compiled, report.eager, report.recompiles) == (len(batches), {}, 0)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-flux2-klein", "tiny-qwen-image"])
def test_a_mixed_size_step_of_a_family_that_runs_a_forward_per_size_runs_their_row_graphs(model):
    """FLUX.2 and Qwen-Image run a step of mixed sizes one forward per size (`mixes_sizes`): their
    compiled denoisers hold `mixed_sizes`, so such a step runs each size's row graph, which the
    warm-up compiled, equal to eager. Through dynamo's `eager` backend, as the tests above."""
    torch._dynamo.reset()
    pipe = load_pipeline(model)
    eager = ModelRunner(pipe)
    compiled = ModelRunner(pipe, compile=CompileConfig(enabled=True, buckets=(2,), sizes=((64, 64), (96, 96)),
                                                       backend="eager"))
    compiled.warm_up(SIZE)
    compiled.family.compiled.take_report()
    requests = [ImageRequest("s", "a red circle", 64, 64, 4, 1.0, seed=1),
                ImageRequest("m", "a blue square", 96, 96, 4, 1.0, seed=2)]
    batches = [Batch(("s", "m"), patched=True)] * 2
    expected, _ = steps(eager, requests, batches)
    got, report = steps(compiled, requests, batches)
    assert_equal(expected, got)
    assert (report.compiled, report.eager, report.recompiles) == (len(batches), {}, 0)


def test_eager_reason_names_the_first_technique_that_does_not_compile():
    def forward(degree=1, compiled=None) -> Forward:
        return Forward((ParallelLayer(None, degree, None, None), LoraLayer(None, {}, None), ControlNetLayer(None, None),
                        TemplateLayer(None, None), BlockCacheLayer(None), LayoutLayer(None)), compiled)

    class State:  # what the layers' `uses` read
        def __init__(self, shape=(1, 4, 8, 8), lora=None, cond=None, strength=None):
            self.lora, self.control, self.template = lora, None, None
            self.latents = torch.zeros(shape)
            self.cond = cond or {}
            self.request = SimpleNamespace(strength=strength, num_frames=1)

    assert forward().eager_reason(Step([State(), State()], False)) is None
    assert forward().eager_reason(Step([State(), State((1, 4, 4, 4))], True)) == "mixed_sizes"
    assert forward().eager_reason(Step([State(), State()], True)) is None  # one size: a plain batch
    # a model whose packed forward runs in compiled pieces (`CompiledDenoiser.holds`)
    packed = SimpleNamespace(holds=frozenset({"mixed_sizes"}))
    assert forward(compiled=packed).eager_reason(Step([State(), State((1, 4, 4, 4))], True)) is None
    assert forward(2).eager_reason(Step([State()], False)) == "parallel"
    assert forward().eager_reason(Step([State(), State(cond={"reference": torch.zeros(1, 4, 8)})], False)) is None
    assert forward().eager_reason(Step([State(), State(strength=0.5)], False)) is None  # img2img changes no forward
    controlled = State()
    controlled.control = SimpleNamespace(mode="async")
    assert forward().eager_reason(Step([State(), controlled], False)) is None  # residuals are the UNet's inputs


def test_cuda_graphs_off_a_gpu_and_compile_flags_without_compile_are_refused(pipe):
    with pytest.raises(ValueError, match="CUDA device"):
        CompiledDenoiser(pipe.transformer if hasattr(pipe, "transformer") else pipe.unet,
                         CompileConfig(enabled=True, cuda_graphs=True), torch.device("cpu"))
    with pytest.raises(ValueError, match="CUDA device"):  # refused before a model loads or a worker starts
        build_engine(ModelConfig("tiny-sd"), EngineConfig(executor="multiproc", devices=2,
                                                          compile=CompileConfig(enabled=True, cuda_graphs=True)),
                     SchedulerConfig(policy="round-knapsack"))
    with pytest.raises(ValueError, match="add --compile"):
        CompileConfig(cache_dir="/tmp/x")


class RowWise(nn.Module):
    """A denoiser of independent rows; `grouped`: one convolution group per row, which takes the
    row count as a constant (as segmented adapters' grouped convolutions do)."""

    def __init__(self, grouped: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.proj, self.grouped = nn.Linear(8, 8), grouped

    def forward(self, sample, scale, return_dict=True):
        x = torch.nn.functional.gelu(self.proj(sample)) * scale
        if self.grouped:
            n = x.shape[0]
            x = torch.nn.functional.conv1d(x.reshape(1, n, 8), torch.ones(n, 1, 1), groups=n).view(n, 8)
        return (x,)


class WithResiduals(nn.Module):
    """A denoiser of independent rows that takes a tuple of per-row tensors (as a UNet takes
    ControlNet residuals)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(8, 8)

    def forward(self, sample, residuals, return_dict=True):
        return (self.proj(sample) + residuals[0] * residuals[1].sum(1, keepdim=True),)


@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "padded"])
def test_a_tuple_of_row_tensors_is_marked_and_padded_with_the_rows(tmp_path, dynamic):
    compiled = CompiledDenoiser(WithResiduals(), CompileConfig(enabled=True, buckets=(2, 4, 8),
                                                               cache_dir=str(tmp_path)), torch.device("cpu"))
    compiled.dynamic_rows = dynamic
    torch._dynamo.reset()  # the other variant's graph would serve this one's rows
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for n in (2, 3, 5, 7):
        generator = torch.Generator().manual_seed(n)
        rows = {"sample": torch.randn(n, 8, generator=generator),
                "residuals": (torch.randn(n, 8, generator=generator), torch.randn(n, 3, generator=generator))}
        with torch.no_grad(), compiled.step(None):
            out = compiled(rows, {})
        assert out.shape == (n, 8) and (out - compiled.denoiser(**rows)[0]).abs().max() <= TOL
    # dynamic: one graph from 2 rows on; padded: one per bucket (2, 4, 8)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == (1 if dynamic else 3)
    assert compiled.take_report().compiled == 4
    keys = {g.key for g in compiled.row_graphs([(rows, {})])}  # each bucket's key names the tuple's shapes
    assert ("residuals", (((8, 8), torch.float32, torch.device("cpu")), ((8, 3), torch.float32,
                                                                         torch.device("cpu")))) in max(keys)


def run_rows(compiled: CompiledDenoiser, counts) -> int:
    """Forwards of each row count, each equal to eager; the graphs dynamo compiled for them."""
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for n in counts:
        x = torch.randn(n, 8, generator=torch.Generator().manual_seed(n))
        with torch.no_grad(), compiled.step(None):
            out = compiled({"sample": x}, {"scale": 2.0})
        assert out.shape == (n, 8) and (out - compiled.denoiser(x, 2.0)[0]).abs().max() <= TOL
    return torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs


def test_one_graph_of_dynamic_rows_serves_every_row_count_unpadded(tmp_path):
    compiled = CompiledDenoiser(RowWise(), CompileConfig(enabled=True, buckets=(1, 2, 4, 8), cache_dir=str(tmp_path)),
                                torch.device("cpu"))
    # a request of two rows (CFG) warms no one-row graph
    assert [g.what for g in compiled.row_graphs([({"sample": torch.randn(2, 8)}, {"scale": 2.0})])] == \
        ["2x8", "4x8", "8x8"]
    graphs = compiled.row_graphs([({"sample": torch.randn(1, 8)}, {"scale": 2.0})])
    assert [g.what for g in graphs] == ["1x8", "2x8", "4x8", "8x8"]
    compiled.warm_up(graphs, progress=lambda line: None)
    assert compiled.take_report().graphs == 2  # one row (static), and every count from 2 on
    assert run_rows(compiled, [1, 2, 3, 5, 7, 8]) == 0
    report = compiled.take_report()
    assert report.compiled == 6 and report.recompiles == 0


def test_a_restart_loads_what_the_background_compiled_before_it_is_healthy(tmp_path):
    """Graphs compiled into the cache (by the server or its background child) are noted there;
    a later start on that cache compiles them with its warm-up (a cache hit), where it would
    have left them to the background compiler; the others still go there."""
    config = CompileConfig(enabled=True, buckets=(2, 4, 8), cache_dir=str(tmp_path))
    first = CompiledDenoiser(RowWise(), config, torch.device("cpu"))
    known, new = (first.graph({"sample": torch.randn(n, 8)}, {"scale": s}) for n, s in ((2, 2.0), (1, 3.0)))
    first.warm_up([known], progress=lambda line: None)  # as the child would
    assert compile_cache.known(first.cache) == {repr(known.key)}
    restart = CompiledDenoiser(RowWise(), config, torch.device("cpu"))
    queued, lines = {}, []
    restart.background = SimpleNamespace(submit=queued.update, close=lambda: None)
    later = [restart.graph({"sample": torch.randn(n, 8)}, {"scale": s}) for n, s in ((2, 2.0), (1, 3.0))]
    restart.warm_up([], progress=lines.append, later=later)
    assert known.key in restart._ready and list(queued) == [new.key]
    assert "1 of the forwards left to the background compile here" in lines[0]
    restart.warm_up([later[0]], progress=lines.append)
    assert (tmp_path / compile_cache.GRAPHS).read_text().splitlines() == [repr(known.key)]  # noted once


def test_a_denoiser_that_takes_its_row_count_as_a_constant_pads_its_rows_instead(tmp_path, caplog):
    compiled = CompiledDenoiser(RowWise(grouped=True), CompileConfig(enabled=True, buckets=(4,),
                                                                     cache_dir=str(tmp_path)), torch.device("cpu"))
    with caplog.at_level(logging.WARNING, logger="gouache.runner.compiled"):
        assert run_rows(compiled, [3]) == 2  # the dynamic graph refused, then the padded one of 4 rows
    assert "padded to their bucket from now on" in caplog.text and not compiled.dynamic_rows
    assert run_rows(compiled, [2, 4]) == 0 and compiled.take_report().compiled == 3


def test_room_for_graphs_is_made_on_the_thread_that_compiles():
    """torch keeps a thread's dynamo settings to that thread: a limit raised where the server
    builds its runner is not the engine thread's, whose 9th graph of a function would run
    eagerly. `room_for` raises it on the calling thread, as every compiled forward does first."""
    import threading

    from gouache.runner.compiled import room_for

    seen = {}

    def engine_thread():
        seen["before"] = torch._dynamo.config.recompile_limit
        room_for(300)
        seen["after"] = torch._dynamo.config.recompile_limit

    room_for(300)  # here: not the other thread's
    thread = threading.Thread(target=engine_thread)
    thread.start()
    thread.join()
    assert seen["before"] < 300 <= seen["after"]


def test_the_warm_up_compiles_a_non_square_size_as_its_height_and_width_not_their_transpose():
    """A 96 px wide, 64 px high --compile-sizes entry warms the graph that a 96x64 request steps
    in: no graph is compiled while serving it. Through dynamo's `eager` backend."""
    torch._dynamo.reset()
    pipe = load_pipeline("tiny-sd")  # latents [B, C, h, w]: a transposed size is another graph
    compiled = ModelRunner(pipe, compile=CompileConfig(enabled=True, buckets=(2,), sizes=((64, 96),),
                                                       backend="eager", background=False))
    compiled.warm_up(SIZE)
    compiled.family.compiled.take_report()
    _, report = steps(compiled, [ImageRequest("wide", "a red circle", 96, 64, 2, 5.0, seed=1)], [Batch(("wide",))] * 2)
    assert (report.compiled, report.recompiles) == (2, 0)
