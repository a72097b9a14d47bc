"""`gouache bench adapters` end to end on a tiny model, quickly: the file carries the bound, the
latency cases, the fidelity rows, the workflow mixes and the throughput runs that the closing
notes quote."""

import json

import pytest
from PIL import Image

from gouache.bench.workflows import CASES, parse_mixes
from gouache.cli import main


@pytest.mark.slow
def test_bench_adapters_writes_latency_fidelity_and_throughput(tmp_path):
    assert main(["make-lora", "--model", "tiny-sd", "--out", str(tmp_path / "ink.safetensors")]) == 0
    out = tmp_path / "adapters.json"
    assert main(["bench", "adapters", "--model", "tiny-sd", "--lora-dir", str(tmp_path), "--lora", "ink",
                 "--size", "64", "--steps", "3", "--repeats", "1", "--fidelity", "2", "--requests", "6",
                 "--rate", "1000", "--adapters", "3",
                 "--load-shares", "0.5", "--mixes", "0C/0L,1C/1L", "--controlnet-workers", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert len(result["similarity"]) == 3 and 0 <= result["bound"] <= 3
    [row] = result["latency"]["rows"]
    assert row["read_s"] > 0 and row["sync_s"] > row["read_s"] and row["bal_s"] > 0
    rows = result["fidelity"]["rows"]
    assert rows and all(0 <= r["ssim_min"] <= r["ssim_mean"] <= 1 for r in rows)
    mixes = result["workflows"]["rows"]
    assert [r["mix"] for r in mixes] == ["0C/0L", "1C/1L"]
    assert abs(mixes[0]["sequential ratio"] - 1) < 1e-9 and all(r[case] > 0 for r in mixes for case in CASES)
    runs = result["throughput"]["runs"]
    assert set(runs) == {"mixed", "per-adapter", "none"} and all(r["per_s"] > 0 for r in runs.values())
    assert runs["none"]["steps_by_mode"] == {}
    assert "split" in runs["per-adapter"]["steps_by_mode"]
    assert out.with_suffix(".md").exists() and out.with_suffix(".png").stat().st_size > 0
    assert Image.open(tmp_path / "adapters_sheet.png").width == (3 + len(rows)) * (64 + 8)


@pytest.mark.slow
def test_bench_adapters_on_an_instruction_edit_model_measures_edits(tmp_path, capsys):
    assert main(["make-lora", "--model", "shapes-edit", "--out", str(tmp_path / "ink.safetensors")]) == 0
    common = ["bench", "adapters", "--model", "shapes-edit", "--lora-dir", str(tmp_path), "--lora", "ink"]
    assert main([*common, "--mixes", "0C/1L"]) == 2
    assert "shapes-edit only edits" in capsys.readouterr().err
    out = tmp_path / "adapters.json"
    assert main([*common, "--size", "64", "--steps", "2", "--repeats", "1", "--fidelity", "5", "--requests", "3",
                 "--rate", "1000", "--adapters", "2", "--load-shares", "0.5", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["prompts"] == "instruction edits" and "workflows" not in result
    fidelity = result["fidelity"]
    assert fidelity["prompts"] == 5 and set(fidelity["sync_rates"]) == {"carried_out", "rest_kept", "all"}
    assert all(set(row["rates"]) == {"carried_out", "rest_kept", "all"} for row in fidelity["rows"])
    assert all(r["per_s"] > 0 for r in result["throughput"]["runs"].values())
    assert "carried out" in out.with_suffix(".md").read_text()
    sheet = Image.open(tmp_path / "adapters_sheet.png")  # upload, base, step 0, each bound, difference
    assert sheet.width == (4 + len(fidelity["rows"])) * (64 + 8) and sheet.height > 5 * 64


def test_bench_adapters_refuses_a_missing_adapter(tmp_path, capsys):
    assert main(["bench", "adapters", "--model", "tiny-sd", "--lora-dir", str(tmp_path), "--lora", "nope"]) == 2
    assert "no nope.safetensors" in capsys.readouterr().err


def test_controlnet_workers_without_mixes_are_refused(tmp_path, capsys):
    assert main(["bench", "adapters", "--mixes", "", "--controlnet-workers", "3", "--lora-dir", str(tmp_path)]) == 2
    assert "no workflow mix runs a ControlNet" in capsys.readouterr().err


def test_workflow_mixes_are_parsed_and_bounded():
    assert parse_mixes("0C/0L, 3c/2l") == [(0, 0), (3, 2)]
    with pytest.raises(ValueError, match="mC/nL"):
        parse_mixes("1C")
    with pytest.raises(ValueError, match="at most 3 ControlNets"):
        parse_mixes("4C/0L")
