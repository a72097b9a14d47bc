"""Packed DiT forwards as compiled pieces (`gouache.runner.pieces`, `pieces_sd3`, `pieces_flux`):
the layout as data (padding indices, buckets per row bucket), and on tiny-sd3 and tiny-flux a
compiled packed step equal to the eager one, one graph serving every mix its bucket holds (no
recompile), and a step past the largest bucket run eagerly, saying why. One token bucket of one
row bucket: compiling is slow on 2 cores."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gouache.config import CompileConfig, LoraConfig, TemplateConfig
from gouache.models.zoo import load_pipeline
from gouache.outputs import CompileReport
from gouache.request import ImageRequest
from gouache.runner.model_runner import ModelRunner
from gouache.runner.pack_dit import Packing
from gouache.runner.pieces import PackedPieces, TokenLayout, mixes, token_buckets
from gouache.sched.plan import Batch
from gouache.uploads import EditMask, Upload
from tests.lora.random_files import random_loras

TOL = 1e-4


def test_a_layout_pads_its_rows_to_the_bucket_with_slot_zero():
    packing = Packing.build([(2, 2), (1, 2)], text_len=3, device=torch.device("cpu"))
    layout = TokenLayout.of(packing, rows=4, tokens=8)
    # packed order: the 1x2 image (caller 1) first, then the 2x2 one; two padding rows
    assert layout.image_index.tolist() == [1, 1, 0, 0, 0, 0, 0, 0]
    assert layout.text_index.tolist() == [1, 1, 1, 0, 0, 0] + [0] * 6
    assert layout.image(torch.ones(6, 2)).shape == (8, 2) and layout.image(torch.ones(6, 2))[6:].eq(0).all()
    assert layout.slots(torch.tensor([5.0, 7.0])).tolist() == [5.0, 7.0, 7.0, 7.0]  # valid values, dropped
    with pytest.raises(ValueError, match="cannot hold"):
        TokenLayout.of(packing, rows=1, tokens=8)
    with pytest.raises(ValueError, match="cannot hold"):
        TokenLayout.of(packing, rows=2, tokens=5)


def test_owners_name_the_forward_row_of_every_kind_of_row_the_pieces_take():
    """Segmented adapters in the pieces read each index's forward row by the size of a module's
    input (`PackedPieces.owners`): slots (padding slots: the last row's), image rows, text rows,
    and both joined text first where blocks run one stream; two kinds of one size with other
    owners cannot be told apart (None: the step runs eagerly)."""
    packing = Packing.build([(2, 2), (1, 2)], text_len=3, device=torch.device("cpu"))
    layout = TokenLayout.of(packing, rows=4, tokens=8)
    owners = PackedPieces.owners(SimpleNamespace(joined=True), layout)
    assert owners[4].tolist() == [0, 1, 1, 1]
    assert owners[8].tolist() == layout.image_index.tolist() and owners[12].tolist() == layout.text_index.tolist()
    assert owners[20].tolist() == layout.text_index.tolist() + layout.image_index.tolist()
    assert PackedPieces.owners(SimpleNamespace(joined=False), TokenLayout.of(packing, rows=4, tokens=12)) is None


def test_token_buckets_cover_each_row_bucket_within_the_budget():
    assert token_buckets((1, 2, 4), [64], 8) is None  # one size: no mix to pack
    buckets = token_buckets((1, 2, 4), [16, 64], 8)
    assert set(buckets.by_kind) == {"tokens x2", "tokens x4"}  # a packed forward has two rows at least
    assert len(buckets) <= 8
    # every step a row bucket takes fits its largest token bucket: 2 rows of 64, 4 rows of 64
    # on the token counts two sizes make: 2 rows 16 + 64 = 80 (in 64s: 128); 3 or 4 rows 144, 96, 208, 160, 112
    assert buckets.by_kind["tokens x2"] == (128,) and buckets.by_kind["tokens x4"][-1] == 256
    assert buckets.bucket("tokens x4", 96) < 256  # more than one bucket at 4 rows
    # requests of two rows (CFG): two of them at 4 rows, 160 (192), three or four at 8 rows; no mix at 2
    cfg = token_buckets((2, 4, 8), [16, 64], 8, request_rows=2)
    assert cfg.by_kind["tokens x4"] == (192,) and "tokens x2" not in cfg.by_kind
    assert cfg.by_kind["tokens x8"][-1] == _up(2 * (3 * 64 + 16))
    assert token_buckets((1, 2, 4), [16, 64], 1) is None  # fewer graphs than row buckets to cover
    # template replays: computed tokens from one to every token of the row bucket, at any size
    one = token_buckets((1, 2, 4), [64], 8, replays=True)
    assert set(one.by_kind) == {"replay x1", "replay x2", "replay x4"} and len(one) <= 8
    assert [one.by_kind[f"replay x{r}"][-1] for r in (1, 2, 4)] == [64, 128, 256]
    both = token_buckets((1, 2, 4), [16, 64], 8, replays=True)
    assert {"tokens x2", "tokens x4", "replay x4"} <= set(both.by_kind) and len(both) <= 8
    # the smallest replay bucket is a sixteenth of the row bucket's tokens: sd3-arch's 1024 px edits
    # (8,192 tokens over two rows) at masks 0.1/0.2/0.5 compute 800/1,682/4,050 tokens
    assert token_buckets((2,), [4096], 4, replays=True).by_kind["replay x2"] == (1024, 2048, 4160, 8192)
    # a budget too small for both keeps the packed forwards' buckets
    assert set(token_buckets((1, 2, 4), [16, 64], 3, replays=True).by_kind) == {"tokens x2", "tokens x4"}


def test_mixes_are_the_token_counts_of_two_sizes_or_more():
    assert sorted(mixes([256, 1024], 2, 2)) == [1280]
    assert sorted(mixes([256, 1024, 256], 3, 4)) == [1536, 1792, 2304, 2560, 3328]  # no 4 x 256, no 4 x 1024
    assert mixes([64], 2, 8) == set()


def _up(n: int) -> int:
    return -(-n // 64) * 64


def _step(runner: ModelRunner, sizes: list[int], tag: str, loras: tuple = ()) -> tuple[dict, CompileReport]:
    """One packed step of a request of each size (the adapters `loras[i]` for request i, where given)."""
    for name in runner.lora_runtime.store.names():
        runner.lora_runtime.store.load(name).result()
    ids = []
    for i, size in enumerate(sizes):
        rid = f"{tag}-{i}"
        adapters = ((loras[i], 1.0),) if i < len(loras) and loras[i] else ()
        runner.prepare(ImageRequest(rid, f"a red circle {tag} {i}", size, size, 4, 4.0, seed=i, loras=adapters))
        ids.append(rid)
    out = runner.execute(Batch(tuple(ids), patched=True))
    assert not out.failed and sorted(out.request_ids) == sorted(ids)
    latents = {rid: runner.states[rid].latents.clone() for rid in ids}
    for rid in ids:
        runner.release(rid)
    return latents, out.compile


@pytest.fixture(scope="module", params=["tiny-sd3", "tiny-flux"])
def runners(request):
    pipe = load_pipeline(request.param)
    # two requests of 64 and 96 px: 4 rows with CFG (SD3), 2 padded to 4 (Flux); one token bucket
    config = CompileConfig(enabled=True, buckets=(4,), sizes=((64, 64), (96, 96)), graphs=3)
    compiled = ModelRunner(pipe, compile=config)
    pieces = compiled.family.pieces
    # two requests of 16 and 36 tokens with CFG (104), or up to four rows of them without (124): in 64s
    assert pieces.buckets.by_kind == {"tokens x4": (128,)}
    # the packed pieces' warm-up only (the row graphs are `test_compiled`'s)
    probe = compiled.family.prepare(ImageRequest("probe", "probe", 64, 64, 2, 4.0, seed=0))
    text_len = probe.cond["prompt_embeds"].shape[1]
    compiled.family.compiled.warm_up(pieces.graphs(text_len), progress=lambda line: None)
    report = compiled.family.compiled.take_report()
    assert report.failed == 0 and report.recompiles == 0 and report.graphs >= 3  # first, between(s), last
    return ModelRunner(pipe), compiled


@pytest.mark.slow
def test_a_packed_step_runs_compiled_and_equals_the_eager_one(runners):
    eager, compiled = runners
    for sizes, tag in (([64, 96], "a"), ([96, 64], "b")):  # two mixes, one bucket
        want, _ = _step(eager, sizes, tag)
        got, report = _step(compiled, sizes, tag)
        assert report.compiled == 1 and report.eager == {} and report.recompiles == 0, report
        for rid in want:
            assert (want[rid] - got[rid]).abs().max().item() <= TOL, rid


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-sd3", "tiny-flux"])
def test_a_packed_step_of_several_adapter_sets_takes_them_by_its_layout(model, tmp_path):
    """Segmented adapters in the pieces (`RowSlots.tokens`): every image and text row takes its
    forward row's set, masked out of every set's pairs side by side; a graph of the bucket's
    (compiled when first met) serves other mixes of as many sets' columns, and one set beside
    rows without any takes another (its columns a power of two: fewer), all equal to eager
    steps. Through dynamo's `eager` backend (the graphs' paths; the tests above run inductor's)."""
    pipe = load_pipeline(model)
    loras = LoraConfig(str(random_loras(tmp_path, model)))
    eager = ModelRunner(pipe, lora=loras)
    compiled = ModelRunner(pipe, lora=loras, compile=CompileConfig(
        enabled=True, buckets=(4,), sizes=((64, 64), (96, 96)), graphs=3, backend="eager"))
    plain, _ = _step(eager, [64, 96], "p")
    _step(compiled, [64, 96], "p")  # the plain pieces' graphs
    for sizes, loras, tag, graphs in (([64, 96], ("ink", "paper"), "l", True), ([96, 64], ("paper", "ink"), "m", False),
                                      ([96, 64], ("paper", None), "n", True)):
        want, _ = _step(eager, sizes, tag, loras)
        got, report = _step(compiled, sizes, tag, loras)
        assert report.compiled == 1 and report.eager == {} and (report.graphs > 0) == graphs, report
        for rid in want:
            assert (want[rid] - got[rid]).abs().max().item() <= TOL, rid
        if tag == "l":
            assert min((plain[f"p-{i}"] - want[f"l-{i}"]).abs().max() for i in range(2)) > 1e-3  # they matter
    sizes, loras = [64, 96, 64, 96, 64], ("ink", "paper", None, "paper", "ink")  # past the row bucket: eagerly
    want, _ = _step(eager, sizes, "o", loras)
    got, report = _step(compiled, sizes, "o", loras)
    assert report.eager == {"rows": 1}
    for rid in want:
        assert (want[rid] - got[rid]).abs().max().item() <= TOL, rid


@pytest.mark.slow
def test_a_packed_step_past_the_largest_bucket_runs_eagerly_and_says_why(runners):
    eager, compiled = runners
    sizes = [64, 96, 64, 96, 64]  # 10 rows with CFG, 5 without: past the row bucket of 4
    want, _ = _step(eager, sizes, "c")
    got, report = _step(compiled, sizes, "c")
    assert report.eager == {"rows": 1} and report.compiled == 0
    for rid in want:
        assert (want[rid] - got[rid]).abs().max().item() <= TOL, rid


def test_a_graph_budget_is_refused_where_it_would_change_nothing():
    from gouache.runner.families.dit import FluxKontextFamily, StableDiffusion3Family
    from gouache.runner.families.qwen import QwenImageFamily
    from gouache.runner.families.unet import StableDiffusionXLFamily

    with pytest.raises(ValueError, match="add --compile"):
        CompileConfig(graphs=8)
    two = CompileConfig(enabled=True, sizes=((64, 64), (96, 96)), graphs=8)
    assert StableDiffusion3Family.unused_graphs(two) is None and FluxKontextFamily.unused_graphs(two) is None
    assert StableDiffusionXLFamily.unused_graphs(two) is None  # its patched forwards' graphs
    assert "two sizes or more" in StableDiffusionXLFamily.unused_graphs(CompileConfig(enabled=True, graphs=8))
    assert "qwenimage models do not compile" in QwenImageFamily.unused_graphs(two)
    same_pixels = CompileConfig(enabled=True, sizes=((64, 128), (128, 64)), graphs=8)  # one token count: no mix
    assert StableDiffusion3Family.unused_graphs(same_pixels) is None  # but template replays' token buckets
    assert "two or more pixel counts" in StableDiffusion3Family.unused_graphs(CompileConfig(enabled=True, graphs=8))


def test_a_compile_backend_is_inductor_or_eager_and_cuda_graphs_need_inductor():
    with pytest.raises(ValueError, match="inductor or eager"):
        CompileConfig(enabled=True, backend="tvm")
    with pytest.raises(ValueError, match="CUDA graphs are captured by the inductor"):
        CompileConfig(enabled=True, cuda_graphs=True, backend="eager")
    with pytest.raises(ValueError, match="add --compile"):
        CompileConfig(backend="eager")
    assert CompileConfig(enabled=True, backend="eager").backend == "eager"


@pytest.mark.slow
def test_a_cfg_replay_computes_the_text_of_its_conditional_half():
    """SD3's edits run CFG: the unconditional rows' text replays (the recorder's negative prompt),
    so a replay's pieces take the text of half the row bucket's rows (warmed up so: no graph
    compiled while serving), equal to the eager replay. Without CFG two edits fill the bucket,
    each computing its text: the full text rows, compiled when first met, equal too. Through
    dynamo's eager backend."""
    pipe = load_pipeline("tiny-sd3")
    eager = ModelRunner(pipe, templates=TemplateConfig())
    compiled = ModelRunner(pipe, templates=TemplateConfig(), compile=CompileConfig(
        enabled=True, buckets=(2,), sizes=((64, 64),), backend="eager", graphs=2))
    compiled.warm_up(64)
    assert compiled.family.pieces.buckets.by_kind == {"replay x2": (64,)}  # 2 rows of 16 tokens, in 64s
    compiled.family.compiled.take_report()
    image = np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    mask = np.zeros((64, 64), np.float32)
    mask[16:40, 16:40] = 1

    def edit(runner, ids, guidance, fields, mask):
        for rid in ids:
            runner.prepare(ImageRequest(rid, f"a cat {rid}", 64, 64, 4, guidance, seed=1, image=b"-",
                                        template_id="t", **fields), Upload(image, EditMask(mask)))
        report = CompileReport()
        for _ in range(3):
            out = runner.execute(Batch(tuple(ids)))
            assert not out.failed
            report.compiled += out.compile.compiled
            report.graphs += out.compile.graphs
        latents = {rid: runner.states[rid].latents.clone() for rid in ids}
        for rid in ids:
            runner.release(rid)
        return latents, report

    for guidance, replays in ((4.0, ["c"]), (1.0, ["n1", "n2"])):  # with CFG: 2 rows; without: 2 edits
        results = {}
        for name, runner in (("eager", eager), ("compiled", compiled)):
            edit(runner, ["record"], guidance, {"register_template": True}, np.zeros_like(mask))
            results[name] = edit(runner, replays, guidance, {"template_cache": True}, mask)
        latents, report = results["compiled"]
        assert report.compiled == 3 and (report.graphs == 0) == (guidance > 1), (guidance, report)
        for rid, want in results["eager"][0].items():
            assert (want - latents[rid]).abs().max().item() <= TOL, (guidance, rid)
