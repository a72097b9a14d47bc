"""Shapes first met while serving, compiled off the serving path (`gouache.runner.background`):
the shape's steps run eagerly (reason `compiling`) while a child process compiles it into the
cache, then the server compiles it from there (a cache hit) and runs it compiled, equal to eager.
The server side runs in a child process too (a compile cache directory is process-wide)."""

import json
import logging
import os
import pickle
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from gouache.config import CompileConfig
from gouache.executor.worker import WorkerSpec, compiled_denoiser
from gouache.models.zoo import load_pipeline
from gouache.request import ImageRequest
from gouache.runner.background import BackgroundCompiler, Recipe, _move
from gouache.runner.compiled import Graph
from gouache.runner.model_runner import ModelRunner

ROOT = Path(__file__).resolve().parents[2]


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(8, 8)

    def forward(self, sample, scale, return_dict=True):
        return (torch.nn.functional.gelu(self.proj(sample)) * scale,)


def tiny(cache: str):
    """The recipe of the server below: its compiled denoiser, built again in the child."""
    from gouache.runner.compiled import CompiledDenoiser

    return CompiledDenoiser(Tiny(), CompileConfig(enabled=True, buckets=(2,), cache_dir=cache), torch.device("cpu"))


SERVER = textwrap.dedent("""
    import json, sys, time
    import torch
    import torch._dynamo.utils
    from gouache.runner.background import BackgroundCompiler, Recipe
    from tests.runner.test_background import tiny

    compiled = tiny(sys.argv[1])
    compiled.background = BackgroundCompiler(Recipe("tests.runner.test_background:tiny", sys.argv[1]), compiled.cache)
    compiled.warm_up(compiled.row_graphs([({"sample": torch.randn(2, 8)}, {"scale": 2.0})]), progress=lambda line: None)
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(1))  # a shape the warm-up did not compile
    eager = compiled.denoiser(x, 2.0)[0]
    steps = []
    for _ in range(3):
        with torch.no_grad(), compiled.step(None):
            out = compiled({"sample": x}, {"scale": 2.0})
        report = compiled.take_report()
        steps.append({"eager": report.eager, "compiled": report.compiled, "recompiles": report.recompiles,
                      "equal": (out - eager).abs().max().item() <= 1e-5})
        began = time.monotonic()
        while compiled.background.pending and time.monotonic() - began < 240:
            time.sleep(0.2)
    compiled.close()
    print(json.dumps({"steps": steps, "hits": torch._dynamo.utils.counters["inductor"]["fxgraph_cache_hit"]}))
""")


def serve(script: str, cache: Path) -> dict:
    """Run a server `script` (in a process of its own: the compile cache directory is
    process-wide) on compile cache `cache`; what it printed last, as JSON."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    done = subprocess.run([sys.executable, "-c", script, str(cache)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_new_shape_runs_eagerly_while_a_child_compiles_it_then_compiled_from_the_cache(tmp_path):
    result = serve(SERVER, tmp_path / "cache")
    # first met: eager while the child compiles; once it has, the next step loads its kernels (a cache
    # hit, counted as the one graph compiled after the warm-up) and the one after runs them
    first, loaded, then = result["steps"]
    assert first == {"eager": {"compiling": 1}, "compiled": 0, "recompiles": 0, "equal": True}
    assert loaded == {"eager": {}, "compiled": 1, "recompiles": 1, "equal": True}
    assert then == {"eager": {}, "compiled": 1, "recompiles": 0, "equal": True}
    assert result["hits"] == 1


@pytest.mark.slow
def test_the_warm_up_leaves_patched_forwards_to_the_child_foreseen_not_recompiles(tmp_path):
    """A patched UNet's graphs (`CompiledDenoiser.patched`) and its template replays'
    (`replayed`), slow to compile, are queued for the child at the end of the warm-up with what
    the child rebuilds each from (through its job's pickle: the same key); compiled after the
    warm-up, they are no recompile: it foresaw them."""
    config = CompileConfig(enabled=True, buckets=(2, 4), sizes=((64, 64), (32, 32)), cache_dir=str(tmp_path))
    runner = ModelRunner(load_pipeline("tiny-sd"), compile=config)
    compiled, queued = runner.family.compiled, {}
    compiled.background = SimpleNamespace(submit=queued.update, close=lambda: None)
    warm = [runner.family.prepare(ImageRequest(f"w{s}", "warm-up", s, s, 2, 5.0, seed=0)) for s in (64, 32)]
    replays = runner.family.replay_graphs(warm)
    later = runner.family.patched_graphs(warm) + replays
    assert {graph.key[0] for graph in replays} == {"template"} and len(replays) == 4  # 2 sizes, buckets 2 and 4
    compiled.warm_up([], progress=lambda line: None, later=later)
    assert later and list(queued) == [graph.key for graph in later]
    child = compiled_denoiser(WorkerSpec("tiny-sd", compile=config))
    for key, forward in queued.items():
        assert child.graph(*pickle.loads(pickle.dumps(_move(forward, "cpu")))).key == key
    # what compiling them after the warm-up counts (a trivial graph in their place: compiling a
    # patched UNet is tests/runner/test_compiled.py's)
    compiled.take_report()
    for key in (later[0].key, ("not foreseen",)):
        graph = torch.compile(lambda x: x + 1, dynamic=False)
        compiled._compiled_forward(Graph(key, lambda graph=graph: graph(torch.ones(len(key))), "trivial"))
    report = compiled.take_report()
    assert report.graphs == 2 and report.recompiles == 1


@pytest.mark.slow
def test_a_child_that_fails_lets_its_shapes_compile_in_their_step_and_says_why(tmp_path, caplog):
    background = BackgroundCompiler(Recipe("gouache.no_such_module:build", None), tmp_path)
    forward = ({"sample": torch.zeros(2, 8)}, {"scale": 2.0})
    try:
        assert not background.ready(("k",), forward) and background.pending == 1
        background.submit({("k",): forward, ("l",): forward, ("m",): forward})  # the next child takes both new ones
        assert background.pending == 3 and len(background._queued) == 2
        began = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="gouache.runner.background"):
            while background.pending and time.monotonic() - began < 120:
                time.sleep(0.2)
        assert all(background.ready(key, forward) for key in (("k",), ("l",), ("m",)))
        assert "exit code 1" in caplog.text and "No module named 'gouache.no_such_module'" in caplog.text
    finally:
        background.close()


def test_a_child_starts_at_the_lowest_priority_and_closing_stops_it_and_removes_its_files(tmp_path):
    background = BackgroundCompiler(Recipe("gouache.no_such_module:build", None), tmp_path)
    background.ready(("k",), ({"sample": torch.zeros(2, 8)}, {}))
    child, files = background._child, background._files
    # niced before its interpreter starts (then SCHED_IDLE where Linux has it): its imports yield too
    deadline = time.monotonic() + 5
    while os.getpriority(os.PRIO_PROCESS, child.pid) < 19 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert os.getpriority(os.PRIO_PROCESS, child.pid) == 19
    background.close()
    assert child.poll() is not None and not files.exists()


def test_the_recipe_builds_the_denoiser_a_server_compiles():
    """The child's denoiser (`compiled_denoiser`) is the runner's: the same modules, attention
    processors and hooks (adapter slots included), so their graphs' kernels are one."""
    spec = WorkerSpec("tiny-sd", compile=CompileConfig(enabled=True))

    def layout(denoiser: nn.Module) -> list:
        return [(name, type(m).__name__, type(getattr(m, "processor", None)).__name__, len(m._forward_hooks),
                 len(m._forward_pre_hooks)) for name, m in denoiser.named_modules()]

    for lora in (spec.lora, spec.lora.__class__(directory="/nonexistent")):
        spec_l = spec.__class__(spec.model, compile=spec.compile, lora=lora)
        runner = ModelRunner(load_pipeline("tiny-sd"), compile=spec.compile, lora=lora)
        assert layout(compiled_denoiser(spec_l).denoiser) == layout(runner.family.compiled.denoiser)
