"""`gouache make-lora` and `gouache profile-lora` end to end on a tiny model: the bound is the
first step whose latents with and without the adapter part by more than the threshold."""

import json

import pytest

from gouache.cli import main


def test_profile_lora_finds_the_step_the_adapter_starts_to_matter(tmp_path):
    lora, out = tmp_path / "ink.safetensors", tmp_path / "bound.json"
    assert main(["make-lora", "--model", "tiny-sd", "--out", str(lora), "--rank", "8"]) == 0
    assert main(["profile-lora", "--model", "tiny-sd", "--lora", str(lora), "--prompts", "2", "--steps", "4",
                 "--size", "64", "--threshold", "1.0", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    similarity = result["similarity"]
    assert len(similarity) == 4 and all(-1 <= s <= 1 for s in similarity) and min(similarity) < 1
    assert result["bound"] == 0  # with a threshold of 1 any difference counts, from the first step
    assert main(["profile-lora", "--model", "tiny-sd", "--lora", str(lora), "--prompts", "1", "--steps", "4",
                 "--size", "64", "--threshold", "0.5", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["bound"] == 4  # never below 0.5: it may join as late as the end


def test_profile_lora_on_a_model_that_only_edits_profiles_instruction_edits(tmp_path):
    lora, out = tmp_path / "ink.safetensors", tmp_path / "bound.json"
    assert main(["make-lora", "--model", "shapes-edit", "--out", str(lora)]) == 0
    assert main(["profile-lora", "--model", "shapes-edit", "--lora", str(lora), "--prompts", "2", "--steps", "3",
                 "--size", "64", "--out", str(out)]) == 0
    similarity = json.loads(out.read_text())["similarity"]
    assert len(similarity) == 3 and min(similarity) < 1  # the adapter moved the edits' latents


@pytest.mark.parametrize(("argv", "message"), [
    (["profile-lora", "--lora", "missing.safetensors"], "existing .safetensors file"),
    (["make-lora", "--model", "tiny-sd", "--out", "x.bin"], "a .safetensors file"),
    (["make-lora", "--model", "tiny-sd", "--out", "x.safetensors", "--rank", "0"], "--rank must be >= 1"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err
