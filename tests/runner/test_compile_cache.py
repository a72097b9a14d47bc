"""The compile cache (`gouache.runner.compile_cache`) and compile failures (`gouache.runner.compiled`):
a kernel left damaged by a killed compile is moved aside and built anew, never loaded; a kernel
another process is building is left alone; a forward whose graph fails to compile runs eagerly,
counted as `compile_failed`; processes compiling at once on one cache all get the eager outputs.
Real compiles run in child processes (inductor keeps loaded kernels in memory, and a cache
directory is process-wide), on a module of one Linear layer so each takes seconds."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from filelock import FileLock
from torch import nn

from gouache.config import CompileConfig
from gouache.runner import compile_cache
from gouache.runner.compiled import COMPILE_FAILED, CompiledDenoiser

CHILD = textwrap.dedent("""
    import json, sys
    import torch
    from torch import nn
    from gouache.config import CompileConfig
    from gouache.runner.compiled import CompiledDenoiser

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.proj = nn.Linear(8, 8)

        def forward(self, sample, scale, return_dict=True):
            return (torch.nn.functional.gelu(self.proj(sample)) * scale,)

    model = Tiny()
    compiled = CompiledDenoiser(model, CompileConfig(enabled=True, buckets=(2,), cache_dir=sys.argv[1]),
                                torch.device("cpu"))
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    compiled.warm_up(compiled.row_graphs([({"sample": x}, {"scale": 2.0})]), progress=lambda line: None)
    with torch.no_grad(), compiled.step(None):
        out = compiled({"sample": x}, {"scale": 2.0})
        eager = model(x, 2.0)[0]
    report = compiled.take_report()
    print(json.dumps({"failed": report.failed, "eager": report.eager, "compiled": report.compiled,
                      "equal": (out - eager).abs().max().item() <= 1e-5}))
""")


def compile_in_child(cache: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    return subprocess.Popen([sys.executable, "-c", CHILD, str(cache)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def result(child: subprocess.Popen) -> dict:
    out, err = child.communicate(timeout=300)
    assert child.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def kernels(cache: Path) -> list[Path]:
    return sorted(p for p in cache.rglob("*.so") if compile_cache.DAMAGED not in p.parts)


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory) -> Path:
    """A cache directory holding the kernels of the child's module."""
    cache = tmp_path_factory.mktemp("compile-cache")
    assert result(compile_in_child(cache)) == {"failed": 0, "eager": {}, "compiled": 1, "equal": True}
    assert kernels(cache)
    return cache


@pytest.mark.slow
def test_a_whole_kernel_passes_and_every_truncation_of_it_is_damaged(warm_cache, tmp_path):
    kernel = max(kernels(warm_cache), key=lambda p: p.stat().st_size)
    assert compile_cache.damaged(kernel) is None
    data = kernel.read_bytes()
    for cut in (0, 3, 40, 64, len(data) // 2, len(data) - 1):
        (tmp_path / "k.so").write_bytes(data[:cut])
        assert compile_cache.damaged(tmp_path / "k.so") is not None, cut
    (tmp_path / "k.so").write_bytes(b"not a kernel" * 100)
    assert "no ELF header" in compile_cache.damaged(tmp_path / "k.so")


@pytest.mark.slow
def test_a_start_on_a_cache_with_truncated_kernels_moves_them_aside_and_compiles(warm_cache, tmp_path):
    """The found item: on 52af312 every later `--compile` start failed with 'file too short'."""
    cache = tmp_path / "cache"
    subprocess.run(["cp", "-a", str(warm_cache), str(cache)], check=True)
    truncated = kernels(cache)
    for kernel in truncated:
        kernel.write_bytes(b"")
    assert result(compile_in_child(cache)) == {"failed": 0, "eager": {}, "compiled": 1, "equal": True}
    assert len(list((cache / compile_cache.DAMAGED).iterdir())) == len(truncated)
    assert all(compile_cache.damaged(k) is None for k in kernels(cache))  # built anew


def test_a_kernel_whose_build_lock_is_held_is_left_alone(tmp_path):
    kernel = tmp_path / "ab" / "cabc.main.so"
    kernel.parent.mkdir()
    kernel.write_bytes(b"\x7fEL")  # half-written: another process is compiling it
    (tmp_path / "locks").mkdir()
    with FileLock(tmp_path / "locks" / "cabc.lock"):
        assert compile_cache.sweep(tmp_path) == []
    assert kernel.exists()
    assert compile_cache.sweep(tmp_path) == [kernel]  # the build died without finishing it
    assert not kernel.exists() and len(list((tmp_path / compile_cache.DAMAGED).iterdir())) == 1


@pytest.mark.slow
def test_processes_compiling_at_once_on_one_empty_cache_all_equal_eager(tmp_path):
    children = [compile_in_child(tmp_path) for _ in range(3)]
    assert [result(c) for c in children] == [{"failed": 0, "eager": {}, "compiled": 1, "equal": True}] * 3
    assert all(compile_cache.damaged(k) is None for k in kernels(tmp_path))


class Doubler(nn.Module):
    def forward(self, sample, return_dict=True):
        return (sample * 2,)


def test_a_forward_that_fails_to_compile_runs_eagerly_counted_and_is_not_tried_again(monkeypatch, tmp_path):
    compiled = CompiledDenoiser(Doubler(), CompileConfig(enabled=True, buckets=(2,)), torch.device("cpu"))
    calls, sweeps = [], []

    def broken(**inputs):
        calls.append(1)
        raise ImportError(f"{tmp_path}/c.main.so: file too short")

    compiled._compiled = broken
    monkeypatch.setattr(compile_cache, "sweep", lambda directory: sweeps.append(directory) or [])
    x = torch.arange(4.0).reshape(2, 2)
    for _ in range(3):
        with torch.no_grad(), compiled.step(None):
            assert torch.equal(compiled({"sample": x}, {}), x * 2)
    report = compiled.take_report()
    assert report.eager == {COMPILE_FAILED: 3} and report.compiled == 0 and report.failed == 1
    assert len(calls) == 1 and len(sweeps) == 1  # swept once, never tried again


def test_a_failure_that_a_sweep_repairs_is_compiled_on_the_second_try(monkeypatch, tmp_path):
    compiled = CompiledDenoiser(Doubler(), CompileConfig(enabled=True, buckets=(2,)), torch.device("cpu"))
    calls = []

    def damaged_once(sample, return_dict):
        calls.append(1)
        if len(calls) == 1:
            raise ImportError("file too short")
        return (sample * 2,)

    compiled._compiled = damaged_once
    monkeypatch.setattr(compile_cache, "sweep", lambda directory: [tmp_path / "c.main.so"])
    x = torch.ones(2, 3)
    with torch.no_grad(), compiled.step(None):
        assert torch.equal(compiled({"sample": x}, {}), x * 2)
    report = compiled.take_report()
    assert report.compiled == 1 and report.failed == 0 and report.eager == {} and len(calls) == 2
