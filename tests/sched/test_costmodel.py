import json
import math
import subprocess
import sys

import numpy as np
import pytest

from gouache.sched.costmodel import BatchCostModel, MaskCostModel, composition_key, load, save
from gouache.sched.parallel_costmodel import FluxH100Assumptions, ParallelCostModel
from gouache.sched.predictors import SVR_GRID, LinearPredictor, SvrPredictor, predictor_from_json

RESOLUTIONS = [(512, 512), (768, 768), (1024, 1024), (768, 1024)]


def synthetic_step_seconds(composition, rng=None):
    """A GPU-like patched step: fixed cost, a cost per distinct resolution (one more attention
    group and its kernels), work proportional to pixels with attention's superlinear share,
    and a soft floor where a small batch leaves the device under-utilised; 3 % noise."""
    work = sum(c * (h * w * 5e-8 + (h * w) ** 2 * 1.5e-14) for (h, w), c in composition.items())
    distinct = sum(c > 0 for c in composition.values())
    seconds = 0.008 + 0.004 * distinct + np.sqrt(work**2 + 0.03**2)
    return seconds * (1 + 0.03 * rng.standard_normal()) if rng is not None else seconds


def random_compositions(n, seed):
    """n distinct batches of 1-20 images over 1-4 resolutions (PatchedServe used 300)."""
    rng = np.random.default_rng(seed)
    out = {}
    while len(out) < n:
        counts = rng.integers(0, 6, size=len(RESOLUTIONS)) * (rng.random(len(RESOLUTIONS)) < 0.6)
        if counts.sum():
            composition = {r: int(c) for r, c in zip(RESOLUTIONS, counts) if c}
            out.setdefault(composition_key(composition), composition)
    return list(out.values())


@pytest.fixture(scope="module")
def fitted_batch_model():
    rng = np.random.default_rng(1)
    samples = [(c, synthetic_step_seconds(c, rng)) for c in random_compositions(300, seed=0)]
    model = BatchCostModel(RESOLUTIONS, patch_px=128)
    model.fit(samples, holdout=0.2, seed=0)
    return model


# BatchCostModel


def test_batch_features_follow_patchedserve():
    model = BatchCostModel(RESOLUTIONS, patch_px=128)
    # counts per resolution in order, distinct resolutions, patches (16 + 2*48 = 112)
    assert model.features({(512, 512): 1, (768, 1024): 2}) == [1, 0, 0, 2, 2, 112]
    with pytest.raises(ValueError, match="not in this cost model"):
        model.features({(640, 640): 1})


def test_held_out_split_keeps_repeated_measurements_together():
    model = BatchCostModel(RESOLUTIONS)
    compositions = random_compositions(20, seed=5)
    samples = [(c, synthetic_step_seconds(c)) for c in compositions for _ in range(3)]
    report = model.fit(samples, holdout=0.25, seed=0)
    assert (report.n_train, report.n_test) == (45, 15)  # 5 of 20 compositions, 3 samples each
    assert len(model.table) == 20 and all(n == 3 for _, n in model.table.values())


def test_measured_compositions_are_looked_up_exactly():
    model = BatchCostModel(RESOLUTIONS)
    model.record({(512, 512): 2, (1024, 1024): 1}, 0.10)
    model.record({(1024, 1024): 1, (512, 512): 2}, 0.14)  # same composition, other order
    assert model.predict({(1024, 1024): 1, (512, 512): 2}) == pytest.approx(0.12)
    assert model.predict({}) == 0.0
    with pytest.raises(RuntimeError, match="no predictor"):
        model.predict({(512, 512): 1})


def test_svr_predicts_held_out_compositions(fitted_batch_model):
    report = fitted_batch_model.report
    assert (report.n_train, report.n_test) == (240, 60)
    assert report.test_mape < 10.0
    assert report.test_max_rel_error < 0.15
    # compositions never measured, scored against the noiseless function
    unseen = [c for c in random_compositions(400, seed=7) if composition_key(c) not in fitted_batch_model.table]
    assert len(unseen) >= 50
    errors = [abs(fitted_batch_model.predict(c) / synthetic_step_seconds(c) - 1) for c in unseen]
    assert np.mean(errors) < 0.10


def test_batch_json_round_trip_predicts_identically(fitted_batch_model, tmp_path):
    path = tmp_path / "batch.json"
    save(fitted_batch_model, path)
    loaded = load(path)
    assert isinstance(loaded, BatchCostModel) and loaded.report == fitted_batch_model.report
    probes = random_compositions(40, seed=11)
    assert [loaded.predict(c) for c in probes] == [fitted_batch_model.predict(c) for c in probes]


def test_step_time_reads_pixel_resolutions(fitted_batch_model):
    resolutions = [(512, 512), (512, 512), (768, 1024)]
    assert fitted_batch_model.step_time(resolutions, patched=True) == fitted_batch_model.predict(
        {(512, 512): 2, (768, 1024): 1}
    )
    assert fitted_batch_model.step_time(resolutions, patched=True, degree=2) == math.inf  # one device only
    with pytest.raises(ValueError, match="no plain-forward profile"):
        fitted_batch_model.step_time(resolutions, patched=False)


def test_plain_forwards_are_measured_then_linear_in_the_batch_size():
    model = BatchCostModel([512, 768])
    for batch, seconds in ((1, 0.10), (2, 0.16), (4, 0.28)):
        model.record_grouped(512, batch, seconds)
    model.record_grouped(768, 2, 0.5)
    assert model.grouped_time((512, 512), 2) == 0.16  # measured: exact
    assert model.grouped_time((512, 512), 3) == pytest.approx(0.22)  # between 2 and 4
    assert model.grouped_time((512, 512), 6) == pytest.approx(0.40)  # beyond: the last two sizes' slope
    assert model.grouped_time((768, 768), 3) == pytest.approx(0.75)  # one size measured: proportional
    # one plain forward per resolution: 2 x 512 and 1 x 768
    assert model.step_time([(512, 512), (768, 768), (512, 512)], patched=False) == pytest.approx(0.16 + 0.25)


def test_plain_forward_table_survives_json(tmp_path):
    model = BatchCostModel([512])
    model.record_grouped(512, 1, 0.1)
    model.record_grouped(512, 3, 0.2)
    model.record({(512, 512): 1}, 0.11)
    save(model, tmp_path / "m.json")
    loaded = load(tmp_path / "m.json")
    assert (loaded.grouped == {(512, 512): {1: 0.1, 3: 0.2}}
            and loaded.grouped_time((512, 512), 2) == pytest.approx(0.15))
    with pytest.raises(ValueError, match="batch >= 1"):
        model.record_grouped(512, 0, 0.1)


def test_stage_times_are_read_by_resolution_and_survive_json(tmp_path):
    model = BatchCostModel([512])
    model.record_stages(512, 0.02, 0.1)
    save(model, tmp_path / "m.json")
    loaded = load(tmp_path / "m.json")
    assert loaded.stage_time((512, 512)) == (0.02, 0.1)
    with pytest.raises(ValueError, match="no stage profile"):
        loaded.stage_time((768, 768))


def test_a_clips_frames_are_part_of_its_resolution_in_every_table_and_survive_json(tmp_path):
    clip, longer, still = (32, 48, 9), (32, 48, 17), (32, 48)
    model = BatchCostModel([clip, longer, still], patch_px=16)
    assert model.features({clip: 2, longer: 1}) == [2, 1, 0, 2, 2 * 6 * 9 + 6 * 17]  # patches of every frame
    model.record({clip: 1, still: 1}, 0.3)
    model.record({longer: 1}, 0.5)
    for res, seconds in ((clip, 0.2), (longer, 0.4), (still, 0.05)):
        model.record_grouped(res, 1, seconds)
        model.record_stages(res, 0.01, seconds / 10)
    save(model, tmp_path / "m.json")
    loaded = load(tmp_path / "m.json")
    assert loaded.resolutions == [clip, longer, still]
    assert loaded.step_time([clip, still], patched=True) == 0.3 and loaded.step_time([longer], patched=True) == 0.5
    assert loaded.step_time([clip, longer, still], patched=False) == pytest.approx(0.65)
    assert loaded.stage_time(longer) == (0.01, 0.04)
    with pytest.raises(ValueError, match="no plain-forward profile"):
        loaded.step_time([(32, 48, 5)], patched=False)  # a clip of other length is another resolution


# ParallelCostModel


def test_parallel_table_lookups_are_exact():
    model = ParallelCostModel({512: {1: 0.2, 2: 0.12}, (768, 1024): {1: 0.5, 4: 0.15}})
    assert model.seconds(512, 2) == 0.12
    assert model.seconds((512, 512), 1) == 0.2
    assert model.seconds((768, 1024), 4) == 0.15
    assert model.degrees((768, 1024)) == [1, 4]
    assert model.standalone_latency(512, steps=20) == pytest.approx(4.0)
    assert model.standalone_latency(512, steps=20, k=2) == pytest.approx(2.4)
    assert model.scaling_efficiency(512, 2) == pytest.approx(0.2 / 0.24)
    with pytest.raises(KeyError, match="k=8"):
        model.seconds(512, 8)
    with pytest.raises(KeyError, match="resolution"):
        model.seconds(256, 1)
    with pytest.raises(ValueError, match="powers of two"):
        ParallelCostModel({512: {3: 0.1}})


def test_parallel_json_round_trip():
    model = ParallelCostModel.h100_flux_default()
    loaded = ParallelCostModel.from_json(json.loads(json.dumps(model.to_json())))
    assert loaded.table == model.table and loaded.source == model.source


def test_h100_default_is_derived_from_table1_and_the_stated_assumptions():
    a = FluxH100Assumptions()
    model = ParallelCostModel.h100_flux_default()
    assert model.resolutions == [(256, 256), (512, 512), (1024, 1024), (2048, 2048)]
    # single device, compute-bound: Table 1 TFLOPs / 50 steps / (0.42 * 989 TFLOP/s)
    assert model.seconds(2048, 1) == pytest.approx(24964.72 / 50 / (0.42 * 989), rel=1e-9)
    # the anchors it was reconciled with: ~0.24 s/step at 1024 px (xDiT, 1 H100, eager) and a
    # whole 2048 px generation of about a minute on one H100 (TetriServe §1)
    assert model.seconds(1024, 1) == pytest.approx(6.71 / 28, rel=0.05)
    assert a.table1_steps * model.seconds(2048, 1) == pytest.approx(60, rel=0.05)


def test_h100_default_is_monotone_in_pixels_and_degree():
    model = ParallelCostModel.h100_flux_default()
    sides = [256, 512, 1024, 2048]
    for k in (1, 2, 4, 8):
        times = [model.seconds(s, k) for s in sides]
        assert times == sorted(times) and len(set(times)) == len(times)
    for side in sides:
        times = [model.seconds(side, k) for k in (1, 2, 4, 8)]
        assert times == sorted(times, reverse=True)  # more devices never slower in this model


def test_h100_default_scales_sublinearly_and_better_for_large_images():
    model = ParallelCostModel.h100_flux_default()
    for side in (1024, 2048):
        assert model.seconds(side, 2) < model.seconds(side, 1)
        assert 0.5 < model.scaling_efficiency(side, 2) < 1.0
    for k in (2, 4, 8):
        effs = [model.scaling_efficiency(s, k) for s in (256, 512, 1024, 2048)]
        assert effs == sorted(effs) and effs[-1] < 1.0  # TetriServe Fig. 2: large images scale best


def test_h100_default_small_images_gain_nothing_from_eight_devices():
    model = ParallelCostModel.h100_flux_default()
    # 256 px: each device still streams all 24 GB of weights per step and pays 228 all-to-alls,
    # so going from 4 to 8 devices buys under 5 % while doubling the devices held.
    assert model.seconds(256, 8) > 0.95 * model.seconds(256, 4)
    assert model.scaling_efficiency(256, 8) < 0.25
    # ... whereas at 2048 px compute dominates and 8 devices still almost halve the step
    assert model.seconds(2048, 8) < 0.55 * model.seconds(2048, 4)


# MaskCostModel


def synthetic_edit_batches(n, seed):
    rng = np.random.default_rng(seed)
    return [
        [(int(rng.choice([1024, 4096])), float(rng.uniform(0.05, 0.6))) for _ in range(rng.integers(1, 9))]
        for _ in range(n)
    ]


@pytest.fixture(scope="module")
def fitted_mask_model():
    rng = np.random.default_rng(3)
    model = MaskCostModel(hidden=3072, num_blocks=57)
    batches = synthetic_edit_batches(120, seed=2)
    compute = [(b, (0.01 + model.flops(b) / 400e12) * (1 + 0.03 * rng.standard_normal())) for b in batches]
    loads = [(b, (0.002 + model.cache_bytes(b) / 25e9) * (1 + 0.03 * rng.standard_normal())) for b in batches]
    model.fit(compute, loads)
    return model


def test_mask_flops_and_bytes_follow_instgenie_table1():
    model = MaskCostModel(hidden=8, num_blocks=2, bytes_per_element=2)
    # per block: 24 m L H^2 + 4 m L^2 H = 24*0.5*10*64 + 4*0.5*100*8 = 7680 + 1600
    assert model.flops([(10, 0.5)]) == pytest.approx(2 * 9280)
    assert model.flops([(10, 0.0)]) == 0.0
    assert model.cache_bytes([(10, 0.25)]) == pytest.approx(2 * 0.75 * 10 * 8 * 2)
    with pytest.raises(ValueError, match="mask ratio"):
        model.flops([(10, 1.5)])


def test_mask_regressions_fit_synthetic_data(fitted_mask_model):
    report = fitted_mask_model.report
    assert report.compute_r2 > 0.95 and report.load_r2 > 0.95
    # the slopes recover the synthetic throughput (400 TFLOP/s) and bandwidth (25 GB/s)
    assert fitted_mask_model.compute.coef[0] == pytest.approx(1 / 400e12, rel=0.05)  # seconds per FLOP
    assert fitted_mask_model.load.coef[0] == pytest.approx(1 / 25e9, rel=0.05)  # seconds per byte


def test_mask_predict_is_the_longer_of_compute_and_load(fitted_mask_model):
    small_mask = [(4096, 0.05)] * 4  # little to compute, much to load
    large_mask = [(4096, 0.9)] * 4
    assert fitted_mask_model.predict(small_mask) == fitted_mask_model.load_time(small_mask)
    assert fitted_mask_model.predict(large_mask) == fitted_mask_model.compute_time(large_mask)
    assert fitted_mask_model.predict([]) == 0.0


def test_mask_json_round_trip_predicts_identically(fitted_mask_model, tmp_path):
    save(fitted_mask_model, tmp_path / "mask.json")
    loaded = load(tmp_path / "mask.json")
    batches = synthetic_edit_batches(20, seed=9)
    assert [loaded.predict(b) for b in batches] == [fitted_mask_model.predict(b) for b in batches]
    assert loaded.report == fitted_mask_model.report


# predictors


def test_predictors_round_trip_through_json():
    X = np.random.default_rng(0).random((30, 2))
    y = 1 + X @ [2.0, 3.0]
    for predictor in (SvrPredictor().fit(X, y), LinearPredictor().fit(X, y)):
        loaded = predictor_from_json(json.loads(json.dumps(predictor.to_json())))
        assert np.array_equal(loaded.predict(X), predictor.predict(X))
        assert loaded.score(X, y) > 0.99
    with pytest.raises(RuntimeError, match="not fitted"):
        SvrPredictor().predict(X)


def test_svr_search_picks_from_the_grid_and_loading_does_not_search_again():
    X = np.random.default_rng(0).random((40, 2))
    y = np.exp(X @ [1.0, -0.5])
    searched = SvrPredictor(search=True).fit(X, y)
    assert searched.params["C"] in SVR_GRID["C"] and searched.params["gamma"] in SVR_GRID["gamma"]
    data = json.loads(json.dumps(searched.to_json()))
    loaded = predictor_from_json(data)
    assert loaded.params == searched.params and loaded.search
    assert np.array_equal(loaded.predict(X), searched.predict(X))


def test_load_rejects_unknown_kinds(tmp_path):
    (tmp_path / "x.json").write_text('{"kind": "nope"}')
    with pytest.raises(ValueError, match="unknown cost model kind"):
        load(tmp_path / "x.json")


@pytest.mark.slow
def test_cost_models_do_not_import_torch():
    code = (
        "import sys, gouache.sched.costmodel, gouache.sched.predictors; "
        "gouache.sched.costmodel.ParallelCostModel.h100_flux_default(); "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_mask_cost_model_never_predicts_a_negative_time_from_noisy_samples():
    small, big = [(64, 0.25)], [(64, 1.0)]
    model = MaskCostModel(64, 2, 4)
    model.fit([(small, 0.02), (big, 0.01)], [(small, 0.002), (big, 0.001)])  # the bigger one measured faster
    assert model.compute.coef[0] == 0 and model.compute.intercept > 0  # not a line sloping below zero
    model.fit([(small, 0.005), (big, 0.04)], [(small, 0.002), (big, 0.0)])  # a line with a negative intercept
    assert model.compute.intercept == 0 and model.compute.coef[0] > 0  # through the origin: no negative fixed cost
    assert model.compute_time([(8, 0.05)]) > 0 and model.load_time([(8, 0.05)]) >= 0


# files: every number in a range the planners serve, else refused naming the entry

# the numbers no time, size or count may be: a float's extremes, NaN, the infinities, -0.0,
# an integer no float holds, and a string or a boolean where a number belongs
EXTREMES = (5e-324, -5e-324, 1e308, -1e308, math.nan, math.inf, -math.inf, -0.0, 0, 10**400, "0.1", True)


def batch_data() -> dict:
    """A small batch cost model's file, its SVR fitted on three samples of four features."""
    return {"kind": "batch", "resolutions": [[512, 512], [768, 768]], "patch_px": 256,
            "table": [{"composition": [[512, 512, 2]], "seconds": 0.1, "n": 3}],
            "grouped": [{"resolution": [512, 512], "batch": 1, "seconds": 0.05}],
            "stages": [{"resolution": [512, 512], "prep_s": 0.01, "post_s": 0.02}],
            "predictor": {"kind": "svr", "params": {"C": 100.0, "gamma": 0.03, "epsilon": 0.01}, "search": False,
                          "X": [[1, 0, 1, 4], [0, 1, 1, 9], [2, 0, 1, 8]], "y": [0.05, 0.09, 0.1]},
            "report": None}


def parallel_data() -> dict:
    return {"kind": "parallel", "source": "test", "table": [{"height": 512, "width": 512, "k": 1, "seconds": 0.2},
                                                            {"height": 512, "width": 512, "k": 2, "seconds": 0.12}]}


def mask_data() -> dict:
    return {"kind": "mask", "hidden": 64, "num_blocks": 2, "bytes_per_element": 2, "text_tokens": 0, "tensors": 1,
            "compute": {"kind": "linear", "coef": [1e-9], "intercept": 0.01},
            "load": {"kind": "linear", "coef": [1e-10], "intercept": 0.0}, "plain": None, "report": None}


def changed(data: dict, path: str, value) -> dict:
    """`data` with the entry at `path` (keys and list indices, dot-separated) set to `value`."""
    *parents, last = [int(part) if part.isdigit() else part for part in path.split(".")]
    at = data
    for part in parents:
        at = at[part]
    at[last] = value
    return data


def refused(tmp_path, data: dict) -> str:
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError) as error:
        load(path)
    message = str(error.value)
    assert message.startswith(f"{path}: ") and message.endswith("profile it again (`gouache profile`)")
    return str(error.value)


STEP_S = "must be a number of seconds in [1e-06, 1e+06]"
STAGE_S = "must be a number of seconds in [0, 1e+06]"
SIDE = "must be an integer in [1, 65536]"
CASES = [
    *((batch_data, "table.0.seconds", x, "table[0].seconds " + STEP_S) for x in EXTREMES),
    *((batch_data, "grouped.0.seconds", x, "grouped[0].seconds " + STEP_S) for x in EXTREMES),
    *((batch_data, "stages.0.prep_s", x, "stages[0].prep_s " + STAGE_S) for x in EXTREMES if x not in (0, 5e-324)),
    *((batch_data, "predictor.y.1", x, "predictor.y[1] " + STEP_S) for x in EXTREMES),
    *((batch_data, "patch_px", x, "patch_px " + SIDE) for x in (*EXTREMES, 1.5, 1 << 17)),
    *((batch_data, "resolutions.1.0", x, "resolutions[1][0] " + SIDE) for x in EXTREMES),
    *((batch_data, "predictor.X.1.2", x, "predictor.X[1][2] must be a number in [-1e+12, 1e+12]")
      for x in (1e308, -1e308, math.nan, math.inf, -math.inf, 10**400, "0.1", True)),
    *((batch_data, "predictor.params.C", x, "predictor.params.C must be a number in [1e-09, 1e+09]")
      for x in (5e-324, 0, -0.0, 1e308, math.nan, math.inf, -1.0)),
    (batch_data, "table.0.n", 0, "table[0].n must be an integer in [1, 1048576]"),
    (batch_data, "table.0.n", 1.5, "table[0].n must be an integer in [1, 1048576]"),
    (batch_data, "table.0.composition", [], "table[0].composition must be a list of 1 to 100000 entries"),
    (batch_data, "table.0.composition.0", [512, 512, 0],
     "table[0].composition[0][2] must be an integer in [1, 1048576]"),
    (batch_data, "table.0.composition.0", [512, 512], "table[0].composition[0] must be [height, width, count]"),
    (batch_data, "table.0.composition.0", [512, 512, 0, 1],
     "table[0].composition[0][2] must be an integer in [1, 65536]"),
    (batch_data, "grouped.0.batch", 10**400, "grouped[0].batch must be an integer in [1, 1048576]"),
    (batch_data, "resolutions", [], "resolutions must be a list of 1 to 100000 entries"),
    (batch_data, "predictor.X", [], "predictor.X must be a list of 1 to 10000 entries"),
    (batch_data, "predictor.X", [[0, 0, 0, 0]] * 10_001, "predictor.X must be a list of 1 to 10000 entries"),
    (batch_data, "predictor.X.1", [0, 1, 1], "predictor.X[1] must be a list of 4 entries"),
    (batch_data, "predictor.y", [0.05], "predictor.y must be a list of 3 entries"),
    (batch_data, "predictor.X", [[1, 0, 1]] * 3, "predictor was fitted on 3 features; 2 resolutions make 4"),
    (batch_data, "table", [{"composition": [[512, 512, 1]], "n": 1}], "table[0].seconds is missing"),
    (batch_data, "table", "none", "table must be a list of 0 to 100000 entries"),
    *((parallel_data, "table.1.seconds", x, "table[1].seconds " + STEP_S) for x in EXTREMES),
    *((parallel_data, "table.1.k", x, "table[1].k must be an integer in [1, 4096]") for x in (*EXTREMES, 2.0, 8192)),
    (parallel_data, "table.1.k", 3, "table[1].k must be a power of two, once per resolution; got 3"),
    (parallel_data, "table.1.k", 1, "table[1].k must be a power of two, once per resolution; got 1"),
    *((parallel_data, "table.0.height", x, "table[0].height " + SIDE) for x in EXTREMES),
    (parallel_data, "table", [], "table must be a list of 1 to 100000 entries"),
    *((mask_data, "hidden", x, "hidden must be an integer in [1, 1048576]") for x in EXTREMES),
    (mask_data, "num_blocks", 4097, "num_blocks must be an integer in [1, 4096]"),
    (mask_data, "bytes_per_element", 16, "bytes_per_element must be an integer in [1, 8]"),
    (mask_data, "text_tokens", -1, "text_tokens must be an integer in [0, 1048576]"),
    (mask_data, "tensors", 0, "tensors must be an integer in [1, 16]"),
    *((mask_data, "compute.coef.0", x, "compute.coef[0] must be seconds per FLOP or byte in [-1, 1]")
      for x in (1.5, -1.5, 1e308, -1e308)),
    *((mask_data, "compute.coef.0", x, "compute.coef[0] must be a finite number")
      for x in (1e400, -math.inf, math.nan, 10**400, "0.1", True)),
    *((mask_data, "load.intercept", x, "load.intercept must be a number of seconds in [-1e+06, 1e+06]")
      for x in (1e308, -1e308, 1e6 + 1)),
    *((mask_data, "load.intercept", x, "load.intercept must be a finite number")
      for x in (math.nan, math.inf, 10**400, True)),
    (mask_data, "compute.coef", None, "compute must be a line fitted on one feature"),
    (mask_data, "compute.coef", [1e-9, 1e-9], "compute must be a line fitted on one feature"),
    (mask_data, "load", None, "load must be a line fitted on one feature"),
]


@pytest.mark.parametrize("make, path, value, why", CASES, ids=lambda v: getattr(v, "__name__", str(v))[:16])
def test_a_cost_model_file_with_a_number_the_planners_cannot_use_is_refused_naming_the_entry(
        make, path, value, why, tmp_path):
    assert why in refused(tmp_path, changed(make(), path, value))


def test_a_file_that_is_not_a_cost_models_json_is_refused_naming_it(tmp_path):
    path = tmp_path / "cost.json"
    for text, why in (("{", "not a cost model's JSON"), ("[" * 100_000, "not a cost model's JSON"),
                      ("[1]", "unknown cost model kind None")):
        path.write_text(text)
        with pytest.raises(ValueError, match=why):
            load(path)


def test_cost_models_at_the_ends_of_the_ranges_load_and_plan_finite_rounds(tmp_path):
    from gouache.config import MAX_ROUND_S
    from gouache.sched.cost_fields import MAX_STEP_S, MIN_STEP_S
    from gouache.sched.rounds import steps_in_round

    data = batch_data()
    for path, value in (("table.0.seconds", MIN_STEP_S), ("grouped.0.seconds", MAX_STEP_S), ("stages.0.prep_s", 0),
                        ("stages.0.post_s", -0.0), ("predictor.y", [MIN_STEP_S, 1.0, MAX_STEP_S])):
        changed(data, path, value)
    (tmp_path / "batch.json").write_text(json.dumps(data))
    batch = load(tmp_path / "batch.json")
    times = [batch.step_time([(512, 512)] * 2, patched=True), batch.step_time([(512, 512)], patched=False),
             batch.step_time([(768, 768)], patched=True), batch.step_time([(512, 512)] * 9, patched=False)]
    assert all(math.isfinite(t) and t > 0 for t in times) and times[:2] == [MIN_STEP_S, MAX_STEP_S]
    assert batch.stage_time((512, 512)) == (0.0, 0.0)
    parallel = changed(changed(parallel_data(), "table.0.seconds", MIN_STEP_S), "table.1.seconds", MAX_STEP_S)
    (tmp_path / "parallel.json").write_text(json.dumps(parallel))
    table = load(tmp_path / "parallel.json").table[(512, 512)]
    assert table == {1: MIN_STEP_S, 2: MAX_STEP_S}
    assert steps_in_round(MIN_STEP_S, MAX_ROUND_S, 10**12) == 3_600_000_000
    assert steps_in_round(MAX_STEP_S, 5e-324, 9) == 0
    mask = changed(changed(mask_data(), "compute.coef.0", 1.0), "load.intercept", MAX_STEP_S)
    (tmp_path / "mask.json").write_text(json.dumps(mask))
    edits = load(tmp_path / "mask.json")
    huge = [(1 << 20, 1.0)] * 64  # the largest images' tokens, 64 of them
    assert math.isfinite(edits.predict(huge)) and edits.predict([(16, 0.0)]) == pytest.approx(MAX_STEP_S)
    for profiled in ("costmodel_mask_shapes-dit.json", "costmodel_mask_shapes-unet.json"):  # lines below 0 s
        assert load(f"benchmarks/results/{profiled}").load.intercept < 0
