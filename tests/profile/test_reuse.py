"""`gouache profile --reuse` end to end on a tiny model: exact runs recorded per unit and block
(whole images, then patches), a forest trained and written, and a runner of the same model that
serves with it."""

import json

import numpy as np
import pytest

from gouache.cli import main


def test_profile_reuse_records_images_and_patches_and_writes_a_predictor_a_runner_takes(tmp_path):
    from gouache.block_cache.blocks import cacheable_blocks
    from gouache.config import BlockCacheConfig
    from gouache.models.zoo import load_pipeline
    from gouache.runner.model_runner import ModelRunner

    out = tmp_path / "reuse.json"
    assert main(["profile", "--reuse", "--model", "tiny-sd", "--requests", "2", "--reuse-steps", "3",
                 "--sizes", "64,96", "--patch-size", "32", "--bound", "0.5", "--trees", "4", "--depth", "3",
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())["report"]
    samples = np.load(out.with_suffix(".npz"))
    features, errors = samples["features"], samples["errors"]
    pipe = load_pipeline("tiny-sd")
    blocks = len(cacheable_blocks(pipe.unet))
    whole = 2 * 2 * blocks * (3 - 1)  # two requests, CFG rows, every block, every step after the first
    assert report["samples"] == len(errors) > whole and len(features) == len(errors)
    assert (features[:whole, 5] == 0).all() and (features[whole:, 5] == 1).all()  # images first, then patches
    pixels = features[:, 4]  # log2 pixels of 64 and 96 px images
    assert (np.isclose(pixels, 12.0) | np.isclose(pixels, np.log2(96 * 96))).all() and np.isclose(pixels, 12.0).any()
    assert (errors >= 0).all() and report["trees"] == 4 and 0 <= report["holdout_accuracy"] <= 1
    ModelRunner(pipe, block_cache=BlockCacheConfig(predictor=str(out)))  # the same model's: taken


def test_profile_reuse_of_a_model_that_only_edits_records_instruction_edits(tmp_path):
    from gouache.config import BlockCacheConfig
    from gouache.models.zoo import load_pipeline
    from gouache.runner.model_runner import ModelRunner

    out = tmp_path / "reuse.json"
    assert main(["profile", "--reuse", "--model", "shapes-edit", "--requests", "2", "--reuse-steps", "2",
                 "--sizes", "64,96", "--bound", "0.5", "--trees", "2", "--depth", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())["report"]
    assert report["prompts"] == "instruction edits" and report["samples"] > 0
    ModelRunner(load_pipeline("shapes-edit"), block_cache=BlockCacheConfig(predictor=str(out)))


@pytest.mark.parametrize(("argv", "message"), [
    (["--reuse", "--samples", "5"], "--samples would be ignored"),
    (["--bound", "0.1"], "--bound would be ignored: only --reuse"),
    (["--reuse", "--bound", "2"], "--bound is a relative output error"),
    (["--reuse", "--requests", "1"], "--requests and --reuse-steps must be >= 2"),
    (["--reuse", "--repeats", "3"], "--repeats would be ignored"),
    (["--reuse", "--ratios", "0.5"], "--ratios would be ignored"),
    (["--reuse", "--model", "tiny-sd3", "--patch-size", "32", "--requests", "2"], "--patch-size would be ignored"),
    (["--reuse", "--compile"], "--compile would be ignored: only the batch profile times compiled steps"),
    (["--edits", "--compile", "--compile-graphs", "4"], "--compile-graphs would be ignored: only the batch profile"),
    (["--devices", "2", "--compile"], "--compile would be ignored"),
    (["--compile-backend", "eager"], "--compile-backend would be ignored: it applies to compiled steps"),
])
def test_bad_reuse_arguments_are_refused(argv, message, capsys):
    assert main(["profile", "--model", "tiny-sd", *argv]) == 2
    assert message in capsys.readouterr().err
