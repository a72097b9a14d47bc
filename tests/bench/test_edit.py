"""`gouache bench edit` and `gouache profile --edits` end to end on a tiny DiT, quickly: their
files carry what the closing notes quote, and the fitted model plans live edits."""

import json

import numpy as np
import pytest
from PIL import Image

from gouache.bench.edit_cases import OUTLINE, outlined
from gouache.cli import main
from gouache.sched.costmodel import MaskCostModel, load


def test_bench_edit_writes_the_sweep_fidelity_and_throughput(tmp_path):
    out = tmp_path / "edit.json"
    assert main(["bench", "edit", "--model", "tiny-flux", "--size", "64", "--steps", "2", "--ratios", "0.25,1",
                 "--repeats", "1", "--edits", "1", "--requests", "2", "--templates", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [row["token_ratio"] for row in result["latency"]] == [0.25, 1.0]
    assert all(row["full_step_ms"] > 0 and row["replay_step_ms"] > 0 and row["disk_step_ms"] > 0
               for row in result["latency"])
    for variant in ("same_seed", "other_seed"):
        fidelity = result["fidelity"][variant]
        assert fidelity["unmasked_equal"] == 1 and 0 < fidelity["masked_ssim_mean"] <= 1
    assert set(result["throughput"]["runs"]) == {"orca+templates", "fcfs-static"}
    assert out.with_suffix(".md").exists() and out.with_suffix(".png").stat().st_size > 0


def test_bench_edit_on_an_instruction_edit_model_judges_masked_instruction_edits(tmp_path):
    out = tmp_path / "edit.json"
    assert main(["bench", "edit", "--model", "shapes-edit", "--size", "64", "--steps", "2", "--ratios", "1",
                 "--repeats", "1", "--edits", "4", "--requests", "0", "--out", str(out)]) == 0
    fidelity = json.loads(out.read_text())["fidelity"]
    assert fidelity["kind"] == "instruction" and set(fidelity["exact_rates"]) == {"carried_out", "rest_kept", "all"}
    for variant in ("same_seed", "other_seed"):
        edits = fidelity[variant]["per_edit"]
        assert [e["prompt"].split()[0] for e in edits] == ["make", "move", "remove", "add"]
        assert fidelity[variant]["unmasked_equal"] == 4 and set(fidelity[variant]["rates"]) == {
            "carried_out", "rest_kept", "all"}
        # each edit's verdicts, exact and replayed, add up to the rates
        assert sum(e["exact_ok"] for e in edits) == 4 * fidelity["exact_rates"]["all"]
        assert sum(e["ok"] for e in edits) == 4 * fidelity[variant]["rates"]["all"]
    assert "carried out" in out.with_suffix(".md").read_text()
    sheet = np.asarray(Image.open(tmp_path / "edit_sheet.png").convert("RGB"))
    assert sheet.shape[1] == 6 * (64 + 8) and sheet.shape[0] > 4 * 64  # six columns, a row per edit
    assert (sheet == OUTLINE).all(axis=-1).any()  # the masks are outlined on the templates


def test_outlined_draws_the_border_of_the_mask_and_nothing_else():
    image = np.zeros((8, 8, 3), np.uint8)
    mask = np.zeros((8, 8), np.float32)
    mask[2:6, 1:4] = 1
    drawn = (outlined(image, mask) == OUTLINE).all(axis=-1)
    inside = np.zeros((8, 8), bool)
    inside[3:5, 2:3] = True
    assert drawn.sum() == 4 * 3 - 2 and not (drawn & inside).any() and not drawn[mask == 0].any()


@pytest.mark.parametrize("name", ["tiny-sd3", "tiny-sd"])
def test_profile_edits_fits_a_mask_cost_model_the_server_takes(tmp_path, name):
    out = tmp_path / "mask.json"
    assert main(["profile", "--edits", "--model", name, "--sizes", "64", "--ratios", "0.25,1",
                 "--repeats", "1", "--out", str(out)]) == 0
    model = load(out)
    assert isinstance(model, MaskCostModel) and model.plain is not None and model.tensors == 3
    assert (model.text_tokens > 0) == (name == "tiny-sd3") and model.compute_time([(16, 0.25)] * 2) > 0
    samples = json.loads(out.with_suffix(".report.json").read_text())["samples"]
    assert len(samples) == 4 and all(s["replay_s"] > 0 and s["plain_s"] > 0 for s in samples)


@pytest.mark.parametrize(("argv", "message"), [
    (["--edits", "--model", "tiny-sd3", "--max-batch", "3"], "--max-batch would be ignored"),
    (["--model", "tiny-sd3", "--ratios", "0.5"], "--ratios would be ignored"),
])
def test_profile_edits_refuses_flags_it_would_ignore(capsys, argv, message):
    assert main(["profile", *argv]) != 0
    assert message in capsys.readouterr().err
