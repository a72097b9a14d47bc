"""`gouache bench fullsize`: its quick run on the tiny models (the full-size ones take minutes
per step group on 2 cores) measures every section on its own path; FLOPs count attention; the
full-size pipelines feed their denoisers conditioning of the published widths."""

import json

import pytest
import torch

from gouache.cli import main


@pytest.mark.slow
def test_quick_run_measures_every_section(tmp_path):
    out = tmp_path / "fullsize.json"
    assert main(["bench", "fullsize", "--quick", "--models", "tiny-sdxl,tiny-sd3", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["peak_tflops"]["bf16"] > 0 and data["peak_tflops"]["fp32"] > 0
    for model in ("tiny-sdxl", "tiny-sd3"):
        for size in ("128", "256"):
            cell = data["mfu"][model][size]["eager"]
            # no upper bound on mfu: the peak is timed while pytest's other worker may run (a CI run
            # measured the peak at half the machine, then a cell at 1.5x it)
            assert cell["ms"] > 0 and cell["tflops"] > 0 and cell["mfu"] > 0
        assert data["mfu"][model]["256"]["eager"]["tflops"] > 1.5 * data["mfu"][model]["128"]["eager"]["tflops"]
        assert data["patched_over_grouped"][model]["128+256"]["eager"] > 0
        template = data["template_over_full"][model]["0.1"]
        assert template["eager"] > 0 and template["tokens"] == pytest.approx(0.1, abs=0.05)
        assert set(data["lora"][model]) == {"merged", "segmented rank 16", "per adapter rank 16"}
        assert data["lora"][model]["per adapter rank 16"]["eager"] > 0
        cache = data["block_cache"][model]
        assert set(cache) == {"image", "patch" if model == "tiny-sdxl" else "token"}
        for row in cache.values():  # the fixed share is what the cache did: every other unit reused
            assert row["reused"] == pytest.approx(0.5, abs=0.1) and row["eager"] > 0
        loading = data["lora_loading"][model]
        assert (loading["steps"], loading["bound"], loading["rank"]) == (4, 1, 16) and loading["file_mb"] > 0
        assert all(loading[f"{case}_over_none"] > 0 for case in ("in memory", "sync", "bal"))
        park = data["park"][model]
        assert park["size"] == 256 and park["parked_mb"] > 0 and park["park_ms"] > 0 and park["resumed_step_ms"] > 0
    control = data["controlnet"]["tiny-sdxl"]
    assert control["ms"]["plain"] > 0 and control["sync"] > 0 and control["async"] > 0
    ulysses = data["ulysses"]
    assert ulysses["model"] == "tiny-sd3" and set(ulysses["ms"]) == {"degree 1, 1 thread", "degree 1, 2 threads",
                                                                       "degree 2"}
    assert 0 < ulysses["collective_share"] < 1
    table = out.with_suffix(".md").read_text()
    assert "| tiny-sd3 | 0.1 | 0.10 |" in table and "collectives" in table


def test_flops_count_the_fused_attention():
    from gouache.bench.fullsize_sections import flop_counter

    q = torch.randn(1, 4, 128, 32)
    with flop_counter() as counter:
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
    assert counter.get_total_flops() == 2 * (2 * 4 * 128 * 128 * 32)  # QK^T and PV, each 2 * heads * n^2 * d


@pytest.mark.parametrize("name", ["sdxl-arch", "sd3-arch"])
def test_full_size_pipelines_condition_at_the_published_widths(name):
    from gouache.models.zoo import arch_pipeline

    pipe = arch_pipeline(name, "bfloat16", "meta")  # shapes only: nothing allocated
    widths = pipe.text_encoder.config.hidden_size + pipe.text_encoder_2.config.hidden_size
    if name == "sdxl-arch":
        c = pipe.unet.config
        assert widths == c.cross_attention_dim == 2048
        pooled = pipe.text_encoder_2.config.projection_dim
        assert pooled + 6 * c.addition_time_embed_dim == c.projection_class_embeddings_input_dim
    else:
        c = pipe.transformer.config
        assert widths == c.pooled_projection_dim == 2048 and c.joint_attention_dim == 4096
        assert pipe.text_encoder_3 is None  # SD3 then pads with 256 T5 tokens of zeros
    assert pipe.vae.config.latent_channels == c.in_channels and pipe.vae.dtype == torch.bfloat16


def test_a_quantized_variant_runs_a_quantized_copy_of_the_denoiser_alone():
    from gouache.bench.fullsize_sections import variant_pipes
    from gouache.models.zoo import load_pipeline
    from gouache.runner.quantize import quantized

    pipe = load_pipeline("tiny-sdxl")
    before = {name: p.clone() for name, p in pipe.unet.named_parameters()}
    pipes = variant_pipes(pipe, ["eager", "int8"])
    assert pipes["eager"] is pipe and quantized(pipe.unet) is None
    assert quantized(pipes["int8"].unet) == "int8" and pipes["int8"].text_encoder is pipe.text_encoder
    assert all(torch.equal(p, before[name]) for name, p in pipe.unet.named_parameters())  # the baseline's own weights


def test_arguments_out_of_range_are_refused(capsys):
    for argv, what in ((["--sizes", "200,512"], "--sizes"), (["--mixes", "256"], "--mixes"),
                       (["--masks", "0"], "--masks"), (["--share", "1"], "--share"), (["--share", "0.4"], "--share"),
                       (["--skip", "nothing"], "--skip"),
                       (["--compile-cache", "/tmp/x"], "--compile-cache"),
                       (["--compile-graphs", "4"], "--compile-graphs"),
                       (["--variants", "compiled"], "--variants"), (["--device", "tpu"], "--device"),
                       (["--variants", "eager,fp8"], "fp8")):
        assert main(["bench", "fullsize", *argv]) == 2
        err = capsys.readouterr().err
        assert "gouache: error:" in err and what in err


def test_a_section_pattern_writes_a_file_per_section_measured(tmp_path):
    from gouache.bench.fullsize import write_results

    summary = {"device": "NVIDIA H200", "peak_tflops": {"bf16": 790.0, "fp32": 51.0}, "torch_threads": 2, "repeats": 5,
               "quick": False, "mfu": {"sdxl-arch": {"512": {"eager": {"ms": 30.0, "tflops": 11.0, "mfu": 0.46}}}},
               "patched_over_grouped": {}, "lora": {"sdxl-arch": {"merged": {"eager": 1.01, "mode": "merged"}}}}
    write_results(str(tmp_path / "{section}_sdxl-arch_h200.json"), "gouache bench fullsize --device cuda", summary, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "lora_sdxl-arch_h200.json", "lora_sdxl-arch_h200.md", "mfu_sdxl-arch_h200.json", "mfu_sdxl-arch_h200.md"]
    mfu = json.loads((tmp_path / "mfu_sdxl-arch_h200.json").read_text())
    assert "lora" not in mfu and mfu["mfu"] == summary["mfu"] and mfu["peak_tflops"]["bf16"] == 790.0
    table = (tmp_path / "lora_sdxl-arch_h200.md").read_text()
    assert "on NVIDIA H200" in table and "| sdxl-arch | merged | 1.01 | merged |" in table and "MFU" not in table
