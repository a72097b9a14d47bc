"""`benchmarks/gpu.sh`, before a GPU is at hand: every part's commands (as a lease would run
them, and as `--quick` runs them here) are ones the CLI accepts, and the `--quick` parts whose
commands no other test runs measure on the tiny models and write their files. A lease's 15
minutes should not find a typo."""

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from gouache.bench import fullsize
from gouache.cli import build_parser

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu.sh"
MODELS = ("sdxl", "sd3", "flux")
PARTS = ["gputests", "exactness", "controlnet-sdxl",
         *(f"cudagraphs-{section}-{m}" for section in ("edit", "batching", "lora", "mfu", "blockcache")
           for m in MODELS),
         *(f"{kind}-{m}" for kind in ("fullsize", "quant", "quantcompiled", "lora", "blockcache", "park")
           for m in MODELS),
         *(f"{kind}-{m}" for kind in ("compile", "batching", "profile") for m in ("sdxl", "sd3")),
         *(f"{kind}-{m}" for kind in ("profile-compiled", "baselines") for m in ("sd3", "flux"))]


def gpu_sh(*args: str) -> subprocess.CompletedProcess:
    """The script's run, its output and log in one stream (each part's commands follow its name)."""
    return subprocess.run(["bash", str(SCRIPT), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          cwd=SCRIPT.parents[1], env={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"},
                          stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("mode", [[], ["--quick"]], ids=["gpu", "quick"])
def test_every_part_prints_commands_the_cli_accepts(tmp_path, mode):
    done = gpu_sh(*mode, "--print", str(tmp_path), *PARTS)
    assert done.returncode == 0, done.stdout
    commands: dict[str, list[list[str]]] = {}
    part = None
    for line in done.stdout.splitlines():
        if line.startswith("== "):  # a part's start, or its end
            part = line.split()[1]
            commands.setdefault(part, [])
        elif line.strip():
            commands[part].append(shlex.split(line))
    commands = {part.removesuffix(":"): argvs for part, argvs in commands.items() if not part.endswith(":")}
    assert list(commands) == PARTS and all(commands.values())
    parser = build_parser()
    for part, argvs in commands.items():
        for argv in argvs:
            while argv[0] == "env" or "=" in argv[0]:  # env VAR=value ...
                argv = argv[1:]
            assert argv[0] == "python3", (part, argv)
            if argv[1:3] == ["-m", "gouache.cli"]:
                args = parser.parse_args(argv[3:])  # exits (fails the test) on an argument it does not take
                if argv[3:5] == ["bench", "fullsize"]:
                    fullsize._settings(args)  # the bench's own checks: sizes, variants, sections
                assert ("--device" not in argv or argv[argv.index("--device") + 1]
                        == ("cpu" if mode else "cuda")), (part, argv)
            elif argv[1:3] == ["-m", "pytest"]:
                tests = [a for a in argv if a.startswith("tests/")]
                assert tests and all((SCRIPT.parents[1] / t).is_file() for t in tests), (part, argv)
            else:
                assert (SCRIPT.parents[1] / argv[1]).is_file(), (part, argv)


@pytest.mark.slow
def test_quick_parts_measure_on_the_tiny_models(tmp_path):
    """The parts no other test runs a command of: a DiT's template replay in the compiled
    variant's pieces (its graphs planned from its section), and the profile of compiled steps.
    (The other benches' commands run in their own tests; running every part here takes about 9
    minutes, which the suite cannot spend.)"""
    parts = ["cudagraphs-edit-flux", "profile-compiled-flux"]
    done = gpu_sh("--quick", str(tmp_path), *parts)
    assert done.returncode == 0, done.stdout[-3000:]
    for part in parts:
        assert f"== {part}: exit 0" in done.stdout
    edit = json.loads((tmp_path / "edit_cudagraphs_flux-arch_cpu.json").read_text())
    assert edit["template_over_full"]["tiny-flux"]["0.1"]["compiled"] > 0
    steps = edit["steps"]["tiny-flux"]
    for row in ("template edit 0.1", "full edit 0.1"):  # the replay in the pieces, the full edit in its graph
        assert steps[row]["compiled"]["paths"] == {"compiled": 1} and steps[row]["eager"]["paths"] == {}
    report = json.loads((tmp_path / "costmodel_compiled_flux-arch_cpu.report.json").read_text())
    assert report["compiled"] and report["samples"] > 0
