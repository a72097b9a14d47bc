import argparse
import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from gouache.bench.serve import free_port, wait_healthy
from gouache.cli import build_parser, main
from gouache.sched.policies import POLICIES


@pytest.mark.slow
def test_help_lists_every_command():
    out = subprocess.run([sys.executable, "-m", "gouache.cli", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for command in ("serve", "generate", "edit", "models", "export-model", "train", "profile", "simulate",
                    "reproduce", "bench"):
        assert command in out


def test_generate_offline_writes_an_image_of_the_asked_size(tmp_path, capsys):
    out = tmp_path / "fox.png"
    assert main(["generate", "a red fox", "--model", "tiny-sdxl", "--size", "64x48", "--steps", "2", "--seed", "1",
                 "-o", str(out)]) == 0
    assert Image.open(out).size == (64, 48)


def test_exported_model_directory_serves_the_same_images(tmp_path):
    directory = tmp_path / "tiny-sd3"
    assert main(["export-model", "tiny-sd3", str(directory)]) == 0
    for model, name in (("tiny-sd3", "a.png"), (str(directory), "b.png")):
        assert main(["generate", "fox", "--model", model, "--size", "32x32", "--steps", "2",
                     "-o", str(tmp_path / name)]) == 0
    assert Image.open(tmp_path / "a.png").tobytes() == Image.open(tmp_path / "b.png").tobytes()


def test_edit_offline_keeps_pixels_outside_the_mask(tmp_path):
    original = Image.effect_noise((64, 64), 60).convert("RGB")
    mask = Image.new("RGBA", (64, 64), (0, 0, 0, 255))
    mask.paste((0, 0, 0, 0), (0, 0, 32, 64))  # repaint the left half
    original.save(tmp_path / "in.png")
    mask.save(tmp_path / "mask.png")
    args = ["edit", "a cat", "--image", str(tmp_path / "in.png"), "--mask", str(tmp_path / "mask.png"),
            "--size", "64x64", "--steps", "2", "-o", str(tmp_path / "out.png")]
    assert main(args) == 0
    out = Image.open(tmp_path / "out.png")
    assert out.crop((32, 0, 64, 64)).tobytes() == original.crop((32, 0, 64, 64)).tobytes()


def test_edit_offline_without_size_keeps_the_image_size(tmp_path):
    Image.effect_noise((96, 64), 60).convert("RGB").save(tmp_path / "in.png")
    args = ["edit", "a cat", "--image", str(tmp_path / "in.png"), "--steps", "2", "-o", str(tmp_path / "out.png")]
    assert main(args) == 0
    assert Image.open(tmp_path / "out.png").size == (96, 64)  # not the model's default, 128x128


def test_configuration_mistakes_are_clear_errors(tmp_path, capsys):
    assert main(["generate", "fox", "--size", "50x50", "-o", str(tmp_path / "x.png")]) == 2
    assert "multiple of 32" in capsys.readouterr().err
    assert main(["generate", "fox", "--model", "no-such-model", "-o", str(tmp_path / "x.png")]) == 2
    assert "shapes-unet" in capsys.readouterr().err
    assert main(["generate", "fox", "--model", "tiny-qwen-image-edit", "-o", str(tmp_path / "x.png")]) == 2
    assert "edits images and makes none from text alone: use `gouache edit`" in capsys.readouterr().err
    assert main(["generate", "fox", "--model", "tiny-qwen-image", "--steps", "1", "-o", str(tmp_path / "x.png")]) == 2
    assert "takes at least 2 steps" in capsys.readouterr().err


def test_simulate_runs_policies_on_the_same_workload_and_writes_json(tmp_path, capsys):
    out = tmp_path / "sim.json"
    args = ["simulate", "--requests", "50", "--policies", "orca,patched-slo", "--out", str(out)]
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "| orca |" in table and "| patched-slo |" in table
    data = json.loads(out.read_text())
    assert [r["policy"] for r in data["results"]] == ["orca", "patched-slo"]
    assert all(len(r["requests"]) == 50 for r in data["results"])


def test_profile_writes_a_cost_model_the_policies_can_use(tmp_path, capsys):
    from gouache.sched.costmodel import load

    out = tmp_path / "cost.json"
    args = ["profile", "--model", "tiny-sd3", "--sizes", "64,96", "--samples", "8",
            "--max-batch", "2", "--repeats", "1", "--out", str(out)]
    assert main([*args, "--patch-size", "32"]) == 2  # a DiT packs tokens: it would ignore the flag
    assert "--patch-size would be ignored" in capsys.readouterr().err
    assert main(args) == 0
    model = load(out)
    assert model.step_time([(64, 64)], patched=True) > 0  # pixels, as the scheduler sees them
    assert model.step_time([(64, 64), (96, 96)], patched=True) > 0
    assert model.step_time([(64, 64), (64, 64)], patched=False) == model.grouped[(64, 64)][2]  # plain forwards measured
    assert len(model.table) == 5  # all of 64, 96, 64+64, 64+96, 96+96 were timed
    prep, post = model.stage_time((96, 96))
    assert prep > 0 and post > 0


def test_profile_of_a_video_model_prices_clips_by_their_frames(tmp_path, capsys):
    from gouache.sched.costmodel import load

    out = tmp_path / "cost.json"
    args = ["profile", "--model", "tiny-wan", "--samples", "8", "--max-batch", "2", "--repeats", "1", "--out", str(out)]
    assert main([*args, "--sizes", "32x32x5,32x32x6"]) == 2
    assert "--sizes: 32x32x6: a clip has 1 + a multiple of 4 frames" in capsys.readouterr().err
    assert main([*args, "--sizes", "48x32x9,32x32x5,32"]) == 0
    model = load(out)
    assert model.resolutions == [(32, 48, 9), (32, 32, 5), (32, 32)]
    assert model.step_time([(32, 48, 9), (32, 32, 5)], patched=True) > 0  # one packed forward, measured
    assert model.step_time([(32, 32, 5), (32, 32, 5)], patched=False) == model.grouped[(32, 32, 5)][2]
    prep, post = model.stage_time((32, 48, 9))  # its post-processing: the VAE and the MP4
    assert prep > 0 and post > 0
    assert main(["profile", "--model", "tiny-sd3", "--sizes", "64x64x5", "--out", str(out)]) == 2
    assert "tiny-sd3 makes images; a size is S or WxH" in capsys.readouterr().err


@pytest.mark.slow
def test_sim_to_real_compares_live_and_simulated_latencies(tmp_path):
    cost = tmp_path / "cost.json"
    assert main(["profile", "--model", "tiny-sd3", "--sizes", "64,96", "--samples", "8",
                 "--max-batch", "2", "--repeats", "1", "--out", str(cost)]) == 0
    out = tmp_path / "s2r.json"
    args = ["bench", "sim-to-real", "--model", "tiny-sd3", "--cost-model", str(cost), "--sizes", "64",
            "--requests", "3", "--rate", "5", "--steps", "2", "--max-batch-size", "2",
            "--policies", "patched,round-knapsack", "--slo-scale", "100", "--out", str(out)]
    assert main(args) == 0
    data = json.loads(out.read_text())
    for policy in ("patched", "round-knapsack"):
        run = data["runs"][policy]
        assert len(run["live"]) == len(run["simulated"]) == 3  # generous SLOs: nothing dropped
        assert all(v > 0 for v in [*run["live"].values(), *run["simulated"].values()])
        assert run["live_forward_over_predicted_median"] > 0 and run["live_prep_median_s"] > 0
    assert ([(r["policy"], r["source"]) for r in data["rows"]][:2]
            == [("patched", "live engine"), ("patched", "simulator")])
    speed = data["runs"]["patched"]["live_forward_over_predicted_median"]
    assert data["rows"][2]["source"] == f"simulator, steps x {speed:.2f}"
    assert len(data["runs"]["patched"]["simulated_at_live_speed"]) == 3


class _EngineBuilt(Exception):
    """Raised by the stand-in `build_engine`: the flags were accepted."""


@pytest.fixture
def built_configs(monkeypatch):
    """`gouache serve` up to building its engine: the configs it would build it from."""
    from gouache.engine import build

    configs = {}

    def build_engine(model_config, engine_config, sched_config):
        configs.update(model=model_config, engine=engine_config, scheduler=sched_config)
        raise _EngineBuilt

    monkeypatch.setattr(build, "build_engine", build_engine)
    return configs


def _refused(capsys, argv: list[str], flag: str) -> bool:
    code = main(argv)
    err = capsys.readouterr().err
    return code == 2 and flag in err and "gouache: error:" in err


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_serve_refuses_the_flags_its_policy_would_ignore(policy, built_configs, capsys, tmp_path):
    cls = POLICIES[policy]
    cost = ["--cost-model", str(tmp_path / "cost.json")]
    base = ["serve", "--policy", policy, *(cost if cls.needs_predictor else [])]
    if not cls.needs_predictor:
        assert _refused(capsys, [*base, *cost], "--cost-model")
    else:
        assert _refused(capsys, ["serve", "--policy", policy], "--cost-model")
    if not cls.rounds:
        assert _refused(capsys, [*base, "--round-s", "0.5"], "--round-s")
    if not cls.mixes_resolutions:
        assert _refused(capsys, [*base, "--patch-size", "128"], "--patch-size")
    if not cls.uses_deadlines:
        assert _refused(capsys, [*base, "--tier-slo-ms", "priority=2000"], "--tier-slo-ms")
    if not cls.pauses:
        assert _refused(capsys, [*base, "--paused-host-mb", "512"], "--paused-host-mb")
    if not cls.needs_predictor:
        assert _refused(capsys, [*base, "--no-calibrate-steps"], "--calibrate-steps")


def test_serve_passes_the_flags_its_policy_reads(built_configs):
    with pytest.raises(_EngineBuilt):
        main(["serve", "--policy", "orca"])
    assert built_configs["scheduler"].cost_model is None and built_configs["engine"].patch_pixels is None
    with pytest.raises(_EngineBuilt):
        main(["serve", "--policy", "round-knapsack", "--cost-model", "c.json", "--round-s", "2"])
    assert built_configs["scheduler"].round_s == 2.0 and built_configs["scheduler"].cost_model == "c.json"
    assert built_configs["scheduler"].calibrate_steps
    with pytest.raises(_EngineBuilt):
        main(["serve", "--policy", "round-knapsack", "--cost-model", "c.json", "--no-calibrate-steps"])
    assert not built_configs["scheduler"].calibrate_steps
    with pytest.raises(_EngineBuilt):
        main(["serve", "--policy", "round-knapsack", "--cost-model", "c.json"])
    assert built_configs["scheduler"].round_s == 0.5
    with pytest.raises(_EngineBuilt):
        main(["serve", "--policy", "patched", "--patch-size", "64"])
    assert built_configs["engine"].patch_pixels == 64
    assert built_configs["engine"].tier_queue_share == (("flex", 0.5),)
    assert built_configs["engine"].paused_host_bytes == 0
    with pytest.raises(_EngineBuilt):
        main(["serve", "--policy", "orca", "--paused-host-mb", "512"])
    assert built_configs["engine"].paused_host_bytes == 512 << 20
    with pytest.raises(_EngineBuilt):
        main(["serve", "--policy", "patched-slo", "--cost-model", "c.json",
              "--tier-slo-ms", "priority=2000,default=9000", "--tier-queue-share", "flex=0.25,default=0.75"])
    assert built_configs["scheduler"].tier_slo_ms == (("priority", 2000.0), ("default", 9000.0))
    assert built_configs["engine"].tier_queue_share == (("flex", 0.25), ("default", 0.75))


# numbers a float holds that no tier flag may take: NaN, the infinities, -0.0, a float's extremes
EXTREMES = ("nan", "inf", "-inf", "-0.0", "0", "1e308", "-1e308", "1e309", "5e-324")


@pytest.mark.parametrize("flag, value", [
    ("--tier-slo-ms", "gold=100"), ("--tier-slo-ms", "priority=-1"), ("--tier-slo-ms", "priority=0.5"),
    ("--tier-slo-ms", "priority=1000000001"), ("--tier-queue-share", "flex=1.5"), ("--tier-queue-share", "flex"),
    *(("--tier-slo-ms", f"default=1000,priority={x}") for x in EXTREMES),
    *(("--tier-queue-share", f"flex={x}") for x in EXTREMES if x != "5e-324"),
])
def test_serve_refuses_a_malformed_tier_flag(flag, value, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--policy", "patched-slo", "--cost-model", "c.json", flag, value])
    assert exit_.value.code == 2 and "expected TIER=" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--tier-slo-ms", "--tier-queue-share"])
def test_serve_refuses_a_tier_given_twice(flag, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--policy", "patched-slo", "--cost-model", "c.json", flag, "flex=1,default=1,flex=1"])
    assert exit_.value.code == 2 and "flex is given twice" in capsys.readouterr().err


@pytest.mark.parametrize("value", [*EXTREMES[:4], "1e308", "5e-324", "-1", "0.5", str((1 << 30) + 1), "1" + "0" * 400])
def test_serve_refuses_a_memory_flag_outside_whole_mib(value, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--policy", "orca", f"--paused-host-mb={value}"])
    assert exit_.value.code == 2 and "--paused-host-mb: expected a whole number of MiB in [0, 1073741824]" in \
        capsys.readouterr().err


def test_serve_serves_the_ends_of_the_tier_flags_ranges(built_configs):
    from gouache.sched.tiers import queue_limit, refusal

    with pytest.raises(_EngineBuilt):
        main(["serve", "--policy", "patched-slo", "--cost-model", "c.json", "--tier-slo-ms", "priority=1,default=1e9",
              "--tier-queue-share", "flex=5e-324,default=1", "--paused-host-mb", str(1 << 30), "--max-queue-len",
              "1000000"])
    engine, scheduler = built_configs["engine"], built_configs["scheduler"]
    assert scheduler.tier_slo_ms == (("priority", 1.0), ("default", 1e9)) and engine.paused_host_bytes == 1 << 50
    # the smallest share still holds one place; the whole queue holds all of them
    assert queue_limit("flex", engine.max_queue_len, engine.tier_queue_share) == 1
    assert queue_limit("default", engine.max_queue_len, engine.tier_queue_share) == 1_000_000
    assert refusal(2, "a", 1.0, 1, [], 1) is None and refusal(2, "a", 1.0, 1, [(2, "b", 1.0)], 1) is not None


@pytest.mark.parametrize("value", ["0", "1000001", "1" + "0" * 400])
def test_serve_refuses_a_queue_length_outside_the_range(value, capsys):
    assert _refused(capsys, ["serve", "--policy", "orca", "--max-queue-len", value],
                    "max_queue_len must be in [1, 1000000]")


@pytest.mark.parametrize("flag, value, message", [
    ("--max-size", "16385", "max_size <= 16384"), ("--max-size", "32", "min_size <= max_size"),
    ("--max-steps", "10001", "max_steps must be in 1..10000"), ("--max-steps", "0", "max_steps must be in"),
    ("--max-n", "11", "max_n must be in 1..10"),
    *[(flag, value, name + " must be in") for flag, name in (("--shutdown-grace-s", "shutdown_grace_s"),
                                                             ("--request-timeout", "request_timeout_s"))
      for value in ("inf", "1e308", "nan", "86401")],
])
def test_serve_refuses_limits_and_timeouts_outside_what_it_serves(flag, value, message, capsys):
    """Before: an infinite grace or timeout was accepted, then overflowed the clock or poll it set."""
    assert _refused(capsys, ["serve", flag, value], message)


def test_generate_refuses_a_negative_prompt_without_guidance(tmp_path, capsys):
    out = str(tmp_path / "x.png")
    assert _refused(capsys, ["generate", "fox", "--negative-prompt", "blur", "--guidance", "1", "--size", "32x32",
                             "--steps", "1", "-o", out], "--negative-prompt")
    assert _refused(capsys, ["generate", "fox", "--model", "tiny-flux", "--negative-prompt", "blur", "--size", "32x32",
                             "--steps", "1", "-o", out], "--negative-prompt")


def test_bench_batching_refuses_flags_it_would_ignore(monkeypatch, capsys, tmp_path):
    from gouache.models import arch

    def build_arch(*args):
        raise AssertionError("the flags were accepted")

    monkeypatch.setattr(arch, "build_arch", build_arch)
    quick = ["--mixes", "SML", "--repeats", "1", "--out", str(tmp_path / "b.json")]
    assert _refused(capsys, ["bench", "batching", "--model", "sdxl-arch", "--steps", "5", *quick], "--steps")
    assert _refused(capsys, ["bench", "batching", "--model", "tiny-sd", "--sizes", "32,64,96,128", *quick], "--sizes")


def _commands(parser: argparse.ArgumentParser, path: str = "gouache") -> dict[str, argparse.ArgumentParser]:
    """Every (sub)command's parser by its command line, e.g. "gouache bench batching"."""
    commands = {path: parser}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                commands |= _commands(sub, f"{path} {name}")
    return commands


@pytest.mark.parametrize("command", list(_commands(build_parser())))
def test_every_option_names_its_default(command):
    parser = _commands(build_parser())[command]
    missing = [action.option_strings[-1] for action in parser._actions
               if action.option_strings and action.default not in (None, argparse.SUPPRESS)
               and "default" not in (action.help or "")]
    assert not missing


def test_models_lists_the_full_size_benchmark_architectures(capsys):
    from gouache.models.arch import ARCH_CONFIGS
    from gouache.models.zoo import BUILTIN_MODELS

    assert main(["models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for name in [*BUILTIN_MODELS, *ARCH_CONFIGS]:
        assert any(line.startswith(name + " ") for line in lines)
    for name in ARCH_CONFIGS:
        assert "full-size" in next(line for line in lines if line.startswith(name + " "))


@pytest.mark.slow
def test_torch_importing_commands_print_no_torchvision_warning():
    run = subprocess.run([sys.executable, "-m", "gouache.cli", "models"], capture_output=True, text=True, check=True)
    assert "tiny-sdxl" in run.stdout
    assert "torchvision" not in run.stderr


@pytest.mark.slow
def test_the_start_log_of_make_serve_holds_no_library_line(tmp_path):
    """Before: every start printed torchao's failures to load CUDA kernels built for another torch
    (diffusers and transformers import torchao whenever it is installed). torchao is now the
    `quantize` extra, absent from the server's virtualenv; the child hides this one's copy of it.
    Every line of the log must be the server's own (uvicorn's `LEVEL:` format)."""
    port = free_port()
    hide = "import sys; sys.modules['torchao'] = None; from gouache.cli import main; sys.exit(main(sys.argv[1:]))"
    server = subprocess.Popen([sys.executable, "-c", hide, "serve", "--port", str(port), "--lora-dir",
                               "gouache/weights/loras/shapes-unet", "--controlnet-dir",
                               "gouache/weights/controlnets/shapes-unet"], cwd=Path(__file__).parents[1],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert wait_healthy(server, f"http://127.0.0.1:{port}", timeout_s=120)
    finally:
        server.send_signal(signal.SIGTERM)
        log = server.communicate(timeout=60)[0]
    assert "Application startup complete" in log
    strangers = [line for line in log.splitlines() if line and not re.match(r"(INFO|WARNING|ERROR):\s", line)]
    assert strangers == []
    assert not any(line.startswith(("WARNING", "ERROR")) for line in log.splitlines())


@pytest.mark.parametrize("policies, message", [("orca,patched-slo", "patched-slo need a cost model"),
                                               ("orca,nope", "unknown policies")])
def test_bench_serve_refuses_policies_it_cannot_start(policies, message, capsys):
    """Before: a patched-slo server without --cost-model never became healthy."""
    assert main(["bench", "serve", "--policies", policies]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_serve_refuses_a_router_without_replicas_and_reports_a_replica_that_cannot_start(capsys, tmp_path):
    assert _refused(capsys, ["serve", "--router", "mask-aware"], "--router")
    assert _refused(capsys, ["serve", "--replicas", "0"], "replicas must be >= 1")
    assert _refused(capsys, ["serve", "--replicas", "2", "--model", str(tmp_path / "missing")], "did not start")


def test_reproduce_refuses_batching_costs_without_the_patchedserve_experiment(capsys, tmp_path):
    assert _refused(capsys, ["reproduce", "--only", "tetriserve", "--batching-costs", str(tmp_path / "b.json"),
                             "--out", str(tmp_path)], "--batching-costs")


def test_serve_takes_the_background_compile_flag_only_with_compile(built_configs, capsys):
    assert _refused(capsys, ["serve", "--no-compile-background"], "--compile-background")
    with pytest.raises(_EngineBuilt):
        main(["serve", "--compile"])
    assert built_configs["engine"].compile.background
    with pytest.raises(_EngineBuilt):
        main(["serve", "--compile", "--no-compile-background"])
    assert not built_configs["engine"].compile.background
