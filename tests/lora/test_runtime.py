"""LoRA adapters in the model runner: merged output equals diffusers' own LoRA loading and
fusing, a batch of mixed adapters equals each request run alone, and bounded asynchronous
loading with bound 0 equals synchronous loading."""

import threading

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from gouache.config import LoraConfig
from gouache.lora.apply import Factors, RowSlots, segmented, whole_rows
from gouache.lora.files import Lora, LoraError, LoraLayer, random_lora
from gouache.models.zoo import load_pipeline
from gouache.request import ImageRequest
from gouache.runner.model_runner import ModelRunner
from gouache.sched.plan import Batch

TOL = 1e-4
STEPS = 3
GRAIN = (r".*(resnets\.\d+\.conv\d|pos_embed\.proj|(ffn?|img_mlp|txt_mlp)\.net\.(0\.proj|2)|feed_forward\.w\d"
         r"|x_embedder.*)")


@pytest.fixture(scope="module", params=["tiny-sd", "tiny-sdxl", "tiny-sd3", "tiny-flux", "tiny-qwen-image",
                                                  "tiny-zimage", "tiny-flux2-klein", "tiny-wan", "tiny-wan-i2v"])
def model(request):
    return request.param


@pytest.fixture(scope="module")
def lora_dir(pipe, tmp_path_factory):
    directory = tmp_path_factory.mktemp("loras")
    for seed, name in enumerate(("ink", "paper")):
        save_file(random_lora(pipe, rank=4, seed=seed), str(directory / f"{name}.safetensors"))
    # convs (LoCon: resnet convs, a DiT's patch embedding) and feed-forward linears, another rank
    save_file(random_lora(pipe, rank=6, seed=2, targets=GRAIN), str(directory / "grain.safetensors"))
    return directory


def request(rid, loras=(), size=(64, 64), seed=1, prompt="a cat"):
    h, w = size
    return ImageRequest(rid, prompt, w, h, STEPS, 4.0, seed=seed, loras=tuple(loras))


def run(runner: ModelRunner, requests: list[ImageRequest], patched=False):
    """Each request's STEPS steps in batches of all of them, its adapters read beforehand."""
    for name in runner.lora_runtime.store.names():
        runner.lora_runtime.store.load(name).result()
    for r in requests:
        runner.prepare(r)
    ids = tuple(r.request_id for r in requests)
    modes = []
    for _ in range(STEPS):
        out = runner.execute(Batch(ids, patched=patched))
        assert not out.failed and sorted(out.request_ids) == sorted(ids)
        modes.append(out.lora.mode)
    latents = {rid: runner.states[rid].latents.clone() for rid in ids}
    for rid in ids:
        runner.release(rid)
    return latents, modes


def test_merged_output_equals_diffusers_load_lora_weights_and_fuse_lora(model, lora_dir):
    runner = ModelRunner(load_pipeline(model), lora=LoraConfig(str(lora_dir)))
    ours, modes = run(runner, [request("a", [("ink", 0.8)])])
    assert modes == ["merged"] * STEPS
    reference = load_pipeline(model)
    reference.load_lora_weights(str(lora_dir), weight_name="ink.safetensors", adapter_name="ink")
    reference.fuse_lora(lora_scale=0.8)
    reference.unload_lora_weights()  # the fused weights stay
    theirs, _ = run(ModelRunner(reference), [request("a")])
    plain, _ = run(ModelRunner(load_pipeline(model)), [request("a")])
    assert (ours["a"] - theirs["a"]).abs().max() <= TOL
    assert (ours["a"] - plain["a"]).abs().max() > 100 * TOL  # the adapter does something


def test_a_batch_of_mixed_adapters_equals_each_request_alone(pipe, lora_dir):
    runner = ModelRunner(pipe, lora=LoraConfig(str(lora_dir)))
    mix = [request("none"), request("ink", [("ink", 1.0)]), request("both", [("ink", 0.5), ("paper", 1.0)], seed=2),
           request("paper", [("paper", -1.0)], seed=3), request("grain", [("grain", 1.0), ("ink", 0.5)], seed=4)]
    together, modes = run(runner, mix)
    assert modes == ["segmented"] * STEPS
    weights = {k: v.clone() for k, v in runner.family.denoiser.state_dict().items()}
    for r in mix:
        alone, _ = run(runner, [request(r.request_id, r.loras, seed=r.seed)])
        assert (together[r.request_id] - alone[r.request_id]).abs().max() <= TOL, r.request_id
    runner.lora_runtime.merged.set(())
    for name, weight in runner.family.denoiser.state_dict().items():
        assert (weight - weights[name]).abs().max() <= 1e-6, name  # unmerged back to the base weights


def test_mixed_sizes_and_adapters_in_one_packed_or_patched_forward(pipe, lora_dir):
    runner = ModelRunner(pipe, patch_pixels=32, lora=LoraConfig(str(lora_dir)))
    mix = [request("small", [("ink", 1.0)], size=(64, 64)), request("wide", [("paper", 1.0)], size=(64, 128)),
           request("plain", size=(64, 128), seed=4), request("grain", [("grain", 1.0)], size=(128, 64), seed=5)]
    together, modes = run(runner, mix, patched=True)
    # a packed DiT tells every row apart; patches of a UNet do not, so it runs a forward per set, as
    # does a family that runs a forward per size
    assert modes == ["split" if runner.family.patches or not runner.family.mixes_sizes else "segmented"] * STEPS
    for r in mix:
        alone, _ = run(runner, [request(r.request_id, r.loras, size=(r.height, r.width), seed=r.seed)])
        assert (together[r.request_id] - alone[r.request_id]).abs().max() <= TOL, r.request_id


def test_bounded_loading_with_bound_zero_equals_synchronous_loading(pipe, lora_dir):
    gate = threading.Event()
    runner = ModelRunner(pipe, lora=LoraConfig(str(lora_dir), bound=0))
    read = runner.lora_runtime.store._read
    runner.lora_runtime.store._read = lambda *args: gate.wait() and read(*args)  # the file read holds until released
    try:
        runner.prepare(request("late", [("ink", 1.0)]))
        runner.prepare(request("other", seed=5))
        out = runner.execute(Batch(("late", "other")))
    finally:
        gate.set()
    assert out.request_ids == ["other"] and out.lora.waiting == 1  # at its bound, still loading: it waits
    runner.lora_runtime.store._pool.submit(lambda: None).result()  # the load has ended
    for _ in range(STEPS):
        out = runner.execute(Batch(("late",)))
        assert out.request_ids == ["late"]
    synchronous, _ = run(ModelRunner(pipe, lora=LoraConfig(str(lora_dir))), [request("late", [("ink", 1.0)])])
    assert (runner.states["late"].latents - synchronous["late"]).abs().max() <= TOL


def test_before_its_bound_a_request_runs_without_its_adapters_and_takes_them_on_arrival(pipe, lora_dir):
    gate = threading.Event()
    runner = ModelRunner(pipe, lora=LoraConfig(str(lora_dir), bound=2))
    read = runner.lora_runtime.store._read
    runner.lora_runtime.store._read = lambda *args: gate.wait() and read(*args)
    try:
        runner.prepare(request("bal", [("ink", 1.0)]))
        first = runner.execute(Batch(("bal",)))
    finally:
        gate.set()
    assert first.request_ids == ["bal"] and first.lora.without == 1 and runner.lora_runtime.merged.adapters == ()
    runner.lora_runtime.store._pool.submit(lambda: None).result()
    second = runner.execute(Batch(("bal",)))
    assert second.lora.without == 0 and second.lora.mode == "merged"
    runner.execute(Batch(("bal",)))
    late = runner.states["bal"].latents
    plain, _ = run(ModelRunner(pipe), [request("bal")])
    synchronous, _ = run(ModelRunner(pipe, lora=LoraConfig(str(lora_dir))), [request("bal", [("ink", 1.0)])])
    assert 0 < (late - synchronous["bal"]).abs().max()  # its first step ran without the adapter
    assert (late - synchronous["bal"]).abs().max() < (plain["bal"] - synchronous["bal"]).abs().max()


def test_per_adapter_batching_runs_a_forward_per_set_with_the_same_result(pipe, lora_dir):
    mix = [request("none"), request("ink", [("ink", 1.0)]), request("paper", [("paper", 0.5)], seed=3)]
    mixed, _ = run(ModelRunner(pipe, lora=LoraConfig(str(lora_dir))), mix)
    split, modes = run(ModelRunner(pipe, lora=LoraConfig(str(lora_dir), batching="per-adapter")), mix)
    assert modes == ["split"] * STEPS
    for r in mix:
        assert (mixed[r.request_id] - split[r.request_id]).abs().max() <= TOL, r.request_id


def test_slots_apply_each_index_its_own_rows_adapters_as_the_hooks_do():
    """`RowSlots` (the compiled forward's adapters) against `segmented` (the eager hooks), on a
    Linear and a Conv2d: by index of a packed forward's leading sizes (its [1, S, ...] views
    too), by a padded layout's owners (`tokens`), per whole row padded to a bucket (`bind`),
    and one set on every index of any shape (`uniform`); what no map names raises, and nothing
    stays bound after."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"lin": nn.Linear(6, 5), "conv": nn.Conv2d(3, 4, 2, stride=2)})

    def lora(name, rank, seed):
        g = torch.Generator().manual_seed(seed)
        return Lora(name, {"lin": LoraLayer(torch.randn(rank, 6, generator=g), torch.randn(5, rank, generator=g), 0.5),
                           "conv": LoraLayer(torch.randn(rank, 3, 2, 2, generator=g),
                                             torch.randn(4, rank, 1, 1, generator=g), 1.0)}, digest=name)

    ink, paper = lora("ink", 3, 1), lora("paper", 2, 2)
    mixed = [((ink, 1.0),), ((paper, 0.5), (ink, -1.0)), ()]  # three forward rows, the last without
    owner = torch.tensor([0, 0, 1, 1, 1, 2, 2])  # 7 tokens (or patches) of them
    maps = {3: torch.arange(3), 7: owner}
    x, patches, rows = torch.randn(7, 6), torch.randn(7, 3, 2, 2), torch.randn(3, 6)
    plain = model["lin"](x)

    def outputs():
        return model["lin"](x), model["conv"](patches), model["lin"](x[None])[0], model["lin"](rows)

    with segmented(model, mixed, (), maps):
        want = outputs()
    assert (want[0] - plain).abs().max() > 0.1  # the adapters change the output
    slots = RowSlots(model)
    with slots.use(mixed, (), Factors(), maps):
        assert slots.active and not slots.uniform
        for w, g in zip(want, outputs()):
            torch.testing.assert_close(g, w)
        padded = torch.cat([x, x[:1]])  # a layout padded to a bucket of 8, the padding row 0's
        with slots.tokens({3: torch.arange(3), 8: torch.cat([owner, owner[:1]])}):
            torch.testing.assert_close(model["lin"](padded)[:7], want[0])
        with pytest.raises(LoraError, match="no known owner"):
            model["lin"](torch.randn(5, 6))
    with segmented(model, mixed, (), {3: torch.arange(3)}):
        want_rows = model["lin"](rows)
    with slots.use(mixed, (), Factors(), {3: torch.arange(3)}), slots.bind(3, 4):
        torch.testing.assert_close(model["lin"](torch.cat([rows, rows[-1:]]))[:3], want_rows)
    one = [((paper, 0.5),)] * 3
    with segmented(model, one, (), None):
        want_one = model["conv"](patches), model["lin"](x[None])
    with slots.use(one, (), Factors(), None):
        assert slots.uniform
        torch.testing.assert_close(model["conv"](patches), want_one[0])
        torch.testing.assert_close(model["lin"](x[None]), want_one[1])
    with pytest.raises(LoraError, match="cannot tell its rows apart"), slots.use(mixed, (), Factors(), None):
        pass
    assert not slots.active and torch.equal(model["lin"](x), plain)

    assert whole_rows({4: torch.arange(4)}) == [0, 1, 2, 3]
    assert whole_rows({2: torch.tensor([1, 3])}) == [1, 3]  # rank 1's half of 2 requests with CFG
    assert whole_rows({6: torch.tensor([0, 0, 0, 1, 1, 1])}) is None  # three patches a row
    assert whole_rows({2: torch.arange(2), 8: torch.arange(2).repeat_interleave(4)}) is None
    assert whole_rows(None) is None
