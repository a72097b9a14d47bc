import json

import numpy as np
import pytest

from gouache.bench.fidelity import (
    Result,
    Setup,
    acceptable,
    alignment,
    checks,
    compare,
    drop_points,
    edit_alignment,
    psnr,
    ssim,
)
from gouache.data.checker import Degrade
from gouache.data.edits import EDIT_KINDS
from gouache.data.prompts import make_edit_prompts, make_prompts
from gouache.data.shapes import Scene, render


def renders(prompts):
    return [render(p.scene, p.width, p.height, seed=p.seed) for p in prompts]


def test_prompts_are_deterministic_take_sizes_in_turn_and_repeat_per_seed():
    prompts = make_prompts(3, 2, [(64, 64), (64, 128)])
    assert prompts == make_prompts(3, 2, [(64, 64), (64, 128)])
    assert [(p.width, p.height, p.seed) for p in prompts] == [
        (64, 64, 0), (64, 64, 1), (128, 64, 0), (128, 64, 1), (64, 64, 0), (64, 64, 1)]
    assert prompts[0].scene == prompts[1].scene != prompts[2].scene


def test_ssim_and_psnr_are_perfect_only_for_equal_images_and_fall_with_damage():
    image = renders(make_prompts(1, 1, [(96, 96)]))[0]
    assert ssim(image, image) == pytest.approx(1.0) and psnr(image, image) == float("inf")
    mild, strong = Degrade(blur_radius=0.5, noise_sigma=4), Degrade(blur_radius=2.0, noise_sigma=30)
    mild_ssim, strong_ssim = ssim(image, mild.apply(image, 0)), ssim(image, strong.apply(image, 0))
    assert mild_ssim < 1.0
    assert strong_ssim < mild_ssim
    assert psnr(image, mild.apply(image, 0)) > psnr(image, strong.apply(image, 0))
    assert ssim(image, strong.apply(image, 0)) == pytest.approx(ssim(strong.apply(image, 0), image))


def test_alignment_accepts_the_datasets_renders_and_rejects_blank_images():
    prompts = make_prompts(20, 1, [(128, 128), (64, 128)])
    found = alignment(checks(renders(prompts), prompts))
    assert set(found) >= {"colour", "shape", "position", "all", "object_all", "all_1shape", "all_2shape", "all_3shape"}
    assert set(found.values()) == {1.0}
    blank = [np.full((p.height, p.width, 3), 255, np.uint8) for p in prompts]
    assert set(alignment(checks(blank, prompts)).values()) == {0.0}


def test_alignment_counts_images_and_objects_apart():
    prompts = [p for p in make_prompts(30, 1, [(128, 128)]) if len(p.scene.shapes) == 2][:2]
    images = renders(prompts)
    images[0] = render(Scene(prompts[0].scene.shapes[:1], prompts[0].scene.background), 128, 128, 0)  # one shape short
    found = alignment(checks(images, prompts))
    assert found["all"] == 0.5 and found["object_all"] == 0.75 and found["all_2shape"] == 0.5


def test_a_damaged_candidate_is_not_acceptable_and_an_equal_one_is():
    prompts = make_prompts(12, 1, [(128, 128)])
    reference = Result(Setup("reference"), renders(prompts))
    same = compare(reference, Result(Setup("candidate"), renders(prompts)), prompts)
    assert same["acceptable"] and same["ssim_mean"] == pytest.approx(1.0) and same["identical_images"] == 12
    damaged = [Degrade(blur_radius=3.0, noise_sigma=60).apply(image, i) for i, image in enumerate(reference.images)]
    worse = compare(reference, Result(Setup("candidate"), damaged), prompts)
    assert not worse["acceptable"] and worse["ssim_mean"] < 0.6
    assert worse["candidate_alignment"]["all"] < worse["reference_alignment"]["all"]


def test_a_drop_of_exactly_two_points_is_acceptable_despite_float_rounding():
    drop = drop_points({"all": 0.73}, {"all": 0.71}, ("all",))
    assert drop == 2.0 and acceptable(0.99, drop)
    assert not acceptable(0.99, drop_points({"all": 0.73}, {"all": 0.70}, ("all",)))
    assert not acceptable(0.94, 0.0)


def test_edit_prompts_take_every_kind_in_turn_and_upload_the_source():
    prompts = make_edit_prompts(6, 2, [(64, 96)])
    assert prompts == make_edit_prompts(6, 2, [(64, 96)])
    assert [p.edit.kind for p in prompts[::2]] == [*EDIT_KINDS, EDIT_KINDS[0]]
    assert prompts[0].caption == prompts[0].edit.instruction and prompts[0].scene == prompts[0].edit.target
    assert prompts[0].upload().shape == (64, 96, 3)
    assert (prompts[0].upload() == render(prompts[0].edit.source, 96, 64, prompts[0].render_seed)).all()


def test_edit_alignment_rates_exact_targets_sources_and_blanks():
    prompts = make_edit_prompts(10, 1, [(128, 128)])
    targets = [render(p.edit.target, p.width, p.height, p.render_seed) for p in prompts]
    found = edit_alignment(checks(targets, prompts), prompts)
    assert set(found.values()) == {1.0} and {f"all_{kind}" for kind in EDIT_KINDS} <= set(found)
    unedited = edit_alignment(checks([p.upload() for p in prompts], prompts), prompts)
    assert unedited["carried_out"] == 0.0 and unedited["rest_kept"] == 1.0
    same = compare(Result(Setup("reference"), targets), Result(Setup("candidate"), targets), prompts)
    assert same["acceptable"] and same["alignment_drop_points"] == 0.0
    kept_only = compare(Result(Setup("reference"), targets), Result(Setup("candidate"), [p.upload() for p in prompts]),
                        prompts)
    assert not kept_only["acceptable"] and kept_only["alignment_drop_points"] == 100.0


def run_fidelity(tmp_path, *options):
    from gouache.cli import main

    out = tmp_path / "fidelity.json"
    assert main(["bench", "fidelity", "--prompts", "6", "--out", str(out), *options]) == 0
    return json.loads(out.read_text())


@pytest.mark.slow
def test_on_the_trained_unet_a_two_step_candidate_scores_visibly_worse(tmp_path):
    report = run_fidelity(tmp_path, "--candidate-steps", "2")
    assert report["command"] is not None and (tmp_path / "fidelity.png").stat().st_size > 1000
    assert report["reference"]["steps"] is None and report["candidate"]["steps"] == 2
    assert not report["acceptable"] and report["ssim_mean"] < 0.8 and report["psnr_mean_db"] < 20
    reference, candidate = report["reference_alignment"], report["candidate_alignment"]
    assert candidate["object_position"] < reference["object_position"] - 0.2  # 58 % against 100 % when written


@pytest.mark.slow
def test_on_the_trained_unet_patched_batching_is_an_exact_candidate(tmp_path):
    report = run_fidelity(tmp_path, "--sizes", "128x128,64x128,96x96", "--steps", "6", "--candidate-policy", "patched")
    assert report["acceptable"] and report["ssim_mean"] > 0.999
    assert report["candidate_alignment"] == report["reference_alignment"]


@pytest.mark.slow
def test_on_the_edit_model_prompts_are_instruction_edits_and_packing_them_is_exact(tmp_path):
    """shapes-edit makes no images from text: every prompt uploads its source scene and asks for an
    edit; packed with other sizes (reference tokens and all) the edits equal the plain ones."""
    report = run_fidelity(tmp_path, "--model", "shapes-edit", "--sizes", "128x128,64x128", "--steps", "6",
                          "--candidate-policy", "patched", "--step-repeats", "1")
    assert report["edits"] and [p["edit"] for p in report["per_image"]] == [*EDIT_KINDS, EDIT_KINDS[0]]
    assert {"carried_out", "rest_kept", "all", "all_move"} <= set(report["reference_alignment"])
    assert report["acceptable"] and report["ssim_mean"] > 0.999
    assert report["candidate_alignment"] == report["reference_alignment"]
    assert report["candidate"]["steady_step_s"] > 0  # the steady batch's edits carried their uploads


@pytest.mark.slow
def test_a_block_cache_candidate_reports_its_reuse_and_steady_step_times(tmp_path):
    report = run_fidelity(tmp_path, "--candidate-block-cache", "0.2", "--step-repeats", "2")
    candidate, reference = report["candidate"], report["reference"]
    assert candidate["block_cache"] == 0.2 and reference["block_cache"] == 0.0
    assert candidate["reused_fraction"] > 0.2 and reference["reused_fraction"] == 0.0
    samples = candidate["steady_step_samples_s"]
    assert len(samples) == 2 and candidate["steady_step_s"] == sum(samples) / 2
    assert report["steady_step_ratio"] == candidate["steady_step_s"] / reference["steady_step_s"]
    assert report["ssim_mean"] < 1.0  # approximate: the images differ


@pytest.mark.slow
def test_a_controlnet_candidate_in_async_mode_is_measured_against_sync(tmp_path):
    from gouache.cli import main

    assert main(["make-controlnet", "--model", "shapes-unet", "--out", str(tmp_path / "layout")]) == 0
    report = run_fidelity(tmp_path, "--prompts", "3", "--steps", "4", "--controlnet", "layout", "--controlnet-dir",
                          str(tmp_path), "--candidate-controlnet-mode", "async")
    assert report["reference"]["controlnet_mode"] == "sync" and report["candidate"]["controlnet_mode"] == "async"
    assert report["controlnet"]["name"] == "layout" and report["steady_step_ratio"] is None
    assert 0 < report["ssim_mean"] < 1.0  # a step late: another image, near


def test_flags_that_cannot_work_are_refused(tmp_path, capsys):
    from gouache.cli import main

    out = str(tmp_path / "f.json")
    assert main(["bench", "fidelity", "--candidate-policy", "patched-slo", "--out", out]) == 2
    assert "give --cost-model" in capsys.readouterr().err
    assert main(["bench", "fidelity", "--cost-model", "c.json", "--out", out]) == 2
    assert "--cost-model would be ignored" in capsys.readouterr().err
    assert main(["bench", "fidelity", "--sizes", "128", "--out", out]) == 2
    assert "WxH" in capsys.readouterr().err
    assert main(["bench", "fidelity", "--patch-size", "64", "--out", out]) == 2
    assert "--patch-size would be ignored" in capsys.readouterr().err
    assert main(["bench", "fidelity", "--block-cache-max-reuse", "3", "--out", out]) == 2
    assert "--block-cache-max-reuse would be ignored" in capsys.readouterr().err
    assert main(["bench", "fidelity", "--candidate-block-cache", "2", "--out", out]) == 2
    assert "threshold must be in [0, 1.0]" in capsys.readouterr().err
    assert main(["bench", "fidelity", "--candidate-controlnet-mode", "async", "--out", out]) == 2
    assert "without --controlnet no prompt has a ControlNet" in capsys.readouterr().err
    assert main(["bench", "fidelity", "--controlnet-workers", "2", "--out", out]) == 2
    assert "without --controlnet no prompt has a ControlNet" in capsys.readouterr().err
    for flag in ("--candidate-steps", "--sheet-rows", "--prompts", "--step-repeats"):
        assert main(["bench", "fidelity", flag, "0", "--out", out]) == 2
        assert f"{flag} must be at least 1" in capsys.readouterr().err


def test_a_block_cache_predictor_candidate_reports_its_reuse_and_its_decisions_time(tmp_path):
    from gouache.models.digest import model_digest
    from gouache.models.zoo import load_pipeline
    from tests.block_cache.test_predictor import split_on_change

    path = tmp_path / "split.json"
    split_on_change(0.2, model=model_digest(load_pipeline("shapes-unet"))).save(path)
    report = run_fidelity(tmp_path, "--prompts", "3", "--steps", "8", "--candidate-block-cache", "0.5",
                          "--candidate-block-cache-predictor", str(path), "--step-repeats", "1")
    candidate = report["candidate"]
    assert candidate["block_cache_predictor"] == str(path) and candidate["reused_fraction"] > 0.1
    assert candidate["decide_share"] > 0 and report["reference"]["decide_share"] == 0


def test_a_predictor_without_a_candidate_block_cache_is_refused(tmp_path, capsys):
    from gouache.cli import main

    assert main(["bench", "fidelity", "--candidate-block-cache-predictor", "x.json",
                 "--out", str(tmp_path / "f.json")]) == 2
    assert "--candidate-block-cache-predictor would be ignored" in capsys.readouterr().err
