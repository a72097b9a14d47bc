import json

import pytest
import torch

from gouache.bench.batching import parse_mix
from gouache.bench.denoiser_inputs import DenoiserBench
from gouache.cli import main
from gouache.models.zoo import load_pipeline


def test_parse_mix():
    assert parse_mix("SML") == ["S", "M", "L"]
    assert parse_mix("2S1L") == ["S", "S", "L"]
    with pytest.raises(ValueError, match="letters S/M/L"):
        parse_mix("SXL")


@pytest.mark.parametrize("name, attr, patch", [("tiny-sdxl", "unet", 4), ("tiny-sd3", "transformer", 4),
                                               ("tiny-flux", "transformer", 2)])
def test_bare_denoiser_bench_one_forward_equals_per_image(name, attr, patch):
    """The path `--model sdxl-arch|sd3-arch|flux-arch` takes on a GPU, checked on the tiny denoisers."""
    bench = DenoiserBench(getattr(load_pipeline(name), attr), [(8, 8), (8, 12), (16, 16)])
    with torch.no_grad():
        outputs = bench.one_forward(bench.layout(patch) if bench.family == "unet" else None)
        for i, out in enumerate(outputs):
            ref = bench._forward([i])[0]
            ref = ref.T.reshape(out.shape) if bench.family == "flux" else ref
            assert (out - ref).abs().max() <= 1e-4


def test_bench_batching_writes_table_json_and_plot(tmp_path):
    out = tmp_path / "b.json"
    args = ["bench", "batching", "--model", "tiny-sd", "--sizes", "64,96,128", "--mixes", "SM,2L", "--patch-size", "32",
            "--repeats", "1", "--out", str(out)]
    assert main(args) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["mix"] for r in rows] == ["SM", "2L"] and all(r["patched_ms"] > 0 for r in rows)
    assert rows[0]["forced_ms"] is None and rows[1]["forced_ms"] > 0  # the patches, forced on for one size
    assert out.with_suffix(".png").stat().st_size > 0 and "| SM |" in out.with_suffix(".md").read_text()
