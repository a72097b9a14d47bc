"""`gouache bench reuse-compare`: per setup and target SSIM, each decider's run reusing the most
among those that reach the target."""

import json

from gouache.cli import main


def write(tmp_path, name, ssim, reused, ratio=0.8, decide=0.0):
    report = {"ssim_mean": ssim, "steady_step_ratio": ratio,
              "candidate": {"reused_fraction": reused, "decide_share": decide}}
    (tmp_path / name).write_text(json.dumps(report))


def test_the_most_reuse_at_each_target_ssim_is_compared(tmp_path, capsys):
    write(tmp_path, "shapes-unet_image_threshold_0.05.json", 0.99, 0.30)
    write(tmp_path, "shapes-unet_image_threshold_0.1.json", 0.97, 0.50)
    write(tmp_path, "shapes-unet_image_threshold_0.2.json", 0.90, 0.70)
    write(tmp_path, "shapes-unet_image_predictor_0.3.json", 0.985, 0.45, decide=0.004)
    write(tmp_path, "shapes-unet_image_predictor_0.5.json", 0.96, 0.60, decide=0.006)
    (tmp_path / "reuse_shapes-unet.json").write_text("{}")  # not a fidelity run: skipped
    assert main(["bench", "reuse-compare", str(tmp_path)]) == 0
    rows = {r["ssim_target"]: r for r in json.loads((tmp_path / "compare.json").read_text())}
    assert rows[0.98]["threshold"]["value"] == 0.05 and rows[0.98]["predictor"]["value"] == 0.3
    assert round(rows[0.98]["reused_gain_points"]) == 15
    assert rows[0.95]["threshold"]["value"] == 0.1 and rows[0.95]["predictor"]["value"] == 0.5
    assert round(rows[0.95]["reused_gain_points"]) == 10 and rows[0.95]["decide_share_max"] == 0.006
    assert "| shapes-unet | image | 0.98 |" in capsys.readouterr().out


def test_a_directory_without_runs_is_refused(tmp_path, capsys):
    assert main(["bench", "reuse-compare", str(tmp_path)]) == 2
    assert "no fidelity runs" in capsys.readouterr().err
