"""`gouache train` end to end for a few steps: weights that load into the built-in architectures,
a loss curve, and the same weights again from the same seed, in one process or data-parallel in two."""

import json

import pytest
import torch
from safetensors.torch import load_file

from gouache.cli import main
from gouache.models import trained


@pytest.fixture(scope="module")
def trained_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("weights")
    for kind in ("vae", "unet", "inpaint", "dit", "edit", "lora", "edit-lora", "controlnet"):
        workers = "2" if kind == "unet" else "1"  # each spawn costs seconds: one kind tries two processes
        assert main(["train", kind, "--steps", "2", "--workers", workers, "--out", str(out), "--report", str(out)]) == 0
    return out


@pytest.mark.slow
def test_each_kind_writes_weights_a_curve_and_the_command(trained_dir):
    for kind, name in (("vae", "shapes-vae"), ("unet", "shapes-unet"), ("inpaint", "shapes-unet-inpaint"),
                       ("dit", "shapes-dit"), ("edit", "shapes-edit"), ("lora", "loras/shapes-unet/palette"),
                       ("edit-lora", "loras/shapes-edit/palette")):
        assert trained.weights_path(name, trained_dir).is_file()
        report = json.loads((trained_dir / f"train_{kind}.json").read_text())
        workers = 2 if kind == "unet" else 1
        assert report["command"] == f"gouache train {kind} --seed 0 --steps 2 --workers {workers}"
        assert (report["extra"]["workers"], report["extra"]["device"]) == (workers, "cpu")
        assert report["steps"] == 2 and report["seconds"] > 0
        assert (trained_dir / f"train_{kind}.png").stat().st_size > 1000


@pytest.mark.slow
def test_the_edit_model_serves_instruction_edits_as_its_kontext_pipeline_makes_them(trained_dir):
    """shapes-edit's weights in FLUX.1 Kontext's pipeline: the engine's instruction edit equals the
    pipeline's at the model's prompt length (its T5 tokenizer's, which the Flux family pads to)."""
    import numpy as np
    from PIL import Image

    from gouache.data.edits import EditDataset
    from gouache.models.zoo import shapes_kontext
    from gouache.request import ImageRequest
    from gouache.uploads import Upload
    from tests.engine.test_exactness import run_engine

    transformer, clip, t5 = trained.load_edit(trained_dir)
    pipe = shapes_kontext(trained.load_vae(trained_dir), clip, t5, transformer)
    source, _, edit, _ = EditDataset(0, [(64, 96)]).item(0)
    request = ImageRequest("edit", edit.instruction, 96, 64, 3, 1.0, seed=1, image=b"-")
    latents = run_engine(pipe, {0: [(request, {"upload": Upload(np.ascontiguousarray(source))})]})
    expected = pipe(prompt=edit.instruction, image=Image.fromarray(source), height=64, width=96, num_inference_steps=3,
                    generator=torch.Generator().manual_seed(1), output_type="latent", _auto_resize=False,
                    max_area=64 * 96, max_sequence_length=trained.EDIT_TEXT_LENGTH).images
    assert (latents["edit"] - expected).abs().max() <= 1e-4


@pytest.mark.slow
def test_lora_writes_an_adapter_the_server_reads(trained_dir):
    from gouache.lora.files import Target, read_lora
    from gouache.models.zoo import load_pipeline
    from gouache.train.lora import RANK

    path = trained_dir / "loras" / "shapes-unet" / "palette.safetensors"
    # the built-in's architecture, any weights
    lora = read_lora(path, Target.of(load_pipeline("shapes-unet")), "palette")
    report = json.loads((trained_dir / "train_lora.json").read_text())
    assert len(lora.layers) == report["extra"]["layers"] and report["extra"]["rank"] == RANK
    assert all(layer.scale == 1.0 and layer.down.shape[0] == RANK for layer in lora.layers.values())
    assert any(layer.down.ndim == 4 for layer in lora.layers.values())  # convolutions too (LoCon)


@pytest.mark.slow
def test_edit_lora_writes_an_adapter_of_the_edit_model_as_diffusers_applies_it(trained_dir):
    import numpy as np

    from gouache.config import LoraConfig
    from gouache.data.edits import EditDataset
    from gouache.lora.files import Target, read_lora
    from gouache.models.zoo import shapes_kontext
    from gouache.request import ImageRequest
    from gouache.runner.model_runner import ModelRunner
    from gouache.uploads import Upload
    from tests.engine.test_exactness import run_engine

    def pipeline():
        transformer, clip, t5 = trained.load_edit(trained_dir)
        return shapes_kontext(trained.load_vae(trained_dir), clip, t5, transformer)

    directory = trained_dir / "loras" / "shapes-edit"
    lora = read_lora(directory / "palette.safetensors", Target.of(pipeline()), "palette")
    report = json.loads((trained_dir / "train_edit-lora.json").read_text())
    assert len(lora.layers) == report["extra"]["layers"]
    assert {"x_embedder", "proj_out", "transformer_blocks.0.attn.add_q_proj"} <= set(lora.layers)
    source, _, edit, _ = EditDataset(0, [(64, 64)]).item(0)

    def edited(runner, loras=()):
        request = ImageRequest("edit", edit.instruction, 64, 64, 2, 1.0, seed=1, image=b"-", loras=loras)
        return run_engine(None, {0: [(request, {"upload": Upload(np.ascontiguousarray(source))})]},
                          runner=runner)["edit"]

    ours = edited(ModelRunner(pipeline(), lora=LoraConfig(str(directory))), (("palette", 1.0),))
    reference = pipeline()
    reference.load_lora_weights(str(directory), weight_name="palette.safetensors", adapter_name="palette")
    reference.fuse_lora()
    reference.unload_lora_weights()  # the fused weights stay
    assert (ours - edited(ModelRunner(reference))).abs().max() <= 1e-4
    assert (ours - edited(ModelRunner(pipeline()))).abs().max() > 1e-3  # two steps of training moved it


@pytest.mark.slow
def test_controlnet_writes_a_directory_the_server_takes(trained_dir):
    from gouache.config import ControlNetConfig
    from gouache.controlnet.runtime import ControlRuntime
    from gouache.models.zoo import load_pipeline

    report = json.loads((trained_dir / "train_controlnet.json").read_text())
    assert report["command"] == "gouache train controlnet --seed 0 --steps 2 --workers 1" and report["steps"] == 2
    directory = trained_dir / "controlnets" / "shapes-unet"
    runtime = ControlRuntime(ControlNetConfig(str(directory)), load_pipeline("shapes-unet"))
    assert runtime.load("layout")["loaded"]


@pytest.mark.slow
def test_the_vae_stores_its_latent_scale_and_shift(trained_dir):
    vae = trained.load_vae(trained_dir)
    report = json.loads((trained_dir / "train_vae.json").read_text())
    assert vae.config.scaling_factor == pytest.approx(1 / report["extra"]["latent_std"])
    assert vae.config.shift_factor == pytest.approx(report["extra"]["latent_mean"])


def weights_after(out, workers, trained_dir):
    out.mkdir()
    (out / "shapes-vae.safetensors").write_bytes((trained_dir / "shapes-vae.safetensors").read_bytes())
    assert main(["train", "unet", "--steps", "2", "--workers", str(workers), "--out", str(out),
                 "--report", str(out)]) == 0
    return load_file(str(out / "shapes-unet.safetensors"))


@pytest.mark.slow
def test_the_same_seed_and_workers_train_the_same_weights(trained_dir, tmp_path):
    first = load_file(str(trained_dir / "shapes-unet.safetensors"))
    again = weights_after(tmp_path / "again", 2, trained_dir)
    assert again.keys() == first.keys()
    assert all(torch.equal(again[k], first[k]) for k in first)
    alone = weights_after(tmp_path / "alone", 1, trained_dir)  # another split of the batches
    assert not all(torch.equal(alone[k], first[k]) for k in first)


@pytest.mark.slow
def test_a_resumed_run_continues_the_weights_and_lists_the_runs_before_it(trained_dir, tmp_path, capsys):
    """`--resume`: the weights in --out go on training (on the batches after the first run's, with
    noise of their own, at the learning rate asked), and the report names every run before, so the
    chain can be replayed."""
    first = weights_after(tmp_path / "w", 1, trained_dir)
    out = str(tmp_path / "w")
    assert json.loads((tmp_path / "w" / "train_unet.json").read_text())["schedule"]["lr"] == 1e-3  # unet's own
    args = ["train", "unet", "--steps", "3", "--workers", "1", "--out", out, "--report", out, "--resume"]
    assert main([*args, "--lr", "2.5e-4"]) == 0
    report = json.loads((tmp_path / "w" / "train_unet.json").read_text())
    assert report["command"] == "gouache train unet --seed 0 --steps 3 --workers 1 --resume --lr 0.00025"
    assert report["schedule"]["lr"] == 2.5e-4
    runs = report["extra"]["runs_before"]
    assert [(r["command"], r["steps"]) for r in runs] == [("gouache train unet --seed 0 --steps 2 --workers 1", 2)]
    assert (report["extra"]["steps_before"], report["extra"]["total_steps"]) == (2, 5)
    assert report["extra"]["total_minutes"] >= runs[0]["minutes"]
    resumed = load_file(str(tmp_path / "w" / "shapes-unet.safetensors"))
    fresh = weights_after(tmp_path / "fresh", 1, trained_dir)  # two steps from the seed's initial weights
    assert all(torch.equal(fresh[k], first[k]) for k in first)
    assert sum(not torch.equal(resumed[k], first[k]) for k in first) > len(first) // 2  # it trained on
    assert main(["train", "vae", "--steps", "1", "--out", out, "--report", out, "--resume"]) == 2
    assert "--resume continues unet, dit, edit; vae trains from the start" in capsys.readouterr().err
    assert main(["train", "dit", "--steps", "1", "--out", out, "--report", out, "--resume"]) == 2
    assert "shapes-dit.safetensors is missing" in capsys.readouterr().err


def test_unet_and_dit_need_the_vae_first(tmp_path, capsys):
    assert main(["train", "unet", "--steps", "1", "--out", str(tmp_path), "--report", str(tmp_path)]) == 2
    assert "shapes-vae.safetensors is missing" in capsys.readouterr().err


def test_steps_workers_lr_and_shift_must_be_positive(tmp_path, capsys):
    assert main(["train", "vae", "--steps", "0", "--out", str(tmp_path)]) == 2
    assert "--steps must be at least 1" in capsys.readouterr().err
    for lr in ("0", "-1e-4", "nan", "inf"):
        assert main(["train", "vae", f"--lr={lr}", "--out", str(tmp_path)]) == 2
        assert f"--lr must be a positive number, got {float(lr)}" in capsys.readouterr().err
    assert main(["train", "vae", "--workers", "0", "--out", str(tmp_path)]) == 2
    assert "--workers must be at least 1" in capsys.readouterr().err
    assert main(["train", "dit", "--timestep-shift", "0", "--out", str(tmp_path)]) == 2
    assert "--timestep-shift must be a positive number, got 0.0" in capsys.readouterr().err
    assert main(["train", "unet", "--timestep-shift", "1", "--out", str(tmp_path)]) == 2
    assert "--timestep-shift is the dit's; unet trains at its own noise levels" in capsys.readouterr().err


def test_workers_are_cpu_processes(tmp_path, capsys):
    assert main(["train", "vae", "--device", "cuda", "--workers", "2", "--out", str(tmp_path)]) == 2
    assert "on --device cuda train with --workers 1" in capsys.readouterr().err


@pytest.mark.parametrize("device, message", [
    ("gpu", "'gpu' is not a torch device; give cpu or cuda"),
    ("meta", "--device meta: gouache trains on cpu or cuda"),
])
def test_devices_it_cannot_train_on_are_refused(tmp_path, capsys, device, message):
    assert main(["train", "vae", "--device", device, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_cuda_without_a_gpu_is_refused(tmp_path, capsys):
    assert main(["train", "vae", "--device", "cuda", "--out", str(tmp_path)]) == 2
    assert "torch sees no CUDA device on this machine" in capsys.readouterr().err
