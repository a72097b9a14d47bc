"""`gouache train` end to end for a few steps: weights that load into the built-in architectures,
a loss curve, and the same weights again from the same seed."""

import json

import pytest
import torch
from safetensors.torch import load_file

from gouache.cli import main
from gouache.runner import trained


@pytest.fixture(scope="module")
def trained_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("weights")
    for kind in ("vae", "unet", "inpaint", "dit"):
        assert main(["train", kind, "--steps", "2", "--out", str(out), "--report", str(out)]) == 0
    return out


def test_each_kind_writes_weights_a_curve_and_the_command(trained_dir):
    for kind, name in (("vae", "shapes-vae"), ("unet", "shapes-unet"), ("inpaint", "shapes-unet-inpaint"), ("dit", "shapes-dit")):
        assert trained.weights_path(name, trained_dir).is_file()
        report = json.loads((trained_dir / f"train_{kind}.json").read_text())
        assert report["command"] == f"gouache train {kind} --seed 0 --steps 2"
        assert report["steps"] == 2 and report["seconds"] > 0
        assert (trained_dir / f"train_{kind}.png").stat().st_size > 1000


def test_the_vae_stores_its_latent_scale_and_shift(trained_dir):
    vae = trained.load_vae(trained_dir)
    report = json.loads((trained_dir / "train_vae.json").read_text())
    assert vae.config.scaling_factor == pytest.approx(1 / report["extra"]["latent_std"])
    assert vae.config.shift_factor == pytest.approx(report["extra"]["latent_mean"])


def test_the_same_seed_trains_the_same_weights(trained_dir, tmp_path):
    (tmp_path / "shapes-vae.safetensors").write_bytes((trained_dir / "shapes-vae.safetensors").read_bytes())
    assert main(["train", "unet", "--steps", "2", "--out", str(tmp_path), "--report", str(tmp_path)]) == 0
    again, first = load_file(str(tmp_path / "shapes-unet.safetensors")), load_file(str(trained_dir / "shapes-unet.safetensors"))
    assert again.keys() == first.keys()
    assert all(torch.equal(again[k], first[k]) for k in first)


def test_unet_and_dit_need_the_vae_first(tmp_path, capsys):
    assert main(["train", "unet", "--steps", "1", "--out", str(tmp_path), "--report", str(tmp_path)]) == 2
    assert "shapes-vae.safetensors is missing" in capsys.readouterr().err


def test_steps_must_be_positive(tmp_path, capsys):
    assert main(["train", "vae", "--steps", "0", "--out", str(tmp_path)]) == 2
    assert "--steps must be at least 1" in capsys.readouterr().err
